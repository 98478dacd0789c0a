//! [`attend_tile`] against a softmax computed in f64 over all of a row's positions at once.
//!
//! On an AVX-512 machine the cases with feature-major keys, no soft cap, no ALiBi and value
//! widths a multiple of 16 take the intrinsics path; the others (row-major keys, a soft cap,
//! ALiBi, value widths 8, 40 or 100) the lane loops, so that both are held to one reference.

use super::*;

/// `length` values spread over [-2, 2] without a pattern a kernel could get right by accident.
fn spread_values(length: usize, salt: usize) -> Vec<f32> {
    (0..length)
        .map(|i| (((i + salt) * 37 % 101) as f32 - 50.0) / 25.0)
        .collect()
}

/// The positions of one row, all of its key/value head's keys and values, and how they are
/// cut into tiles.
struct Case {
    heads: usize,
    dim: usize,
    value_dim: usize,
    /// Positions per tile, in the order the row reads them.
    tiles: Vec<usize>,
    layout: KeyLayout,
    softcap: Option<f32>,
    alibi: bool,
}

/// One tile's keys and values as they would lie in memory, with padding around them so that
/// reading past the tile is caught by the comparison (the padding is NaN).
struct StoredTile {
    keys: Vec<f32>,
    key_stride: usize,
    values: Vec<f32>,
    value_stride: usize,
    count: usize,
}

impl StoredTile {
    /// Key `i`'s feature `f`.
    fn key(&self, layout: KeyLayout, i: usize, f: usize) -> f32 {
        match layout {
            KeyLayout::Columns => self.keys[f * self.key_stride + i],
            KeyLayout::Rows => self.keys[i * self.key_stride + f],
        }
    }

    fn value(&self, i: usize, c: usize) -> f32 {
        self.values[i * self.value_stride + c]
    }
}

fn stored_tile(case: &Case, count: usize, salt: usize) -> StoredTile {
    // Keys of a later tile scaled up, so that its maximum is new and the running sums rescale.
    let scale = 1.0 + salt as f32 * 0.75;
    let (key_stride, key_len) = match case.layout {
        KeyLayout::Columns => (count + 3, case.dim * (count + 3)),
        KeyLayout::Rows => (case.dim + 2, count * (case.dim + 2)),
    };
    let value_stride = case.value_dim + 5;
    let mut keys: Vec<f32> = spread_values(key_len, salt)
        .into_iter()
        .map(|k| k * scale)
        .collect();
    let mut values = spread_values(count * value_stride, salt + 11);
    // Poison the padding: a kernel that reads it gives NaN.
    for (i, key) in keys.iter_mut().enumerate() {
        let padding = match case.layout {
            KeyLayout::Columns => i % key_stride >= count,
            KeyLayout::Rows => i % key_stride >= case.dim,
        };
        if padding {
            *key = f32::NAN;
        }
    }
    for (i, value) in values.iter_mut().enumerate() {
        if i % value_stride >= case.value_dim {
            *value = f32::NAN;
        }
    }
    StoredTile {
        keys,
        key_stride,
        values,
        value_stride,
        count,
    }
}

/// Runs `case` through `attend_tile` and the reference; panics where they differ.
fn check(case: &Case) {
    let Case {
        heads,
        dim,
        value_dim,
        ..
    } = *case;
    let queries: Vec<f32> = spread_values(heads * dim, 5)
        .into_iter()
        .map(|q| q / (dim as f32).sqrt())
        .collect();
    let slopes: Vec<f32> = (0..heads).map(|h| 0.5f32.powi(h as i32 + 1)).collect();
    let tiles: Vec<StoredTile> = case
        .tiles
        .iter()
        .enumerate()
        .map(|(salt, &count)| stored_tile(case, count, salt))
        .collect();
    let total: usize = case.tiles.iter().sum();
    // The row's query sits right after its last position: distance `total - 1 - position`.
    let mut outputs = vec![0.0f32; heads * value_dim];
    let mut maxima = vec![f32::NEG_INFINITY; heads];
    let mut sums = vec![0.0f32; heads];
    let mut first_position = 0;
    for tile in &tiles {
        let mut row = OnlineRow {
            queries: &queries,
            outputs: &mut outputs,
            maxima: &mut maxima,
            sums: &mut sums,
        };
        let key_tile = KeyTile {
            keys: &tile.keys,
            key_stride: tile.key_stride,
            layout: case.layout,
            values: &tile.values,
            value_stride: tile.value_stride,
            count: tile.count,
        };
        let rule = LogitRule {
            softcap: case.softcap,
            alibi: case.alibi.then_some(slopes.as_slice()),
            first_distance: total - 1 - first_position,
        };
        attend_tile(&mut row, key_tile, rule);
        first_position += tile.count;
    }
    for head in 0..heads {
        let query = &queries[head * dim..][..dim];
        let mut logits = Vec::new();
        let mut rows = Vec::new();
        let mut position = 0;
        for tile in &tiles {
            for i in 0..tile.count {
                let mut logit: f64 = (0..dim)
                    .map(|f| f64::from(query[f]) * f64::from(tile.key(case.layout, i, f)))
                    .sum();
                if let Some(cap) = case.softcap {
                    logit = f64::from(cap) * (logit / f64::from(cap)).tanh();
                }
                if case.alibi {
                    logit -= f64::from(slopes[head]) * (total - 1 - position) as f64;
                }
                logits.push(logit);
                rows.push((tile, i));
                position += 1;
            }
        }
        let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
        let sum: f64 = weights.iter().sum();
        assert!(
            (f64::from(maxima[head]) - max).abs() <= 1e-4 * (1.0 + max.abs()),
            "head {head}: maximum {} against {max}",
            maxima[head]
        );
        // The kernel's sums are relative to its own maximum, which matches the reference's.
        assert!(
            (f64::from(sums[head]) - sum).abs() <= 1e-4 * sum,
            "head {head}: sum {} against {sum}",
            sums[head]
        );
        for c in 0..value_dim {
            let expected: f64 = weights
                .iter()
                .zip(&rows)
                .map(|(w, (tile, i))| w * f64::from(tile.value(*i, c)))
                .sum::<f64>()
                / sum;
            let ours = f64::from(outputs[head * value_dim + c]) / f64::from(sums[head]);
            assert!(
                (ours - expected).abs() <= 1e-5 * (1.0 + expected.abs()),
                "heads {heads}, dim {dim}, value_dim {value_dim}, tiles {:?}, {:?}, softcap \
                 {:?}, alibi {}: head {head} column {c}: {ours} against {expected}",
                case.tiles,
                case.layout,
                case.softcap,
                case.alibi
            );
        }
    }
}

