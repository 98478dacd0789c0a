//! One tile of keys and values (f32, f16, or i8 with a scale per position) added to a query row's
//! online softmax, for the query heads that share a key/value head: the paged decoding step's
//! inner loop in one call — scores, soft cap, ALiBi, the rescale, the exponentials and the
//! weighted values — with the scores and sums in registers.
//!
//! Why one call: as four calls per block (scores, maximum, exponentials, weighted values) with
//! the scores and a block's sums going through memory between them, the paged step at 32
//! sequences of 128-4096 positions took about twice the time a loop reading the same blocks
//! takes (see `docs/benchmarks.md`).

// Index loops over fixed-size arrays (lanes, heads, vectors), so that the accumulators stay in
// registers: iterators over them made the compiler keep them on the stack.
#![allow(clippy::needless_range_loop)]

use super::{LANES, NATIVE_FMA, VALUE_COLUMNS, exp, flushed_exp, lane_sum, mul_add, tanh};

/// Query heads a tile's loops take at once: four rows of sixteen scores, and four rows of
/// [`VALUE_COLUMNS`] weighted sums (16 of AVX-512's 32 registers).
const HEADS: usize = 4;

/// Positions in a wide part of a tile: four vectors, which the AVX-512 path takes as one
/// (`avx512::attend_part`); the lane loops take parts of [`LANES`].
const WIDE_LANES: usize = 4 * LANES;

/// Blocks in a run ([`attend_run`]): one wide part.
pub(crate) const RUN_BLOCKS: usize = WIDE_LANES / LANES;

/// Positions in each block of a run.
pub(crate) const RUN_BLOCK_POSITIONS: usize = LANES;

/// An element a tile stores its keys and values in: f32, f16, or i8 with a scale per position
/// ([`TileScales`]).
pub(crate) trait TileElement: Copy {
    /// Whether the element is i8 (the AVX-512 path converts it on loading).
    const INT8: bool;
    /// Whether the element is f16 (the AVX-512 path converts it on loading).
    const HALF: bool = false;

    fn float(self) -> f32;

    /// `values` as f32s (for f16, eight at a time where the CPU converts them).
    #[inline(always)]
    fn floats<const N: usize>(values: &[Self; N]) -> [f32; N] {
        values.map(Self::float)
    }
}

impl TileElement for burn::tensor::f16 {
    const INT8: bool = false;
    const HALF: bool = true;

    /// In integer operations the loops vectorise: `f16::to_f32` is a call per element that
    /// checks the CPU for F16C, which made an f16 tile through the lane loops ten times an f32
    /// tile's time (on AVX2 machines every f16 tile; on AVX-512 ones those with a soft cap or
    /// ALiBi, and the last positions of a sequence).
    #[inline(always)]
    fn float(self) -> f32 {
        super::widen::half_bits_to_f32(self.to_bits())
    }

    #[inline(always)]
    fn floats<const N: usize>(values: &[Self; N]) -> [f32; N] {
        #[cfg(target_arch = "x86_64")]
        if N.is_multiple_of(8) && crate::cpu::cpu_capability() >= crate::cpu::CpuCapability::Avx2 {
            // SAFETY: `cpu_capability` says AVX2 or more only where the CPU has F16C.
            return unsafe { f16c_floats(values) };
        }
        values.map(Self::float)
    }
}

/// `values` converted eight at a time by F16C (every AVX2 CPU has it).
///
/// # Safety
///
/// The CPU has F16C.
///
/// # Panics
///
/// If `N` is not a multiple of 8.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "f16c")]
unsafe fn f16c_floats<const N: usize>(values: &[burn::tensor::f16; N]) -> [f32; N] {
    use std::arch::x86_64::{_mm_loadu_si128, _mm256_cvtph_ps, _mm256_storeu_ps};
    assert!(
        N.is_multiple_of(8),
        "f16c_floats: {N} is not a multiple of 8"
    );
    let mut floats = [0.0f32; N];
    for (out, halves) in floats.chunks_exact_mut(8).zip(values.chunks_exact(8)) {
        // SAFETY: F16C is the caller's; `halves` is eight f16s (16 bytes read), `out` eight
        // f32s (32 bytes written).
        unsafe {
            _mm256_storeu_ps(
                out.as_mut_ptr(),
                _mm256_cvtph_ps(_mm_loadu_si128(halves.as_ptr().cast())),
            )
        };
    }
    floats
}

