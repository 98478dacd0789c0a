//! [`super::attend_part`] on AVX-512 registers, for feature-major keys and values a whole
//! number of 16-lane vectors wide (and, in int8 and f16, whole parts of 16 positions, converted
//! to f32 as they are loaded): the rest of a tile goes through the lane loops. A soft cap or
//! ALiBi is applied to the scores as the lane loops apply it ([`super::apply_rule`]).
//!
//! Why: compiled from the lane loops, the paged step at 32 sequences of 128-4096 positions
//! (`decoding` bench, AMD EPYC Zen 5, 2 cores) spent 2.5-3.0 ms in this kernel where these
//! registers took 1.5-2.0 ms: the loops kept their sums on the stack.

use std::arch::x86_64::*;

use super::{
    HEADS, KeyTile, LANES, LogitRule, OnlineRow, RUN_BLOCKS, TileElement, TilePart, TileScales,
    WIDE_LANES, apply_rule,
};

/// Whether [`attend_part`] takes `part`: the kernels run AVX-512 (`cpu_capability`), the
/// values are whole vectors, the part is at most a vector of positions or a wide one, and an
/// int8 or f16 part is whole vectors (its loads are not masked).
pub(super) fn takes<E: TileElement>(part: TilePart) -> bool {
    part.value_dim.is_multiple_of(LANES)
        && (part.lanes <= LANES || part.lanes == WIDE_LANES)
        && (!(E::INT8 || E::HALF) || part.lanes.is_multiple_of(LANES))
        && crate::cpu::cpu_capability() == crate::cpu::CpuCapability::Avx512
}

/// Sixteen elements from `elements` as floats: the `lanes` of f32 (the others 0), or all
/// sixteen i8 or f16 converted.
///
/// # Safety
///
/// The CPU has AVX-512F; the lanes read lie inside the slice `elements` points into (all
/// sixteen for i8 and f16).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load<E: TileElement>(elements: *const E, lanes: __mmask16) -> __m512 {
    // SAFETY: the caller's; `E` is i8, f16 or f32 as `E::INT8` and `E::HALF` say.
    unsafe {
        if E::INT8 {
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(elements.cast())))
        } else if E::HALF {
            _mm512_cvtph_ps(_mm256_loadu_si256(elements.cast()))
        } else if lanes == u16::MAX {
            // Whole vectors unmasked: a masked load that misses the caches is not followed by
            // the hardware prefetcher (AMD Zen 5: a tile read from memory took 2x as long).
            _mm512_loadu_ps(elements.cast())
        } else {
            _mm512_maskz_loadu_ps(lanes, elements.cast())
        }
    }
}

/// Sixteen positions' scales from `first` (`stride` apart) as a vector.
///
/// # Panics
///
/// If they are not all in `scales`.
#[inline]
#[target_feature(enable = "avx512f")]
fn scale_vector(scales: &[f32], stride: usize, first: usize) -> __m512 {
    if stride == 1 {
        let lanes = &scales[first..first + LANES];
        // SAFETY: `lanes` is 16 floats.
        return unsafe { _mm512_loadu_ps(lanes.as_ptr()) };
    }
    let lanes: [f32; LANES] = std::array::from_fn(|lane| scales[(first + lane) * stride]);
    // SAFETY: `lanes` is 16 floats.
    unsafe { _mm512_loadu_ps(lanes.as_ptr()) }
}

/// Vectors of positions in a wide part: four whole vectors, a part of 64 positions of a tile
/// (see [`attend_part`]).
const WIDE: usize = WIDE_LANES / LANES;