#[test]
fn attend_tile_matches_a_softmax_over_all_positions_for_every_shape() {
    for layout in [KeyLayout::Columns, KeyLayout::Rows] {
        for heads in [1, 3, 4, 5, 8] {
            for (dim, value_dim) in [(1, 8), (16, 16), (17, 40), (64, 64), (32, 80), (64, 100)] {
                for tiles in [vec![16], vec![1], vec![7, 16, 3], vec![32, 17, 40]] {
                    check(&Case {
                        heads,
                        dim,
                        value_dim,
                        tiles,
                        layout,
                        softcap: None,
                        alibi: false,
                    });
                }
            }
        }
    }
}

#[test]
fn attend_tile_applies_the_soft_cap_and_alibi_penalty() {
    for layout in [KeyLayout::Columns, KeyLayout::Rows] {
        for (softcap, alibi) in [(Some(2.0), false), (None, true), (Some(5.0), true)] {
            for heads in [1, 4, 6] {
                check(&Case {
                    heads,
                    dim: 24,
                    value_dim: 64,
                    tiles: vec![16, 5, 33],
                    layout,
                    softcap,
                    alibi,
                });
            }
        }
    }
}

#[test]
fn attend_tile_leaves_a_row_unchanged_for_an_empty_tile() {
    let queries = [1.0f32; 8];
    let mut outputs = [2.0f32; 8];
    let mut maxima = [0.5f32; 2];
    let mut sums = [3.0f32; 2];
    let mut row = OnlineRow {
        queries: &queries,
        outputs: &mut outputs,
        maxima: &mut maxima,
        sums: &mut sums,
    };
    let tile = KeyTile {
        keys: &[],
        key_stride: 0,
        layout: KeyLayout::Columns,
        values: &[],
        value_stride: 4,
        count: 0,
    };
    let rule = LogitRule {
        softcap: None,
        alibi: None,
        first_distance: 0,
    };
    attend_tile(&mut row, tile, rule);
    assert_eq!((outputs, maxima, sums), ([2.0; 8], [0.5; 2], [3.0; 2]));
}

#[test]
#[should_panic(expected = "positions need")]
fn attend_tile_refuses_a_tile_shorter_than_its_count() {
    let queries = [1.0f32; 4];
    let mut outputs = [0.0f32; 4];
    let mut maxima = [f32::NEG_INFINITY];
    let mut sums = [0.0f32];
    let mut row = OnlineRow {
        queries: &queries,
        outputs: &mut outputs,
        maxima: &mut maxima,
        sums: &mut sums,
    };
    // Four features of 16 keys need 64 values; 63 are there.
    let keys = [0.0f32; 63];
    let values = [0.0f32; 64];
    let tile = KeyTile {
        keys: &keys,
        key_stride: 16,
        layout: KeyLayout::Columns,
        values: &values,
        value_stride: 4,
        count: 16,
    };
    let rule = LogitRule {
        softcap: None,
        alibi: None,
        first_distance: 0,
    };
    attend_tile(&mut row, tile, rule);
}

#[test]
#[should_panic(expected = "whole heads")]
fn attend_tile_refuses_queries_that_are_not_whole_heads() {
    let queries = [1.0f32; 5];
    let mut outputs = [0.0f32; 4];
    let mut maxima = [f32::NEG_INFINITY; 2];
    let mut sums = [0.0f32; 2];
    let mut row = OnlineRow {
        queries: &queries,
        outputs: &mut outputs,
        maxima: &mut maxima,
        sums: &mut sums,
    };
    let tile = KeyTile {
        keys: &[],
        key_stride: 0,
        layout: KeyLayout::Rows,
        values: &[],
        value_stride: 2,
        count: 0,
    };
    let rule = LogitRule {
        softcap: None,
        alibi: None,
        first_distance: 0,
    };
    attend_tile(&mut row, tile, rule);
}
