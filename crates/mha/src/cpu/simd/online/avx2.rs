//! [`super::attend_part`] on AVX2 registers, for whole parts of 16 feature-major keys and
//! values a whole number of 8-lane vectors wide: the scores and the weighted values in
//! registers, the soft cap, ALiBi and the softmax between them the lane loops' own code on the
//! part's lanes. The rest of a tile (the last positions of a sequence) goes through the lane
//! loops.
//!
//! Why: compiled for AVX2 from the lane loops, the part's sums went through the stack (a store
//! and a load around most multiply-adds); the paged step at 32 sequences of 128-4096 positions
//! in int8 took 2.9 ms alone where the AVX-512 registers took 1.4 (`decoding` bench capped to
//! AVX2 with `MHA_CPU_CAPABILITY`, AMD Zen 5; docs/performance-notes.md).
//!
//! No wide parts (see `avx512.rs`): AVX2 has 16 registers, which four heads' scores of 16
//! positions (8) and their loads already mostly fill.

use std::arch::x86_64::*;

use super::{
    HEADS, KeyTile, LANES, LogitRule, OnlineRow, TileElement, TilePart, TileScales, apply_rule,
    softmax_step,
};
use crate::cpu::{CpuCapability, cpu_capability};

/// Floats in an AVX2 vector.
const VECTOR: usize = 8;

/// Vectors in a part of [`LANES`] positions.
const PART: usize = LANES / VECTOR;

/// Whether [`attend_part`] takes `part`: the kernels run AVX2 or more (`cpu_capability`), the
/// part is a whole 16 positions and the values whole vectors.
pub(super) fn takes(part: TilePart) -> bool {
    part.lanes == LANES
        && part.value_dim.is_multiple_of(VECTOR)
        && cpu_capability() >= CpuCapability::Avx2
}

/// Eight elements from `elements` as floats (i8 and f16 converted).
///
/// # Safety
///
/// The CPU has AVX2 and F16C; the eight elements lie inside the slice `elements` points into.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load<E: TileElement>(elements: *const E) -> __m256 {
    // SAFETY: the caller's; `E` is i8, f16 or f32 as `E::INT8` and `E::HALF` say.
    unsafe {
        if E::INT8 {
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(elements.cast())))
        } else if E::HALF {
            _mm256_cvtph_ps(_mm_loadu_si128(elements.cast()))
        } else {
            _mm256_loadu_ps(elements.cast())
        }
    }
}

/// Eight positions' scales from `first` (`stride` apart) as a vector.
///
/// # Panics
///
/// If they are not all in `scales`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale_vector(scales: &[f32], stride: usize, first: usize) -> __m256 {
    let lanes: [f32; VECTOR] = std::array::from_fn(|lane| scales[(first + lane) * stride]);
    // SAFETY: `lanes` is 8 floats.
    unsafe { _mm256_loadu_ps(lanes.as_ptr()) }
}

/// [`super::attend_part`] for a part [`takes`] takes, through the instance of
/// [`attend_heads`] for its number of heads.
///
/// # Safety
///
/// The CPU has AVX2, FMA and F16C; `part.lanes` is 16 and `part.value_dim` a multiple of 8;
/// `row` holds whole heads of `part.dim` queries and `part.value_dim` outputs for heads
/// `part.head..part.head + part.heads`; `tile.keys` holds
/// `(part.dim - 1) · key_stride + part.first + 16` values and `tile.values`
/// `(part.first + 15) · value_stride + part.value_dim` (what `attend_tile` checks); `scales`,
/// if any, one of each kind per position of the tile.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn attend_part<E: TileElement>(
    row: &mut OnlineRow,
    tile: &KeyTile<E>,
    scales: Option<&TileScales>,
    rule: &LogitRule,
    part: TilePart,
) {
    debug_assert!(part.lanes == LANES && part.value_dim.is_multiple_of(VECTOR));
    // SAFETY: the caller's; each instance computes at least `part.heads` heads.
    unsafe {
        match part.heads {
            1 => attend_heads::<E, 1, 4, 8>(row, tile, scales, rule, part),
            2 => attend_heads::<E, 2, 2, 4>(row, tile, scales, rule, part),
            _ => attend_heads::<E, HEADS, 1, 2>(row, tile, scales, rule, part),
        }
    }
}