impl TileElement for f32 {
    const INT8: bool = false;

    #[inline(always)]
    fn float(self) -> f32 {
        self
    }
}

impl TileElement for i8 {
    const INT8: bool = true;

    #[inline(always)]
    fn float(self) -> f32 {
        f32::from(self)
    }
}

/// Consecutive positions of one key/value head: their keys and values (f32 unless said) where
/// they lie.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeyTile<'a, E = f32> {
    /// Feature-major, as a paged block stores them (and a step's new keys are copied): feature
    /// `f` of position `i` at `keys[f · key_stride + i]`, so that 16 positions of a feature are
    /// one vector.
    pub keys: &'a [E],
    pub key_stride: usize,
    /// Position `i`'s value is `values[i · value_stride..][..value_dim]`.
    pub values: &'a [E],
    pub value_stride: usize,
    /// Positions in the tile.
    pub count: usize,
}

/// An int8 tile's scales: position `i`'s key is `keys[i · key_stride]` times its stored key,
/// its value `values[i · value_stride]` times its stored value (`max |x| / 127` of the row, as
/// the int8 caches store them).
#[derive(Debug, Clone, Copy)]
pub(crate) struct TileScales<'a> {
    pub keys: &'a [f32],
    pub key_stride: usize,
    pub values: &'a [f32],
    pub value_stride: usize,
}

impl TileScales<'_> {
    #[inline(always)]
    fn key(&self, position: usize) -> f32 {
        self.keys[position * self.key_stride]
    }

    #[inline(always)]
    fn value(&self, position: usize) -> f32 {
        self.values[position * self.value_stride]
    }
}

/// What turns a score (`scale · q · k`) into a logit: the soft cap, then ALiBi's penalty.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LogitRule<'a> {
    /// Scores become `cap · tanh(score / cap)`.
    pub softcap: Option<f32>,
    /// ALiBi's slope per query head of the row (the penalty is `-slope · distance`).
    pub alibi: Option<&'a [f32]>,
    /// The distance of the tile's first position before the query.
    pub first_distance: usize,
}

/// A query row of the query heads of one key/value head, its online softmax under way.
#[derive(Debug)]
pub(crate) struct OnlineRow<'a> {
    /// `heads × dim` queries, already multiplied by the softmax scale.
    pub queries: &'a [f32],
    /// `heads × value_dim`: each head's sum of values weighted by `e^(logit - max)`.
    pub outputs: &'a mut [f32],
    /// Each head's largest logit so far (`-∞` before the first tile).
    pub maxima: &'a mut [f32],
    /// Each head's sum of `e^(logit - max)` so far.
    pub sums: &'a mut [f32],
    /// The tile (or run of blocks) the caller attends to next, asked for while this one
    /// computes.
    pub ahead: Option<Ahead<'a>>,
}

/// Adds `tile`'s positions to `row`: for each query head, its logits, the rescale of its
/// running sums to a new maximum, and the values weighted by the exponentials. Exponentials
/// below `e^FLUSH_BELOW` of the maximum count as 0, as in the flash kernel.
///
/// # Panics
///
/// If the row's slices disagree on the number of heads, `tile` holds fewer than `count` keys
/// of the queries' width or values of the outputs' width, or ALiBi has no slope per head.
pub(crate) fn attend_tile(row: &mut OnlineRow, tile: KeyTile, rule: LogitRule) {
    let (dim, value_dim) = checked_sizes(row, &tile, &rule);
    attend_f32_checked(row, &tile, &rule, dim, value_dim);
}

/// [`attend_tile`] for a tile of int8 keys and values, each position's scaled by `scales`:
/// the scores are `scale · (q · k)` and the values weighted by `e^(logit - max) · scale`, so
/// that nothing is dequantized into memory.
///
/// # Panics
///
/// As [`attend_tile`], and if `scales` holds fewer than `count` scales of either kind.
pub(crate) fn attend_int8_tile(
    row: &mut OnlineRow,
    tile: KeyTile<i8>,
    scales: TileScales,
    rule: LogitRule,
) {
    let (dim, value_dim) = checked_sizes(row, &tile, &rule);
    check_scales(&tile, &scales);
    attend_int8_checked(row, &tile, &scales, &rule, dim, value_dim);
}

