//! [`attend_tile`] against a softmax computed in f64 over all of a row's positions at once.
//!
//! On an AVX-512 machine the cases with feature-major keys, no soft cap, no ALiBi and value
//! widths a multiple of 16 take the intrinsics path (for int8 and f16, whole parts of 16
//! positions); the others (row-major keys, a soft cap, ALiBi, value widths 8, 40 or 100, int8's
//! and f16's partial parts) the lane loops, so that both are held to one reference, in f32, f16
//! and int8.

use burn::tensor::f16;

use super::ahead::CACHE_LINE;
use super::*;

/// The element a case's tiles store their keys and values in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Element {
    F32,
    /// [`attend_half_tile`]: the f32 keys and values rounded to f16.
    F16,
    /// [`attend_int8_tile`]: i8 with a scale per position.
    I8,
}

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
    softcap: Option<f32>,
    alibi: bool,
    element: Element,
    /// Whether every four tiles of 16 in a row go through the run entry points (as a paged
    /// pool's blocks of 16), not one at a time.
    runs: bool,
}

/// A tile's int8 form: `keys`/`values` in the f32 form's layout, and the scales.
struct Int8Tile {
    keys: Vec<i8>,
    values: Vec<i8>,
    key_scales: Vec<f32>,
    value_scales: Vec<f32>,
}

/// Key scales lie side by side, value scales every other element (strides 1 and 2), as an
/// int8 paged block's scales may.
const VALUE_SCALE_STRIDE: usize = 2;

/// One tile's keys and values as they would lie in memory, with padding around them so that
/// reading past the tile is caught by the comparison (the padding is NaN).
struct StoredTile {
    keys: Vec<f32>,
    key_stride: usize,
    values: Vec<f32>,
    value_stride: usize,
    count: usize,
    int8: Option<Int8Tile>,
    /// The keys and values rounded to f16 (NaN padding stays NaN).
    half: Option<(Vec<f16>, Vec<f16>)>,
}

impl StoredTile {
    /// Key `i`'s feature `f` (dequantized, for int8).
    fn key(&self, i: usize, f: usize) -> f32 {
        let index = f * self.key_stride + i;
        match (&self.int8, &self.half) {
            (Some(int8), _) => f32::from(int8.keys[index]) * int8.key_scales[i],
            (None, Some((keys, _))) => keys[index].to_f32(),
            (None, None) => self.keys[index],
        }
    }

    fn value(&self, i: usize, c: usize) -> f32 {
        let index = i * self.value_stride + c;
        match (&self.int8, &self.half) {
            (Some(int8), _) => {
                f32::from(int8.values[index]) * int8.value_scales[i * VALUE_SCALE_STRIDE]
            }
            (None, Some((_, values))) => values[index].to_f32(),
            (None, None) => self.values[index],
        }
    }
}

/// `values` (in [-2, 2]) as i8 steps of 1/60, so that every i8 from -120 to 120 occurs.
fn as_int8(values: &[f32]) -> Vec<i8> {
    values.iter().map(|v| (v * 60.0).round() as i8).collect()
}

fn stored_tile(case: &Case, count: usize, salt: usize) -> StoredTile {
    // Keys of a later tile scaled up, so that its maximum is new and the running sums rescale.
    let scale = 1.0 + salt as f32 * 0.75;
    let (key_stride, key_len) = (count + 3, case.dim * (count + 3));
    let value_stride = case.value_dim + 5;
    let mut keys: Vec<f32> = spread_values(key_len, salt)
        .into_iter()
        .map(|k| k * scale)
        .collect();
    let mut values = spread_values(count * value_stride, salt + 11);
    // Poison the padding: a kernel that reads it gives NaN.
    for (i, key) in keys.iter_mut().enumerate() {
        if i % key_stride >= count {
            *key = f32::NAN;
        }
    }
    for (i, value) in values.iter_mut().enumerate() {
        if i % value_stride >= case.value_dim {
            *value = f32::NAN;
        }
    }
    let half = (case.element == Element::F16).then(|| {
        let rounded = |values: &[f32]| values.iter().map(|&v| f16::from_f32(v)).collect();
        (rounded(&keys), rounded(&values))
    });
    let int8 = (case.element == Element::I8).then(|| Int8Tile {
        keys: as_int8(&spread_values(key_len, salt)),
        values: as_int8(&spread_values(count * value_stride, salt + 11)),
        // Scales that differ by position, larger in later tiles (a new maximum again).
        key_scales: (0..count)
            .map(|i| scale * (1.0 + (i % 5) as f32) / 150.0)
            .collect(),
        value_scales: (0..count * VALUE_SCALE_STRIDE)
            .map(|i| (1.0 + (i % 7) as f32) / 90.0)
            .collect(),
    });
    StoredTile {
        keys,
        key_stride,
        values,
        value_stride,
        count,
        int8,
        half,
    }
}

