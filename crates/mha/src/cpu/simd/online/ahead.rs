//! What a tile's loops ask the CPU for as they compute: the keys and values of a tile read
//! after this one, a cache line at a time.

use std::marker::PhantomData;

use super::{KeyTile, LANES, RUN_BLOCKS, TileElement};

pub(super) use super::super::CACHE_LINE;

/// A tile that the caller reads after this one (or a run of blocks, [`Ahead::of_run`]), which
/// this tile's loops ask the CPU for as they go, a cache line per key feature and per value
/// row: asked for all at once (a block's keys and values are a few KiB per head), the requests
/// filled the core's miss buffers and the loops waited behind them.
///
/// It holds addresses, not slices: a prefetch reads nothing and never faults, and every line
/// asked for lies inside the tile it was made from.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ahead<'a> {
    /// Feature-major keys of each block (the tile's in the first): feature `f` of position `i`
    /// at element `f · key_stride + i`.
    keys: [*const u8; RUN_BLOCKS],
    /// Each block's values: position `i`'s at element `i · value_stride`.
    values: [*const u8; RUN_BLOCKS],
    /// Bytes of keys and of values each block holds (a run's least).
    key_bytes: usize,
    value_bytes: usize,
    key_stride: usize,
    value_stride: usize,
    /// Bytes per element.
    element: usize,
    /// Positions in each block.
    count: usize,
    /// Whether the blocks are a run of blocks of [`LANES`] positions (position `p` in block
    /// `p / LANES`), else one tile, the first.
    run: bool,
    tile: PhantomData<&'a [u8]>,
}

impl<'a> Ahead<'a> {
    /// `tile`'s memory.
    pub(crate) fn of<E: TileElement>(tile: &KeyTile<'a, E>) -> Self {
        Ahead {
            keys: [tile.keys.as_ptr().cast(); RUN_BLOCKS],
            values: [tile.values.as_ptr().cast(); RUN_BLOCKS],
            key_bytes: std::mem::size_of_val(tile.keys),
            value_bytes: std::mem::size_of_val(tile.values),
            key_stride: tile.key_stride,
            value_stride: tile.value_stride,
            element: std::mem::size_of::<E>(),
            count: tile.count,
            run: false,
            tile: PhantomData,
        }
    }

    /// The memory of a run of blocks of one pool (see [`super::attend_run`]): position `p` of
    /// the run is position `p % 16` of block `p / 16`.
    pub(crate) fn of_run<E: TileElement>(blocks: &[KeyTile<'a, E>; RUN_BLOCKS]) -> Self {
        let least =
            |bytes: fn(&KeyTile<'a, E>) -> usize| blocks.iter().map(bytes).min().unwrap_or(0);
        Ahead {
            keys: blocks.each_ref().map(|block| block.keys.as_ptr().cast()),
            values: blocks.each_ref().map(|block| block.values.as_ptr().cast()),
            key_bytes: least(|block| std::mem::size_of_val(block.keys)),
            value_bytes: least(|block| std::mem::size_of_val(block.values)),
            run: true,
            ..Self::of(&blocks[0])
        }
    }

    /// Block `block` of a run as a tile of its own (a tile's memory for block 0, none for the
    /// others), for the block's own tile computed in the lane loops.
    pub(super) fn block(self, block: usize) -> Option<Self> {
        (self.run || block == 0).then(|| Ahead {
            keys: [self.keys[block]; RUN_BLOCKS],
            values: [self.values[block]; RUN_BLOCKS],
            run: false,
            ..self
        })
    }

    /// The block holding position `position` and the position in it.
    #[inline(always)]
    pub(super) fn locate(&self, position: usize) -> (usize, usize) {
        if self.run {
            let block = (position / LANES).min(RUN_BLOCKS - 1);
            (block, position - block * LANES)
        } else {
            (0, position)
        }
    }

    /// Whether vector `v` of a part's positions (16 each) asks for its key lines of this tile
    /// ([`Ahead::key_line`]): every vector where this is a run, whose blocks' feature rows are
    /// lines of their own, else the vectors that start a line ([`vector_starts_line`]).
    #[inline(always)]
    pub(super) fn asks_at_vector<E>(&self, v: usize) -> bool {
        self.run || vector_starts_line::<E>(v)
    }

    /// Asks for the line of feature `feature`'s keys from position `position` on (16 positions
    /// of f32 fill a line).
    #[inline(always)]
    pub(super) fn key_line(&self, feature: usize, position: usize) {
        let (block, position) = self.locate(position);
        if let Some(offset) = self.key_offset(feature, position) {
            super::super::prefetch_line(self.keys[block].wrapping_add(offset));
        }
    }

    /// Asks for the lines of position `position`'s value.
    #[inline(always)]
    pub(super) fn value_row(&self, position: usize, value_dim: usize) {
        let (block, position) = self.locate(position);
        for offset in self.value_lines(position, value_dim) {
            super::super::prefetch_line(self.values[block].wrapping_add(offset));
        }
    }

    /// The byte offset in its block of feature `feature`'s key at the block's position
    /// `position`, if the block has it and it starts a line: where a feature's row is shorter
    /// than a line (f16 and int8 blocks of 16), the line holding the previous feature's key at
    /// `position` is asked for once, not again for each feature in it.
    pub(super) fn key_offset(&self, feature: usize, position: usize) -> Option<usize> {
        let stride = self.key_stride * self.element;
        let offset = feature * stride + position * self.element;
        let new_line = feature == 0 || offset / CACHE_LINE != (offset - stride) / CACHE_LINE;
        (position < self.count && offset < self.key_bytes && new_line).then_some(offset)
    }

    /// The byte offsets in its block of the cache lines of the block's position `position`'s
    /// value (`value_dim` wide), if the block has it.
    pub(super) fn value_lines(
        &self,
        position: usize,
        value_dim: usize,
    ) -> impl Iterator<Item = usize> {
        let start = position * self.value_stride * self.element;
        let end = (start + value_dim * self.element).min(self.value_bytes);
        let lines = if position < self.count {
            start..end
        } else {
            0..0
        };
        lines.step_by(CACHE_LINE)
    }
}

/// Whether vector `v` of a part's positions (16 each, from a part's first position, a whole
/// number of lines into the tile's feature rows) starts a line of a feature's keys: every
/// vector in f32, every other in f16, the first of four in i8. A part asks for the next tile's
/// key lines at those vectors only, each line once (every vector for a run's,
/// [`Ahead::asks_at_vector`]).
pub(super) fn vector_starts_line<E>(v: usize) -> bool {
    (v * LANES * std::mem::size_of::<E>()).is_multiple_of(CACHE_LINE)
}