/// Panics unless `scales` holds a key and a value scale per position of `tile`.
fn check_scales(tile: &KeyTile<i8>, scales: &TileScales) {
    let last = tile.count.max(1) - 1;
    assert!(
        tile.count == 0
            || (last * scales.key_stride < scales.keys.len()
                && last * scales.value_stride < scales.values.len()),
        "attend_int8_tile: {} positions need as many scales, the tile has {} key and {} value \
         scales at strides {} and {}",
        tile.count,
        scales.keys.len(),
        scales.values.len(),
        scales.key_stride,
        scales.value_stride
    );
}

/// [`attend_tile`] for a tile of f16 keys and values, converted to f32 as they are read.
///
/// # Panics
///
/// As [`attend_tile`].
pub(crate) fn attend_half_tile(
    row: &mut OnlineRow,
    tile: KeyTile<burn::tensor::f16>,
    rule: LogitRule,
) {
    let (dim, value_dim) = checked_sizes(row, &tile, &rule);
    attend_half_checked(row, &tile, &rule, dim, value_dim);
}

/// The row's query and value widths, once checked against the tile (what the entry points
/// check).
fn checked_sizes<E>(row: &OnlineRow, tile: &KeyTile<E>, rule: &LogitRule) -> (usize, usize) {
    let heads = row.maxima.len();
    assert!(
        heads > 0
            && row.sums.len() == heads
            && row.queries.len().is_multiple_of(heads)
            && row.outputs.len().is_multiple_of(heads)
            && rule.alibi.is_none_or(|slopes| slopes.len() == heads),
        "attend_tile: {} queries, {} outputs, {} maxima, {} sums do not make whole heads",
        row.queries.len(),
        row.outputs.len(),
        heads,
        row.sums.len()
    );
    let (dim, value_dim) = (row.queries.len() / heads, row.outputs.len() / heads);
    let key_end = (dim.max(1) - 1) * tile.key_stride + tile.count;
    let value_end = (tile.count.max(1) - 1) * tile.value_stride + value_dim;
    assert!(
        tile.count == 0
            || (key_end <= tile.keys.len()
                && value_end <= tile.values.len()
                && tile.count <= tile.key_stride),
        "attend_tile: {} positions need {key_end} keys and {value_end} values, the tile has {} \
         and {}",
        tile.count,
        tile.keys.len(),
        tile.values.len()
    );
    (dim, value_dim)
}

dispatch! {
    fn attend_f32_checked(
        row: &mut OnlineRow,
        tile: &KeyTile,
        rule: &LogitRule,
        dim: usize,
        value_dim: usize
    ) -> () {
        attend_parts::<FMA, f32>(row, tile, None, rule, (dim, value_dim))
    }
}

dispatch! {
    fn attend_half_checked(
        row: &mut OnlineRow,
        tile: &KeyTile<burn::tensor::f16>,
        rule: &LogitRule,
        dim: usize,
        value_dim: usize
    ) -> () {
        attend_parts::<FMA, burn::tensor::f16>(row, tile, None, rule, (dim, value_dim))
    }
}

dispatch! {
    fn attend_int8_checked(
        row: &mut OnlineRow,
        tile: &KeyTile<i8>,
        scales: &TileScales,
        rule: &LogitRule,
        dim: usize,
        value_dim: usize
    ) -> () {
        attend_parts::<FMA, i8>(row, tile, Some(scales), rule, (dim, value_dim))
    }
}

