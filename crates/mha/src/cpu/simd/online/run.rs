//! A run: [`RUN_BLOCKS`] blocks of 16 consecutive positions of one key/value head, each where
//! it lies (a paged pool's blocks of 16 of one sequence), added to a query row's online softmax
//! as one part of 64 positions.
//!
//! Why: the AVX-512 path's wide parts (64 positions: each query feature's broadcast multiplies
//! four vectors of keys, the softmax's reductions and the outputs' rescale paid once for 64
//! positions) took only tiles whose 64 positions lie in one run of memory, so a pool of blocks
//! of 16 (the default, as vLLM's) ran every block as a part of 16. Four blocks in one part need
//! only four key and value addresses where one tile has one.

use burn::tensor::f16;

use super::{
    KeyTile, LANES, LogitRule, OnlineRow, RUN_BLOCKS, TileElement, TileScales, WIDE_LANES,
    attend_half_tile, attend_int8_tile, attend_tile, check_scales, checked_sizes,
};

/// [`attend_tile`] over the run `blocks`, position `p` of the run position `p % 16` of block
/// `p / 16`; `rule.first_distance` is the run's first position's. `row.ahead`, if any, is the
/// memory of what the caller reads next, as a tile or a run ([`super::Ahead::of_run`]).
///
/// # Panics
///
/// As [`attend_tile`] for each block, if a block holds other than 16 positions, or if the run
/// does not lie at or before the query (`rule.first_distance` below 63).
pub(crate) fn attend_run(row: &mut OnlineRow, blocks: &[KeyTile; RUN_BLOCKS], rule: LogitRule) {
    attend_run_checked(row, blocks, None, rule, |row, tile, _, rule| {
        attend_tile(row, tile, rule)
    });
}

/// [`attend_run`] for blocks of f16 keys and values, converted to f32 as they are read.
///
/// # Panics
///
/// As [`attend_run`].
pub(crate) fn attend_half_run(
    row: &mut OnlineRow,
    blocks: &[KeyTile<f16>; RUN_BLOCKS],
    rule: LogitRule,
) {
    attend_run_checked(row, blocks, None, rule, |row, tile, _, rule| {
        attend_half_tile(row, tile, rule)
    });
}

/// [`attend_run`] for blocks of int8 keys and values, block `b`'s scaled by `scales[b]` (see
/// [`super::attend_int8_tile`]).
///
/// # Panics
///
/// As [`attend_run`], and if a block's scales hold fewer than 16 scales of either kind.
pub(crate) fn attend_int8_run(
    row: &mut OnlineRow,
    blocks: &[KeyTile<i8>; RUN_BLOCKS],
    scales: &[TileScales; RUN_BLOCKS],
    rule: LogitRule,
) {
    for (tile, scales) in blocks.iter().zip(scales) {
        check_scales(tile, scales);
    }
    attend_run_checked(
        row,
        blocks,
        Some(scales),
        rule,
        |row, tile, scales, rule| {
            attend_int8_tile(row, tile, scales.expect("an int8 block's scales"), rule)
        },
    );
}

/// Whether [`attend_run`] reads a run of values `value_dim` wide as one part (the AVX-512 path,
/// as `MHA_CPU_CAPABILITY` allows): elsewhere it reads the blocks one at a time, and a caller
/// gains nothing by forming runs (capped to AVX2, the f32 paged step took 1.1x its time with
/// runs read block by block).
pub(crate) fn runs_read_whole(value_dim: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use super::TilePart;
        // The element does not matter to a wide part: its positions are whole vectors.
        super::avx512::takes::<f32>(TilePart::wide(0, 1, 1, value_dim))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = value_dim;
        false
    }
}

/// The entry points' body: the run's blocks checked, then one wide part per four query heads
/// through the AVX-512 path where it takes them, else each block as a tile of its own through
/// `one_tile` (the AVX2 path and the lane loops, which have no wide parts).
fn attend_run_checked<E: TileElement>(
    row: &mut OnlineRow,
    blocks: &[KeyTile<E>; RUN_BLOCKS],
    scales: Option<&[TileScales; RUN_BLOCKS]>,
    rule: LogitRule,
    one_tile: impl Fn(&mut OnlineRow, KeyTile<E>, Option<TileScales>, LogitRule),
) {
    let mut sizes = (0, 0);
    for (block, tile) in blocks.iter().enumerate() {
        sizes = checked_sizes(row, tile, &rule);
        assert!(
            tile.count == LANES,
            "attend_run: block {block} holds {} positions, a run's blocks {LANES} each",
            tile.count
        );
    }
    assert!(
        rule.first_distance >= WIDE_LANES - 1,
        "attend_run: the run's first position is {} before the query: its {WIDE_LANES} \
         positions do not all lie at or before it",
        rule.first_distance
    );
    #[cfg(target_arch = "x86_64")]
    if attend_wide(row, blocks, scales, &rule, sizes) {
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = sizes;
    let ahead = row.ahead;
    for (block, tile) in blocks.iter().enumerate() {
        row.ahead = ahead.and_then(|ahead| ahead.block(block));
        let block_rule = LogitRule {
            first_distance: rule.first_distance - block * LANES,
            ..rule
        };
        one_tile(row, *tile, scales.map(|scales| scales[block]), block_rule);
    }
    row.ahead = ahead;
}

/// The run through the AVX-512 path, one wide part per four query heads, if it takes them
/// (`avx512::takes`); whether it did.
#[cfg(target_arch = "x86_64")]
fn attend_wide<E: TileElement>(
    row: &mut OnlineRow,
    blocks: &[KeyTile<E>; RUN_BLOCKS],
    scales: Option<&[TileScales; RUN_BLOCKS]>,
    rule: &LogitRule,
    (dim, value_dim): (usize, usize),
) -> bool {
    use super::{HEADS, TilePart};
    let heads = row.maxima.len();
    if !super::avx512::takes::<E>(TilePart::wide(0, heads, dim, value_dim)) {
        return false;
    }
    for head in (0..heads).step_by(HEADS) {
        let part = TilePart::wide(head, heads, dim, value_dim);
        // SAFETY: the CPU has AVX-512F (`takes` checked it); every block holds its 16
        // positions' keys and values of the row's widths (`checked_sizes`, the caller's) and,
        // for int8, their scales (`check_scales`); the row holds whole heads, `part.heads` of
        // them from `head`.
        unsafe { super::avx512::attend_run_part(row, blocks, scales, rule, part) };
    }
    true
}