/// A tile's f32 keys and values (its f32 form).
fn float_tile(tile: &StoredTile) -> KeyTile<'_> {
    KeyTile {
        keys: &tile.keys,
        key_stride: tile.key_stride,
        values: &tile.values,
        value_stride: tile.value_stride,
        count: tile.count,
    }
}

/// A tile's f16 keys and values.
fn half_tile(tile: &StoredTile) -> KeyTile<'_, f16> {
    let (keys, values) = tile.half.as_ref().expect("an f16 case");
    KeyTile {
        keys,
        values,
        ..float_tile(tile).with_elements()
    }
}

/// A tile's int8 keys and values, and their scales.
fn int8_tile(tile: &StoredTile) -> (KeyTile<'_, i8>, TileScales<'_>) {
    let int8 = tile.int8.as_ref().expect("an int8 case");
    let scales = TileScales {
        keys: &int8.key_scales,
        key_stride: 1,
        values: &int8.value_scales,
        value_stride: VALUE_SCALE_STRIDE,
    };
    let tile = KeyTile {
        keys: int8.keys.as_slice(),
        values: int8.values.as_slice(),
        ..float_tile(tile).with_elements()
    };
    (tile, scales)
}

impl KeyTile<'_> {
    /// The strides and count, over no elements (for the other forms' tiles to take).
    fn with_elements<E>(self) -> KeyTile<'static, E> {
        KeyTile {
            keys: Default::default(),
            key_stride: self.key_stride,
            values: Default::default(),
            value_stride: self.value_stride,
            count: self.count,
        }
    }
}