/// [`super::attend_part`] for a part [`takes`] takes, through the instance of
/// [`attend_heads`] for its number of heads and of positions: up to 16, or [`WIDE_LANES`].
///
/// Why wide parts: in a part of 64 positions each query feature's broadcast multiplies four
/// vectors of keys, four heads' sixteen sums need no splits to keep the FMA units busy, and
/// the part's softmax (reductions to a maximum and a sum, the outputs' rescale, load and
/// store) is paid once for 64 positions, not four times. An f16 or int8 pool of blocks of 64
/// at 32 sequences of 128-4096 positions took 1.46-1.68 ms a step on one thread where parts of
/// 16 took 1.83-1.90 (`decoding` bench, AMD Zen 5; docs/performance-notes.md).
///
/// # Safety
///
/// The CPU has AVX-512F; `part.lanes` is at most 16 or is [`WIDE_LANES`]; `row` holds whole
/// heads of `part.dim` queries and `part.value_dim` outputs for heads
/// `part.head..part.head + part.heads`; `tile.keys` holds
/// `(part.dim - 1) · key_stride + part.first + part.lanes` values and `tile.values`
/// `(part.first + part.lanes - 1) · value_stride + part.value_dim` (what `attend_tile`
/// checks); `scales`, if any, one of each kind per position of the tile.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn attend_part<E: TileElement>(
    row: &mut OnlineRow,
    tile: &KeyTile<E>,
    scales: Option<&TileScales>,
    rule: &LogitRule,
    part: TilePart,
) {
    debug_assert!(part.lanes <= LANES || part.lanes == WIDE_LANES);
    let vectors = Vectors {
        tiles: [tile; WIDE],
        scales: [scales; WIDE],
        firsts: std::array::from_fn(|v| part.first + v * LANES),
    };
    // SAFETY: the caller's; each instance computes at least `part.heads` heads, the wide ones
    // `WIDE_LANES` positions, which a part of more than 16 has; vector `v` of a wide part is
    // the tile's positions `part.first + 16 v..`, which it holds.
    unsafe { attend_vectors(row, &vectors, rule, part) }
}

/// [`attend_part`] for a wide part whose four vectors of positions are the run `blocks`, each
/// 16 positions where it lies (see [`super::attend_run`]).
///
/// # Safety
///
/// The CPU has AVX-512F; `part.first` is 0 and `part.lanes` [`WIDE_LANES`]; `row` as
/// [`attend_part`] says; each block holds 16 positions' keys and values `part.dim` and
/// `part.value_dim` wide at its strides, and `scales`, if any, a scale of each kind per
/// position of each block.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn attend_run_part<E: TileElement>(
    row: &mut OnlineRow,
    blocks: &[KeyTile<E>; RUN_BLOCKS],
    scales: Option<&[TileScales; RUN_BLOCKS]>,
    rule: &LogitRule,
    part: TilePart,
) {
    debug_assert!(part.first == 0 && part.lanes == WIDE_LANES);
    let vectors = Vectors {
        tiles: blocks.each_ref(),
        scales: std::array::from_fn(|v| scales.map(|scales| &scales[v])),
        firsts: [0; WIDE],
    };
    // SAFETY: the caller's; vector `v` is block `v`'s 16 positions.
    unsafe { attend_vectors(row, &vectors, rule, part) }
}

/// Where each vector of 16 positions of a part lies: in one tile, from position `first + 16 v`
/// of the tile; in a run, block `v` from its position 0.
struct Vectors<'t, 'a, E> {
    tiles: [&'t KeyTile<'a, E>; WIDE],
    scales: [Option<&'t TileScales<'a>>; WIDE],
    /// Each vector's first position in its tile.
    firsts: [usize; WIDE],
}

/// The part through the instance of [`attend_heads`] for its number of heads and of
/// positions.
///
/// # Safety
///
/// As [`attend_part`], with `vectors` holding the part's positions: `part.lanes` of them from
/// vector 0's first (each vector's 16 in a wide part).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn attend_vectors<E: TileElement>(
    row: &mut OnlineRow,
    vectors: &Vectors<E>,
    rule: &LogitRule,
    part: TilePart,
) {
    // SAFETY: the caller's; each instance computes at least `part.heads` heads, the wide ones
    // `WIDE_LANES` positions, which a part of more than 16 has.
    unsafe {
        match (part.heads, part.lanes > LANES) {
            (1, false) => attend_heads::<E, 1, 1, 8>(row, vectors, rule, part),
            (2, false) => attend_heads::<E, 2, 1, 4>(row, vectors, rule, part),
            (_, false) => attend_heads::<E, HEADS, 1, 2>(row, vectors, rule, part),
            (1, true) => attend_heads::<E, 1, WIDE, 2>(row, vectors, rule, part),
            (2, true) => attend_heads::<E, 2, WIDE, 2>(row, vectors, rule, part),
            (_, true) => attend_heads::<E, HEADS, WIDE, 1>(row, vectors, rule, part),
        }
    }
}