/// [`attend_part`] computing `H` query heads (those past `part.heads` repeat the last and are
/// dropped), each head's scores in `SPLITS` sums over every `SPLITS`-th feature, and the values
/// `VALUES` vectors of columns at a time.
///
/// Why the splits and `VALUES`: eight independent chains of multiply-adds keep two FMA units
/// busy (four cycles of latency each), in the scores (`H · 2 · SPLITS`) and in the weighted
/// values (`H · VALUES`) alike, within AVX2's 16 registers.
///
/// # Safety
///
/// As [`attend_part`], and `part.heads ≤ H`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_heads<E: TileElement, const H: usize, const SPLITS: usize, const VALUES: usize>(
    row: &mut OnlineRow,
    tile: &KeyTile<E>,
    scales: Option<&TileScales>,
    rule: &LogitRule,
    part: TilePart,
) {
    let dim = part.dim;
    let head_of = |h: usize| part.head + h.min(part.heads - 1);
    let mut split_scores = [[[_mm256_setzero_ps(); SPLITS]; PART]; H];
    // SAFETY: feature `f < dim` of query head `head_of(h)` is in `row.queries`; the key loads
    // read positions `part.first..part.first + 16` of row `f`, inside `tile.keys`.
    unsafe {
        let keys = tile.keys.as_ptr().add(part.first);
        let queries: [*const f32; H] =
            std::array::from_fn(|h| row.queries.as_ptr().add(head_of(h) * dim));
        // The next tile's keys, once per part of its positions (by its first heads).
        let ahead = row.ahead.filter(|_| part.head == 0);
        let mut first = 0;
        while first < dim {
            for split in 0..SPLITS {
                let feature = first + split;
                if feature < dim {
                    if let Some(ahead) = &ahead {
                        ahead.key_line(feature, part.first);
                    }
                    let row_keys = keys.add(feature * tile.key_stride);
                    let key: [__m256; PART] =
                        std::array::from_fn(|v| load(row_keys.add(v * VECTOR)));
                    for h in 0..H {
                        let query = _mm256_set1_ps(*queries[h].add(feature));
                        for v in 0..PART {
                            split_scores[h][v][split] =
                                _mm256_fmadd_ps(query, key[v], split_scores[h][v][split]);
                        }
                    }
                }
            }
            first += SPLITS;
        }
    }
    let mut scores = split_scores.map(|vectors| {
        vectors.map(|splits| {
            splits
                .into_iter()
                .reduce(|sum, split| _mm256_add_ps(sum, split))
                .expect("at least one split")
        })
    });
    if let Some(scales) = scales {
        for v in 0..PART {
            let key_scales = scale_vector(scales.keys, scales.key_stride, part.first + v * VECTOR);
            for h in 0..H {
                scores[h][v] = _mm256_mul_ps(scores[h][v], key_scales);
            }
        }
    }
    // The rule and the softmax as the lane loops compute them, on the scores' lanes.
    let mut weights = [[0.0f32; LANES]; H];
    let mut corrections = [1.0f32; H];
    for h in 0..H {
        let head = head_of(h);
        let logits = &mut weights[h];
        for v in 0..PART {
            // SAFETY: `logits[8 · v..]` holds 8 floats (`v < 2`).
            unsafe { _mm256_storeu_ps(logits[v * VECTOR..].as_mut_ptr(), scores[h][v]) };
        }
        apply_rule::<true>(logits, rule, head, part.first);
        if let Some(correction) = softmax_step::<true>(logits, row, head, h < part.heads) {
            corrections[h] = correction;
        }
        if let Some(scales) = scales {
            // The int8 values' scales go into their weights (the sum above is the softmax's).
            for (lane, weight) in logits.iter_mut().enumerate() {
                *weight *= scales.value(part.first + lane);
            }
        }
    }
    let mut start = 0;
    while start < part.value_dim {
        let vectors = (part.value_dim - start) / VECTOR;
        // SAFETY: columns `start..start + 8 · vectors` of the part's value rows and of its
        // heads' outputs are inside `tile.values` and `row.outputs`.
        unsafe {
            if vectors >= VALUES {
                value_pass::<VALUES, H, E>(row, tile, part, &weights, &corrections, start);
                start += VECTOR * VALUES;
            } else {
                value_pass::<1, H, E>(row, tile, part, &weights, &corrections, start);
                start += VECTOR;
            }
        }
    }
}

/// `outputs[head][start..][..8 · VECTORS] ← outputs · correction + Σ_lane weight · value`
/// for the part's heads (`weights[h][lane]` each position's), the sums in registers.
///
/// # Safety
///
/// As [`attend_part`], and `start + 8 · VECTORS ≤ part.value_dim`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn value_pass<const VECTORS: usize, const H: usize, E: TileElement>(
    row: &mut OnlineRow,
    tile: &KeyTile<E>,
    part: TilePart,
    weights: &[[f32; LANES]; H],
    corrections: &[f32; H],
    start: usize,
) {
    let mut sums = [[_mm256_setzero_ps(); VECTORS]; H];
    // SAFETY: value row `part.first + lane` (lane < 16) and its columns `start..start + 8 ·
    // VECTORS` are inside `tile.values`; output columns likewise inside `row.outputs` for heads
    // below `part.head + part.heads`.
    unsafe {
        let values = tile
            .values
            .as_ptr()
            .add(part.first * tile.value_stride + start);
        // The next tile's value rows, once per part (at its first columns).
        let ahead = row.ahead.filter(|_| part.head == 0 && start == 0);
        for lane in 0..LANES {
            let value_row = values.add(lane * tile.value_stride);
            if let Some(ahead) = &ahead {
                ahead.value_row(part.first + lane, part.value_dim);
            }
            let weight: [__m256; H] = std::array::from_fn(|h| _mm256_set1_ps(weights[h][lane]));
            for v in 0..VECTORS {
                let value = load(value_row.add(v * VECTOR));
                for h in 0..H {
                    sums[h][v] = _mm256_fmadd_ps(weight[h], value, sums[h][v]);
                }
            }
        }
        for h in 0..part.heads {
            let output = row
                .outputs
                .as_mut_ptr()
                .add((part.head + h) * part.value_dim + start);
            let correction = _mm256_set1_ps(corrections[h]);
            for v in 0..VECTORS {
                let old = _mm256_loadu_ps(output.add(v * VECTOR));
                _mm256_storeu_ps(
                    output.add(v * VECTOR),
                    _mm256_fmadd_ps(old, correction, sums[h][v]),
                );
            }
        }
    }
}