/// `group` (one tile, or a run of [`RUN_BLOCKS`] tiles of 16) added to `row` through the entry
/// point of the case's element.
fn attend_stored(row: &mut OnlineRow, group: &[StoredTile], rule: LogitRule) {
    let element = match (&group[0].int8, &group[0].half) {
        (Some(_), _) => Element::I8,
        (None, Some(_)) => Element::F16,
        (None, None) => Element::F32,
    };
    if let [tile] = group {
        match element {
            Element::F32 => attend_tile(row, float_tile(tile), rule),
            Element::F16 => attend_half_tile(row, half_tile(tile), rule),
            Element::I8 => {
                let (tile, scales) = int8_tile(tile);
                attend_int8_tile(row, tile, scales, rule);
            }
        }
        return;
    }
    match element {
        Element::F32 => attend_run(row, &std::array::from_fn(|b| float_tile(&group[b])), rule),
        Element::F16 => {
            attend_half_run(row, &std::array::from_fn(|b| half_tile(&group[b])), rule);
        }
        Element::I8 => {
            let blocks = std::array::from_fn(|b| int8_tile(&group[b]).0);
            let scales = std::array::from_fn(|b| int8_tile(&group[b]).1);
            attend_int8_run(row, &blocks, &scales, rule);
        }
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
    let mut index = 0;
    while index < tiles.len() {
        let run = case.runs
            && tiles
                .get(index..index + RUN_BLOCKS)
                .is_some_and(|run| run.iter().all(|tile| tile.count == LANES));
        let group = &tiles[index..index + if run { RUN_BLOCKS } else { 1 }];
        let mut row = OnlineRow {
            queries: &queries,
            outputs: &mut outputs,
            maxima: &mut maxima,
            sums: &mut sums,
            ahead: None,
        };
        let rule = LogitRule {
            softcap: case.softcap,
            alibi: case.alibi.then_some(slopes.as_slice()),
            first_distance: total - 1 - first_position,
        };
        attend_stored(&mut row, group, rule);
        first_position += group.iter().map(|tile| tile.count).sum::<usize>();
        index += group.len();
    }
    for head in 0..heads {
        let query = &queries[head * dim..][..dim];
        let mut logits = Vec::new();
        let mut rows = Vec::new();
        let mut position = 0;
        for tile in &tiles {
            for i in 0..tile.count {
                let mut logit: f64 = (0..dim)
                    .map(|f| f64::from(query[f]) * f64::from(tile.key(i, f)))
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
                "heads {heads}, dim {dim}, value_dim {value_dim}, tiles {:?}, softcap {:?}, \
                 alibi {}, {:?}: head {head} column {c}: {ours} against {expected}",
                case.tiles,
                case.softcap,
                case.alibi,
                case.element
            );
        }
    }
}

/// Every shape, in `element`.
fn matches_for_every_shape(element: Element) {
    for heads in [1, 2, 3, 4, 5, 6, 8] {
        for (dim, value_dim) in [(1, 8), (16, 16), (17, 40), (64, 64), (32, 80), (64, 100)] {
            // Parts of 16 positions, fewer, and 64 (AVX-512's wide parts: 150 is two, a
            // whole vector and 6 positions).
            let tile_lists = [
                vec![16],
                vec![1],
                vec![7, 16, 3],
                vec![32, 17, 40],
                vec![64],
                vec![150, 64],
            ];
            for tiles in tile_lists {
                check(&Case {
                    heads,
                    dim,
                    value_dim,
                    tiles,
                    softcap: None,
                    alibi: false,
                    element,
                    runs: false,
                });
            }
        }
    }
}

#[test]
fn attend_tile_matches_a_softmax_over_all_positions_for_every_shape() {
    matches_for_every_shape(Element::F32);
}

#[test]
fn attend_half_tile_matches_a_softmax_over_the_f16_positions_for_every_shape() {
    matches_for_every_shape(Element::F16);
}

#[test]
fn attend_int8_tile_matches_a_softmax_over_the_dequantized_positions_for_every_shape() {
    matches_for_every_shape(Element::I8);
}

/// The rules in every path: tiles of 16, fewer, and 64 (AVX-512's wide parts), values 64 wide
/// (the AVX-512 path's) and 40 (the AVX2 path's on any AVX2 machine).
#[test]
fn attend_tile_applies_the_soft_cap_and_alibi_penalty() {
    for element in [Element::F32, Element::F16, Element::I8] {
        for (softcap, alibi) in [(Some(2.0), false), (None, true), (Some(5.0), true)] {
            for heads in [1, 4, 6] {
                for value_dim in [64, 40] {
                    check(&Case {
                        heads,
                        dim: 24,
                        value_dim,
                        tiles: vec![16, 5, 33, 64, 150],
                        softcap,
                        alibi,
                        element,
                        runs: false,
                    });
                }
            }
        }
    }
}

/// Runs of four blocks of 16 (a paged pool's default blocks, read as one wide part) held to
/// the reference in every element, with and without the rules, among tiles of their own; value
/// widths 40 and 80 are not the AVX-512 path's whole vectors in every part, so that a run's
/// blocks go one at a time through the other paths too.
#[test]
fn attend_run_matches_a_softmax_over_all_positions() {
    for element in [Element::F32, Element::F16, Element::I8] {
        for (softcap, alibi) in [(None, false), (Some(5.0), true)] {
            for heads in [1, 2, 4, 6] {
                for (dim, value_dim) in [(16, 16), (64, 64), (17, 40), (32, 80), (24, 8)] {
                    check(&Case {
                        heads,
                        dim,
                        value_dim,
                        tiles: vec![16, 16, 16, 16, 5, 16, 16, 16, 16, 16, 16],
                        softcap,
                        alibi,
                        element,
                        runs: true,
                    });
                }
            }
        }
    }
}

#[test]
#[should_panic(expected = "a run's blocks 16 each")]
fn attend_run_refuses_a_block_of_other_than_16_positions() {
    let mut buffers = RowBuffers::new(4, 4, 1);
    let (keys, values) = ([1.0f32; 64], [1.0f32; 64]);
    let blocks = [16, 16, 15, 16].map(|count| KeyTile {
        count,
        ..columns_tile(&keys, &values, 16)
    });
    let rule = LogitRule {
        first_distance: 100,
        ..PLAIN
    };
    attend_run(&mut buffers.row(), &blocks, rule);
}

#[test]
#[should_panic(expected = "do not all lie at or before it")]
fn attend_run_refuses_a_run_that_reaches_past_the_query() {
    let mut buffers = RowBuffers::new(4, 4, 1);
    let (keys, values) = ([1.0f32; 64], [1.0f32; 64]);
    let blocks = [16; RUN_BLOCKS].map(|count| columns_tile(&keys, &values, count));
    // The run's last position would be one after the query.
    let rule = LogitRule {
        first_distance: 62,
        ..PLAIN
    };
    attend_run(&mut buffers.row(), &blocks, rule);
}

/// Logits that are the scores.
const PLAIN: LogitRule = LogitRule {
    softcap: None,
    alibi: None,
    first_distance: 0,
};

/// A row's buffers for the small tests: `queries` and `outputs` wide, `heads` heads, before its
/// first tile.
struct RowBuffers {
    queries: Vec<f32>,
    outputs: Vec<f32>,
    maxima: Vec<f32>,
    sums: Vec<f32>,
}

impl RowBuffers {
    fn new(queries: usize, outputs: usize, heads: usize) -> Self {
        Self {
            queries: vec![1.0; queries],
            outputs: vec![0.0; outputs],
            maxima: vec![f32::NEG_INFINITY; heads],
            sums: vec![0.0; heads],
        }
    }

    fn row(&mut self) -> OnlineRow<'_> {
        OnlineRow {
            queries: &self.queries,
            outputs: &mut self.outputs,
            maxima: &mut self.maxima,
            sums: &mut self.sums,
            ahead: None,
        }
    }
}