/// [`attend_part`] computing `H` query heads (those past `part.heads` repeat the last and are
/// dropped) over `V` vectors of positions (the last masked to `part.lanes` where `V` is 1),
/// each head's scores in `SPLITS` sums over every `SPLITS`-th feature, added at the end.
///
/// Why the splits: a sum of 64 features is a chain of 64 dependent FMAs (four cycles each); two
/// FMA units need eight chains under way to stay busy, and with one query head per key/value
/// head (plain multi-head attention) one chain per head left them idle most of the time. Why
/// `H`: the part's heads only, where four were computed for one or two before.
///
/// # Safety
///
/// As [`attend_vectors`], `part.heads ≤ H`, and `part.lanes` is `16 · V` where `V` is not 1.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn attend_heads<E: TileElement, const H: usize, const V: usize, const SPLITS: usize>(
    row: &mut OnlineRow,
    vectors: &Vectors<E>,
    rule: &LogitRule,
    part: TilePart,
) {
    let (dim, value_dim) = (part.dim, part.value_dim);
    let head_of = |h: usize| part.head + h.min(part.heads - 1);
    // The last vector's lanes (every vector's whole in a wide part).
    let last_lanes: __mmask16 = if part.lanes >= LANES {
        u16::MAX
    } else {
        (1u16 << part.lanes) - 1
    };
    let lanes_of = |v: usize| if v + 1 == V { last_lanes } else { u16::MAX };
    let mut split_scores = [[[_mm512_setzero_ps(); SPLITS]; V]; H];
    // SAFETY: the loads: feature `f < dim` of query head `head_of(h)` is in `row.queries`;
    // the key loads read lanes `< part.lanes` of row `f` of each vector's tile, inside its
    // keys (all 16 of each vector for i8 and f16, which `takes` only takes whole).
    unsafe {
        let keys: [*const E; V] =
            std::array::from_fn(|v| vectors.tiles[v].keys.as_ptr().add(vectors.firsts[v]));
        let key_strides: [usize; V] = std::array::from_fn(|v| vectors.tiles[v].key_stride);
        let queries: [*const f32; H] =
            std::array::from_fn(|h| row.queries.as_ptr().add(head_of(h) * dim));
        // The next tile's keys, once per part of its positions (by its first heads).
        let ahead = row.ahead.as_ref().filter(|_| part.head == 0);
        let mut first = 0;
        while first < dim {
            for split in 0..SPLITS {
                let feature = first + split;
                if feature < dim {
                    let mut key = [_mm512_setzero_ps(); V];
                    for v in 0..V {
                        if let Some(ahead) = ahead.filter(|ahead| ahead.asks_at_vector::<E>(v)) {
                            ahead.key_line(feature, part.first + v * LANES);
                        }
                        key[v] = load(keys[v].add(feature * key_strides[v]), lanes_of(v));
                    }
                    for h in 0..H {
                        let query = _mm512_set1_ps(*queries[h].add(feature));
                        for v in 0..V {
                            split_scores[h][v][split] =
                                _mm512_fmadd_ps(query, key[v], split_scores[h][v][split]);
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
                .reduce(|sum, split| _mm512_add_ps(sum, split))
                .expect("at least one split")
        })
    });
    for v in 0..V {
        if let Some(scales) = vectors.scales[v] {
            let key_scales = scale_vector(scales.keys, scales.key_stride, vectors.firsts[v]);
            for h in 0..H {
                scores[h][v] = _mm512_mul_ps(scores[h][v], key_scales);
            }
        }
    }
    if rule.softcap.is_some() || rule.alibi.is_some() {
        // The rule on each vector's lanes in memory (masked lanes become -∞ below whatever it
        // makes of them).
        for h in 0..H {
            for v in 0..V {
                let mut logits = [0.0f32; LANES];
                // SAFETY: `logits` is 16 floats.
                unsafe { _mm512_storeu_ps(logits.as_mut_ptr(), scores[h][v]) };
                apply_rule::<true>(&mut logits, rule, head_of(h), part.first + v * LANES);
                // SAFETY: as above.
                scores[h][v] = unsafe { _mm512_loadu_ps(logits.as_ptr()) };
            }
        }
    }
    let value_scales: [Option<__m512>; V] = std::array::from_fn(|v| {
        vectors.scales[v]
            .map(|scales| scale_vector(scales.values, scales.value_stride, vectors.firsts[v]))
    });
    let mut weights = [[0.0f32; WIDE_LANES]; H];
    let mut corrections = [1.0f32; H];
    // Every head computed (the bound a constant, so that the heads' chains of reductions and
    // exponentials interleave), the part's written back.
    for h in 0..H {
        let head = head_of(h);
        let logits: [__m512; V] = std::array::from_fn(|v| {
            _mm512_mask_blend_ps(lanes_of(v), _mm512_set1_ps(f32::NEG_INFINITY), scores[h][v])
        });
        let part_max = logits
            .into_iter()
            .reduce(|max, vector| _mm512_max_ps(max, vector))
            .expect("at least one vector");
        let max = row.maxima[head].max(_mm512_reduce_max_ps(part_max));
        let exponentials = logits.map(|logits| {
            crate::cpu::simd::avx512::exp(_mm512_sub_ps(logits, _mm512_set1_ps(max)))
        });
        // The first tile's correction is e^-∞ = 0, against sums that are still 0.
        let correction = super::exp::<true>(row.maxima[head] - max);
        if h < part.heads {
            let sum = exponentials
                .into_iter()
                .reduce(|sum, vector| _mm512_add_ps(sum, vector))
                .expect("at least one vector");
            row.sums[head] = row.sums[head] * correction + _mm512_reduce_add_ps(sum);
            row.maxima[head] = max;
            corrections[h] = correction;
        }
        for v in 0..V {
            // The int8 values' scales go into their weights (the sum above is the softmax's).
            let weight = value_scales[v].map_or(exponentials[v], |scales| {
                _mm512_mul_ps(exponentials[v], scales)
            });
            // SAFETY: `weights[h][16 · v..]` holds 16 floats (`V ≤ WIDE`).
            unsafe { _mm512_storeu_ps(weights[h][v * LANES..].as_mut_ptr(), weight) };
        }
    }
    let mut start = 0;
    while start < value_dim {
        let columns = (value_dim - start) / LANES;
        // SAFETY: columns `start..start + 16 · columns` of the part's value rows and of its
        // heads' outputs are inside each vector's tile's values and `row.outputs`.
        unsafe {
            match columns {
                1 => value_pass::<1, H, V, E>(row, vectors, part, &weights, &corrections, start),
                2 => value_pass::<2, H, V, E>(row, vectors, part, &weights, &corrections, start),
                3 => value_pass::<3, H, V, E>(row, vectors, part, &weights, &corrections, start),
                _ => value_pass::<4, H, V, E>(row, vectors, part, &weights, &corrections, start),
            }
        }
        start += LANES * columns.min(4);
    }
}

/// `outputs[head][start..][..16 · VECTORS] ← outputs · correction + Σ_lane weight · value`
/// for the part's heads (`weights[h][lane]` each position's), the sums in registers.
///
/// # Safety
///
/// As [`attend_vectors`], and `start + 16 · VECTORS ≤ part.value_dim`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn value_pass<const VECTORS: usize, const H: usize, const V: usize, E: TileElement>(
    row: &mut OnlineRow,
    vectors: &Vectors<E>,
    part: TilePart,
    weights: &[[f32; WIDE_LANES]; H],
    corrections: &[f32; H],
    start: usize,
) {
    let mut sums = [[_mm512_setzero_ps(); VECTORS]; H];
    // SAFETY: the value rows of the part's lanes (lane `16 v + l` is row `firsts[v] + l` of
    // vector `v`'s tile, `l < 16` and `16 v + l < part.lanes`) and their columns `start..start
    // + 16 · VECTORS` are inside that tile's values; output columns likewise inside
    // `row.outputs` for heads below `part.head + part.heads`.
    unsafe {
        // The next tile's value rows, once per part (at its first columns).
        let ahead = row.ahead.as_ref().filter(|_| part.head == 0 && start == 0);
        for vector in 0..V {
            let tile = vectors.tiles[vector];
            let values = tile
                .values
                .as_ptr()
                .add(vectors.firsts[vector] * tile.value_stride + start);
            let lanes = part.lanes.saturating_sub(vector * LANES).min(LANES);
            for l in 0..lanes {
                let lane = vector * LANES + l;
                let value_row = values.add(l * tile.value_stride);
                if let Some(ahead) = &ahead {
                    ahead.value_row(part.first + lane, part.value_dim);
                }
                for v in 0..VECTORS {
                    let value = load(value_row.add(v * LANES), u16::MAX);
                    for h in 0..H {
                        let weight = _mm512_set1_ps(weights[h][lane]);
                        sums[h][v] = _mm512_fmadd_ps(weight, value, sums[h][v]);
                    }
                }
            }
        }
        for h in 0..part.heads {
            let output = row
                .outputs
                .as_mut_ptr()
                .add((part.head + h) * part.value_dim + start);
            let correction = _mm512_set1_ps(corrections[h]);
            for v in 0..VECTORS {
                let old = _mm512_loadu_ps(output.add(v * LANES));
                _mm512_storeu_ps(
                    output.add(v * LANES),
                    _mm512_fmadd_ps(old, correction, sums[h][v]),
                );
            }
        }
    }
}