/// The body of the entry points once checked: each part through the AVX-512 path where it
/// takes it, else the AVX2 path where it takes it, else the lane loops.
#[inline(always)]
fn attend_parts<const FMA: bool, E: TileElement>(
    row: &mut OnlineRow,
    tile: &KeyTile<E>,
    scales: Option<&TileScales>,
    rule: &LogitRule,
    (dim, value_dim): (usize, usize),
) {
    let heads = row.maxima.len();
    // Whether the AVX-512 path takes the tile's parts of 64 positions: the element and the
    // widths decide, the same for every part.
    #[cfg(target_arch = "x86_64")]
    let wide = avx512::takes::<E>(TilePart::wide(0, heads, dim, value_dim));
    #[cfg(not(target_arch = "x86_64"))]
    let wide = false;
    for part in parts(tile.count, heads, dim, value_dim, wide) {
        #[cfg(target_arch = "x86_64")]
        if avx512::takes::<E>(part) {
            // SAFETY: the CPU has AVX-512F (`takes` checked it); the entry points checked that
            // the tile holds its keys and values, `scales` (if any) a scale of each kind per
            // position, and the row whole heads.
            unsafe { avx512::attend_part(row, tile, scales, rule, part) };
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if avx2::takes(part) {
            // SAFETY: the CPU has AVX2, FMA and F16C, the part is 16 positions and its values
            // whole vectors (`takes` checked them); the rest as above.
            unsafe { avx2::attend_part(row, tile, scales, rule, part) };
            continue;
        }
        match part.heads {
            1 => attend_part::<FMA, E, 1>(row, tile, scales, rule, part),
            2 => attend_part::<FMA, E, 2>(row, tile, scales, rule, part),
            _ => attend_part::<FMA, E, HEADS>(row, tile, scales, rule, part),
        }
    }
}

/// A tile's parts: 64 positions where `wide` and the tile has them (AVX-512's wide parts),
/// else [`LANES`] (fewer at the end), by [`HEADS`] query heads (fewer at the end), positions
/// outermost.
#[inline(always)]
fn parts(
    count: usize,
    heads: usize,
    dim: usize,
    value_dim: usize,
    wide: bool,
) -> impl Iterator<Item = TilePart> {
    let wide_lanes = if wide { WIDE_LANES } else { LANES };
    let mut next = 0;
    let firsts = std::iter::from_fn(move || {
        let first = next;
        let left = count.saturating_sub(first);
        let lanes = if left >= wide_lanes {
            wide_lanes
        } else {
            LANES.min(left)
        };
        next += lanes;
        (left > 0).then_some((first, lanes))
    });
    firsts.flat_map(move |(first, lanes)| {
        (0..heads).step_by(HEADS).map(move |head| TilePart {
            first,
            lanes,
            head,
            heads: HEADS.min(heads - head),
            dim,
            value_dim,
        })
    })
}

/// Up to [`LANES`] positions of a tile (64 in AVX-512's wide parts) against up to [`HEADS`]
/// query heads.
#[derive(Debug, Clone, Copy)]
struct TilePart {
    /// The tile's first position in the part.
    first: usize,
    /// Positions in the part.
    lanes: usize,
    /// The row's first query head in the part.
    head: usize,
    heads: usize,
    dim: usize,
    value_dim: usize,
}

impl TilePart {
    /// The wide part of a tile's (or a run's) first 64 positions against the row's query heads
    /// from `head` on, at most [`HEADS`] of the row's `heads`.
    fn wide(head: usize, heads: usize, dim: usize, value_dim: usize) -> Self {
        TilePart {
            first: 0,
            lanes: WIDE_LANES,
            head,
            heads: HEADS.min(heads - head),
            dim,
            value_dim,
        }
    }
}

/// [`attend_tile`] on one part of the tile, computing `H` query heads (at least `part.heads`:
/// 1, 2, or [`HEADS`] for more, so that a part of one or two heads does not pay for four).
///
/// Every loop over a fixed-size array has constant bounds (heads past `part.heads` are computed
/// and dropped, lanes past `part.lanes` masked), so that the arrays stay in registers: with
/// bounds taken from `part` they went through the stack.
#[inline(always)]
fn attend_part<const FMA: bool, E: TileElement, const H: usize>(
    row: &mut OnlineRow,
    tile: &KeyTile<E>,
    scales: Option<&TileScales>,
    rule: &LogitRule,
    part: TilePart,
) {
    // The next tile asked for once per part of its positions (by the part of the first heads).
    let ahead = row.ahead.filter(|_| part.head == 0);
    let mut logits = if part.lanes == LANES {
        column_scores::<FMA, E, H>(row.queries, tile, part, ahead.as_ref())
    } else {
        any_scores::<FMA, E, H>(row.queries, tile, part)
    };
    if let Some(scales) = scales {
        for logits in &mut logits {
            for (lane, logit) in logits.iter_mut().enumerate().take(part.lanes) {
                *logit *= scales.key(part.first + lane);
            }
        }
    }
    if rule.softcap.is_some() || rule.alibi.is_some() {
        for (h, logits) in logits.iter_mut().enumerate() {
            let head = part.head + h.min(part.heads - 1);
            apply_rule::<FMA>(logits, rule, head, part.first);
        }
    }
    let mut corrections = [1.0f32; H];
    for h in 0..H {
        let logits = &mut logits[h];
        for (lane, logit) in logits.iter_mut().enumerate() {
            if lane >= part.lanes {
                *logit = f32::NEG_INFINITY;
            }
        }
        let head = part.head + h.min(part.heads - 1);
        if let Some(correction) = softmax_step::<FMA>(logits, row, head, h < part.heads) {
            corrections[h] = correction;
        }
    }
    if let Some(scales) = scales {
        // The int8 values' scales go into their weights (the sums above are the softmax's).
        for logits in &mut logits {
            for (lane, weight) in logits.iter_mut().enumerate().take(part.lanes) {
                *weight *= scales.value(part.first + lane);
            }
        }
    }
    if let Some(ahead) = &ahead {
        for lane in 0..part.lanes {
            ahead.value_row(part.first + lane, part.value_dim);
        }
    }
    weighted_values::<FMA, E, H>(row.outputs, tile, part, &logits, &corrections);
}

/// Query head `head`'s online softmax over one part's logits (`-∞` in lanes past the part):
/// the logits become `e^(logit - max)` (0 below `e^FLUSH_BELOW` of it), and where `counted` (a
/// head of the part, not one repeated to fill the registers) the head's running maximum and sum
/// move on and the correction of its outputs so far is returned. The lane loops and the AVX2
/// path share it.
#[inline(always)]
fn softmax_step<const FMA: bool>(
    logits: &mut [f32; LANES],
    row: &mut OnlineRow,
    head: usize,
    counted: bool,
) -> Option<f32> {
    let max = row.maxima[head].max(lane_max(*logits));
    for logit in logits.iter_mut() {
        *logit = flushed_exp::<FMA>(*logit - max);
    }
    // The first tile's correction is e^-∞ = 0, against sums that are still 0.
    let correction = exp::<FMA>(row.maxima[head] - max);
    counted.then(|| {
        row.sums[head] = row.sums[head] * correction + lane_sum(*logits);
        row.maxima[head] = max;
        correction
    })
}

/// `rule` applied to the scores of query head `head` at the tile's positions `first..first +
/// 16`: the soft cap, then ALiBi's penalty for each position's distance before the query. The
/// lane loops and the register paths share it (on their lanes in memory), so that every path
/// computes the same logits.
#[inline(always)]
fn apply_rule<const FMA: bool>(
    logits: &mut [f32; LANES],
    rule: &LogitRule,
    head: usize,
    first: usize,
) {
    if let Some(cap) = rule.softcap {
        for logit in logits.iter_mut() {
            *logit = cap * tanh::<FMA>(*logit / cap);
        }
    }
    if let Some(slopes) = rule.alibi {
        let first = rule.first_distance as f32 - first as f32;
        let slope = slopes[head];
        for (lane, logit) in logits.iter_mut().enumerate() {
            *logit -= slope * (first - lane as f32).abs();
        }
    }
}

/// Query heads `part.head..` (the last repeated up to `H`), each `part.dim` wide.
#[inline(always)]
fn part_queries<const H: usize>(queries: &[f32], part: TilePart) -> [&[f32]; H] {
    std::array::from_fn(|h| {
        let head = part.head + h.min(part.heads - 1);
        &queries[head * part.dim..][..part.dim]
    })
}

/// The scores `[head][lane]` of a whole part of feature-major keys ([`LANES`] positions).
#[inline(always)]
fn column_scores<const FMA: bool, E: TileElement, const H: usize>(
    queries: &[f32],
    tile: &KeyTile<E>,
    part: TilePart,
    ahead: Option<&Ahead>,
) -> [[f32; LANES]; H] {
    let query = part_queries::<H>(queries, part);
    let mut sums = [[0.0f32; LANES]; H];
    for feature in 0..part.dim {
        if let Some(ahead) = ahead {
            ahead.key_line(feature, part.first);
        }
        let start = feature * tile.key_stride + part.first;
        let keys: &[E; LANES] = tile.keys[start..start + LANES]
            .try_into()
            .expect("a lane chunk");
        let keys = E::floats(keys);
        for h in 0..H {
            let weight = query[h][feature];
            for lane in 0..LANES {
                sums[h][lane] = mul_add::<FMA>(weight, keys[lane], sums[h][lane]);
            }
        }
    }
    sums
}

/// The scores `[head][lane]` of any part (a last, partial block; the step's new rows), lanes
/// past `part.lanes` left 0: one dot product per score.
#[inline(always)]
fn any_scores<const FMA: bool, E: TileElement, const H: usize>(
    queries: &[f32],
    tile: &KeyTile<E>,
    part: TilePart,
) -> [[f32; LANES]; H] {
    let query = part_queries::<H>(queries, part);
    let mut sums = [[0.0f32; LANES]; H];
    for lane in 0..part.lanes {
        let position = part.first + lane;
        for (h, query) in query.iter().enumerate() {
            sums[h][lane] = query.iter().enumerate().fold(0.0, |sum, (feature, &q)| {
                let key = tile.keys[feature * tile.key_stride + position].float();
                mul_add::<FMA>(q, key, sum)
            });
        }
    }
    sums
}

/// The largest of `lanes` by halving, as [`lane_sum`] adds them.
#[inline(always)]
fn lane_max(mut lanes: [f32; LANES]) -> f32 {
    let mut half = LANES / 2;
    while half > 0 {
        for lane in 0..half {
            lanes[lane] = lanes[lane].max(lanes[lane + half]);
        }
        half /= 2;
    }
    lanes[0]
}

/// `outputs[head] ← outputs[head] · corrections[head] + Σ_lane weights[head][lane] · value[lane]`
/// for the part's heads, [`VALUE_COLUMNS`] columns at a time.
#[inline(always)]
fn weighted_values<const FMA: bool, E: TileElement, const H: usize>(
    outputs: &mut [f32],
    tile: &KeyTile<E>,
    part: TilePart,
    weights: &[[f32; LANES]; H],
    corrections: &[f32; H],
) {
    let value_dim = part.value_dim;
    let value = |lane: usize, start: usize, columns: usize| {
        &tile.values[(part.first + lane) * tile.value_stride + start..][..columns]
    };
    let mut start = 0;
    while start + VALUE_COLUMNS <= value_dim {
        let mut sums = [[0.0f32; VALUE_COLUMNS]; H];
        for lane in 0..part.lanes {
            // Fixed-length rows, so that the sums stay in registers.
            let value: &[E; VALUE_COLUMNS] = value(lane, start, VALUE_COLUMNS)
                .try_into()
                .expect("a whole chunk");
            let value = E::floats(value);
            for h in 0..H {
                let weight = weights[h][lane];
                for column in 0..VALUE_COLUMNS {
                    sums[h][column] = mul_add::<FMA>(weight, value[column], sums[h][column]);
                }
            }
        }
        for h in 0..H {
            if h < part.heads {
                let output = &mut outputs[(part.head + h) * value_dim + start..][..VALUE_COLUMNS];
                for (output, &sum) in output.iter_mut().zip(&sums[h]) {
                    *output = mul_add::<FMA>(*output, corrections[h], sum);
                }
            }
        }
        start += VALUE_COLUMNS;
    }
    // The last columns of a width that is not a multiple of VALUE_COLUMNS, straight into the
    // outputs.
    if start < value_dim {
        let columns = value_dim - start;
        for h in 0..part.heads {
            let output = &mut outputs[(part.head + h) * value_dim + start..][..columns];
            output.iter_mut().for_each(|o| *o *= corrections[h]);
            for lane in 0..part.lanes {
                let weight = weights[h][lane];
                for (output, &value) in output.iter_mut().zip(value(lane, start, columns)) {
                    *output = mul_add::<FMA>(weight, value.float(), *output);
                }
            }
        }
    }
}

mod ahead;
mod run;

pub(crate) use ahead::Ahead;
pub(crate) use run::{attend_half_run, attend_int8_run, attend_run, runs_read_whole};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(test)]
mod tests;