/// A feature-major tile of `count` positions over `keys` and `values` (4 features each).
fn columns_tile<'a, E>(keys: &'a [E], values: &'a [E], count: usize) -> KeyTile<'a, E> {
    KeyTile {
        keys,
        key_stride: count,
        values,
        value_stride: 4,
        count,
    }
}

#[test]
#[should_panic(expected = "need as many scales")]
fn attend_int8_tile_refuses_too_few_scales() {
    let mut buffers = RowBuffers::new(4, 4, 1);
    let (keys, values) = ([1i8; 64], [1i8; 64]);
    // Sixteen positions, fifteen value scales.
    let scales = TileScales {
        keys: &[1.0; 16],
        key_stride: 1,
        values: &[1.0; 15],
        value_stride: 1,
    };
    attend_int8_tile(
        &mut buffers.row(),
        columns_tile(&keys, &values, 16),
        scales,
        PLAIN,
    );
}

#[test]
fn attend_tile_leaves_a_row_unchanged_for_an_empty_tile() {
    let mut buffers = RowBuffers::new(8, 8, 2);
    buffers.outputs.fill(2.0);
    buffers.maxima.fill(0.5);
    buffers.sums.fill(3.0);
    attend_tile(&mut buffers.row(), columns_tile(&[], &[], 0), PLAIN);
    assert_eq!(buffers.outputs, [2.0; 8]);
    assert_eq!((buffers.maxima, buffers.sums), (vec![0.5; 2], vec![3.0; 2]));
}

#[test]
#[should_panic(expected = "positions need")]
fn attend_tile_refuses_a_tile_shorter_than_its_count() {
    let mut buffers = RowBuffers::new(4, 4, 1);
    // Four features of 16 keys need 64 values; 63 are there.
    let (keys, values) = ([0.0f32; 63], [0.0f32; 64]);
    attend_tile(&mut buffers.row(), columns_tile(&keys, &values, 16), PLAIN);
}

#[test]
#[should_panic(expected = "whole heads")]
fn attend_tile_refuses_queries_that_are_not_whole_heads() {
    // Five queries do not make two heads.
    let mut buffers = RowBuffers::new(5, 4, 2);
    attend_tile(&mut buffers.row(), columns_tile(&[], &[], 0), PLAIN);
}

/// The lines (64-byte pieces from the tile's start) [`Ahead`] asks for when the parts of a tile
/// of `count` positions go through it as the AVX-512 path does, `part` positions at a time (16,
/// or 64 in its wide parts): the key lines of each feature at the part's vectors that start one,
/// the value lines of each position; each line as often as it is asked for.
fn requests<E>(
    ahead: &Ahead,
    dim: usize,
    value_dim: usize,
    count: usize,
    part: usize,
) -> [Vec<usize>; 2] {
    let mut keys = Vec::new();
    let mut values = Vec::new();
    for first in (0..count).step_by(part) {
        for feature in 0..dim {
            for v in (0..part / LANES).filter(|&v| ahead.asks_at_vector::<E>(v)) {
                let (_, position) = ahead.locate(first + v * LANES);
                keys.extend(ahead.key_offset(feature, position));
            }
        }
        for position in first..(first + part).min(count) {
            let (_, position) = ahead.locate(position);
            values.extend(ahead.value_lines(position, value_dim));
        }
    }
    [keys, values].map(|offsets| {
        let mut lines: Vec<usize> = offsets.iter().map(|offset| offset / CACHE_LINE).collect();
        lines.sort_unstable();
        lines
    })
}

/// [`requests`]' lines, each once.
fn lines_asked_for<E>(
    ahead: &Ahead,
    dim: usize,
    value_dim: usize,
    count: usize,
) -> [Vec<usize>; 2] {
    requests::<E>(ahead, dim, value_dim, count, LANES).map(|mut lines| {
        lines.dedup();
        lines
    })
}

/// The [`Ahead`] of the first `count` positions of a paged block: feature-major keys of
/// `block_size` positions, values `value_dim` wide.
fn block_ahead<'a, E: TileElement>(
    keys: &'a [E],
    values: &'a [E],
    [block_size, value_dim]: [usize; 2],
    count: usize,
) -> Ahead<'a> {
    let tile = KeyTile {
        keys,
        key_stride: block_size,
        values,
        value_stride: value_dim,
        count,
    };
    Ahead::of(&tile)
}

/// A stored block whose feature rows and value rows are whole lines, as the pool's are, of
/// `E` (`block_size` positions of 64 bytes per feature): every line of its keys and values is
/// asked for, and nothing else.
fn every_line_of_a_block<E: TileElement>(zero: E) {
    let element = std::mem::size_of::<E>();
    let (dim, block_size, value_dim) = (8, CACHE_LINE / element, 2 * CACHE_LINE / element);
    let keys = vec![zero; dim * block_size];
    let values = vec![zero; block_size * value_dim];
    let ahead = block_ahead(&keys, &values, [block_size, value_dim], block_size);
    let lines = lines_asked_for::<E>(&ahead, dim, value_dim, block_size);
    let whole = |elements: usize| (0..elements * element / CACHE_LINE).collect::<Vec<_>>();
    assert_eq!(lines, [whole(keys.len()), whole(values.len())]);
}

#[test]
fn ahead_asks_for_every_line_of_a_block_and_nothing_else() {
    every_line_of_a_block(0.0f32);
    every_line_of_a_block(f16::from_f32(0.0));
    every_line_of_a_block(0i8);
}

/// A block of `block_size` positions of `E` read in parts of `part`: each line of its keys is
/// asked for once, though an f16 or int8 line holds two or four features' keys (a block of 16,
/// the paged cache's default) or two or four vectors of a feature's (a block of 64 in one wide
/// part, as a compressed `KvCache`'s tiles).
fn each_key_line_once<E: TileElement>(zero: E, block_size: usize, part: usize) {
    let (dim, value_dim) = (8, 16);
    let keys = vec![zero; dim * block_size];
    let values = vec![zero; block_size * value_dim];
    let ahead = block_ahead(&keys, &values, [block_size, value_dim], block_size);
    let [key_requests, _] = requests::<E>(&ahead, dim, value_dim, block_size, part);
    let lines = (std::mem::size_of_val(keys.as_slice()) / CACHE_LINE).max(1);
    assert_eq!(key_requests, (0..lines).collect::<Vec<_>>());
}

#[test]
fn ahead_asks_for_each_key_line_of_a_block_once() {
    for (block_size, part) in [(16, LANES), (64, WIDE_LANES)] {
        each_key_line_once(0.0f32, block_size, part);
        each_key_line_once(f16::from_f32(0.0), block_size, part);
        each_key_line_once(0i8, block_size, part);
    }
}

#[test]
fn ahead_asks_for_no_line_of_a_position_past_the_tile() {
    // The first 5 positions of a block of 32 f32: a feature row is 2 lines, the first only is
    // the tile's; values are 16 wide (one line each).
    let (dim, block_size, value_dim, count) = (4, 32, 16, 5);
    let keys = vec![0.0f32; dim * block_size];
    let values = vec![0.0f32; block_size * value_dim];
    let ahead = block_ahead(&keys, &values, [block_size, value_dim], count);
    let (_, position) = ahead.locate(count);
    assert_eq!(
        ahead.key_offset(0, position),
        None,
        "position 5 is not the tile's"
    );
    assert_eq!(ahead.value_lines(position, value_dim).count(), 0);
    let lines = lines_asked_for::<f32>(&ahead, dim, value_dim, block_size);
    assert_eq!(lines, [vec![0, 2, 4, 6], vec![0, 1, 2, 3, 4]]);
}

/// A run of four blocks of 16 positions of `E` asked for by a wide part (64 positions), as the
/// AVX-512 path asks ([`requests`], through [`Ahead::asks_at_vector`]): position `16 b + i` of
/// the run is position `i` of block `b`, so that each of the part's four vectors asks for every
/// line of its own block, each key line once, though in f16 and int8 a vector's 16 positions of
/// a feature are part of a line (whose other positions, in a tile, the vector before asks for).
fn each_line_of_each_block_of_a_run<E: TileElement>(zero: E) {
    let (dim, value_dim) = (8, 16);
    let keys = vec![zero; dim * LANES];
    let values = vec![zero; LANES * value_dim];
    let block = KeyTile {
        keys: keys.as_slice(),
        key_stride: LANES,
        values: values.as_slice(),
        value_stride: value_dim,
        count: LANES,
    };
    let ahead = Ahead::of_run(&[block; RUN_BLOCKS]);
    for b in 0..RUN_BLOCKS {
        assert_eq!(
            ahead.locate(b * LANES + 3),
            (b, 3),
            "position {} of the run",
            b * LANES + 3
        );
    }
    // Every block's lines, each block's offsets from its own start.
    let every_block = |bytes: usize| {
        let mut lines: Vec<usize> = (0..bytes.div_ceil(CACHE_LINE))
            .flat_map(|line| [line; RUN_BLOCKS])
            .collect();
        lines.sort_unstable();
        lines
    };
    let [key_lines, value_lines] =
        requests::<E>(&ahead, dim, value_dim, RUN_BLOCKS * LANES, WIDE_LANES);
    assert_eq!(
        key_lines,
        every_block(std::mem::size_of_val(keys.as_slice())),
        "the blocks' keys"
    );
    // An f16 or int8 value row is part of a line, asked for by each position in it.
    let row_bytes = value_dim * std::mem::size_of::<E>();
    let rows_per_line = (CACHE_LINE / row_bytes).max(1);
    let each_once: Vec<usize> = value_lines.iter().step_by(rows_per_line).copied().collect();
    assert_eq!(
        each_once,
        every_block(std::mem::size_of_val(values.as_slice())),
        "the blocks' values"
    );
}

#[test]
fn ahead_of_a_run_asks_for_each_line_of_each_block_once() {
    each_line_of_each_block_of_a_run(0.0f32);
    each_line_of_each_block_of_a_run(f16::from_f32(0.0));
    each_line_of_each_block_of_a_run(0i8);
}

/// Every f16 bit pattern, sixteen and sixty-four at a time (the widths the lane loops convert),
/// as `f16::to_f32` gives it; a NaN a NaN.
#[test]
fn f16_tiles_convert_every_half_as_the_half_crate_does() {
    fn check<const N: usize>() {
        let halves: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        for chunk in halves.chunks_exact(N) {
            let chunk: &[f16; N] = chunk.try_into().expect("N halves");
            for (half, float) in chunk.iter().zip(f16::floats(chunk)) {
                let expected = half.to_f32();
                assert!(
                    float.to_bits() == expected.to_bits() || (float.is_nan() && expected.is_nan()),
                    "{:#06x}: {float} against {expected}",
                    half.to_bits()
                );
                let one = half.float();
                assert!(
                    one.to_bits() == float.to_bits() || (one.is_nan() && float.is_nan()),
                    "{:#06x}: one at a time {one}, {N} at a time {float}",
                    half.to_bits()
                );
            }
        }
    }
    check::<LANES>();
    check::<VALUE_COLUMNS>();
}
