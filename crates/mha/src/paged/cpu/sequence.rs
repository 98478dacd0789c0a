//! Rows of one sequence in a paged step, each query through the sequence's block table: the
//! chunks the rows read (the stored blocks, then the step's new rows, a tile of at most 64
//! positions at a time; four whole blocks of 16 in a row read as one run, a part of 64 of the
//! kernel), each chunk's tile of keys and values per key/value head where it lies, and the
//! online softmax of every row over them. Tiles are visited in order and each is read by every row that sees it
//! before the next, so that a prompt's rows share each tile from the CPU's nearest cache.

use std::ops::Range;

use burn::tensor::f16;

use super::merge::PartialRows;
use super::plan::{Chunk, ChunkSource, Task, Unit, chunks, tile_positions, units, visible};
use super::{PagedParams, PagedSequence, PoolViews, Sizes, Views};
use crate::cpu::matrix::{HeadIndex, HeadsView};
use crate::cpu::simd;
use crate::cpu::simd::RUN_BLOCKS;

/// One chunk's keys and values of one key/value head, where they lie: f32, f16, or the i8 of
/// an int8 pool's block and its scales.
#[derive(Clone, Copy)]
enum Tile<'a> {
    Float(simd::KeyTile<'a>),
    Half(simd::KeyTile<'a, f16>),
    Int8(simd::KeyTile<'a, i8>, simd::TileScales<'a>),
}

impl<'a> Tile<'a> {
    /// The tile's keys and values, for the tile computed before it to ask the CPU for.
    fn ahead(&self) -> simd::Ahead<'a> {
        match self {
            Tile::Float(tile) => simd::Ahead::of(tile),
            Tile::Half(tile) => simd::Ahead::of(tile),
            Tile::Int8(tile, _) => simd::Ahead::of(tile),
        }
    }
}

/// A run of blocks of one key/value head (a [`Unit`] that [`Unit::is_run`]), each where it
/// lies: f32, f16, or int8 blocks and their scales.
#[derive(Clone, Copy)]
enum Run<'a> {
    Float([simd::KeyTile<'a>; RUN_BLOCKS]),
    Half([simd::KeyTile<'a, f16>; RUN_BLOCKS]),
    Int8(
        [simd::KeyTile<'a, i8>; RUN_BLOCKS],
        [simd::TileScales<'a>; RUN_BLOCKS],
    ),
}

impl<'a> Run<'a> {
    /// The run of `tiles`, one pool's blocks (all of one element).
    fn of(tiles: [Tile<'a>; RUN_BLOCKS]) -> Self {
        use Tile::{Float, Half, Int8};
        match tiles {
            [Float(a), Float(b), Float(c), Float(d)] => Run::Float([a, b, c, d]),
            [Half(a), Half(b), Half(c), Half(d)] => Run::Half([a, b, c, d]),
            [Int8(a, sa), Int8(b, sb), Int8(c, sc), Int8(d, sd)] => {
                Run::Int8([a, b, c, d], [sa, sb, sc, sd])
            }
            _ => unreachable!("a run's blocks are one pool's, of one element"),
        }
    }
}

/// What the kernel reads as one for one key/value head: a tile or a run of blocks (made once
/// per task, in [`TaskTiles`]).
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Copy)]
enum UnitTile<'a> {
    Tile(Tile<'a>),
    Run(Run<'a>),
}

impl<'a> UnitTile<'a> {
    /// `unit`'s keys and values of key/value head `kv_head`, from the task's `chunks`.
    fn of(
        (views, sequence): (&Views<'a>, &PagedSequence),
        chunks: &[Chunk],
        unit: &Unit,
        kv_head: usize,
    ) -> Self {
        let chunk_tile = |chunk: usize| tile(views, sequence, kv_head, &chunks[chunk]);
        if unit.is_run() {
            let first = unit.chunks.start;
            UnitTile::Run(Run::of(std::array::from_fn(|block| {
                chunk_tile(first + block)
            })))
        } else {
            UnitTile::Tile(chunk_tile(unit.chunks.start))
        }
    }

    /// Its keys and values, for the unit computed before it to ask the CPU for.
    fn ahead(&self) -> simd::Ahead<'a> {
        match self {
            UnitTile::Tile(tile) => tile.ahead(),
            UnitTile::Run(Run::Float(blocks)) => simd::Ahead::of_run(blocks),
            UnitTile::Run(Run::Half(blocks)) => simd::Ahead::of_run(blocks),
            UnitTile::Run(Run::Int8(blocks, _)) => simd::Ahead::of_run(blocks),
        }
    }
}

/// `count` positions of a stored block from `offset` on, of one key/value head.
#[derive(Clone, Copy)]
struct BlockPart {
    head: HeadIndex,
    offset: usize,
    count: usize,
}

impl BlockPart {
    /// The part's keys (feature-major: a block's `[features, positions]`) and values (its
    /// `[positions, features]`) where they lie in the pool's views, each slice from the part's
    /// first element to the end of the pool's: the tile kernels check what they read against
    /// them, so that a tile costs two offsets, not a checked matrix of each side (the int8
    /// step at 32 sequences took 5-6% less time, the f32 one 1-3%).
    #[inline]
    fn tile<'a, E>(
        self,
        keys: &HeadsView<'a, E>,
        values: &HeadsView<'a, E>,
    ) -> simd::KeyTile<'a, E> {
        let (keys, values) = (
            keys.head_elements(self.head),
            values.head_elements(self.head),
        );
        simd::KeyTile {
            keys: &keys.values[self.offset * keys.strides[3]..],
            key_stride: keys.strides[2],
            values: &values.values[self.offset * values.strides[2]..],
            value_stride: values.strides[2],
            count: self.count,
        }
    }
}

/// `chunk`'s keys and values of key/value head `kv_head`.
fn tile<'a>(
    views: &Views<'a>,
    sequence: &PagedSequence,
    kv_head: usize,
    chunk: &Chunk,
) -> Tile<'a> {
    let count = chunk.positions.len();
    match chunk.source {
        ChunkSource::Stored { index, offset } => {
            let head = HeadIndex {
                batch: sequence.blocks[index],
                head: kv_head,
            };
            let block = BlockPart {
                head,
                offset,
                count,
            };
            match &views.pool {
                PoolViews::Float { keys, values } => Tile::Float(block.tile(keys, values)),
                PoolViews::Half { keys, values } => Tile::Half(block.tile(keys, values)),
                PoolViews::Int8 {
                    keys,
                    key_scales,
                    values,
                    value_scales,
                } => {
                    // A row of one scale per position for the keys, a column for the values.
                    let key_scales = key_scales.head_elements(head);
                    let value_scales = value_scales.head_elements(head);
                    let scales = simd::TileScales {
                        keys: &key_scales.values[offset * key_scales.strides[3]..],
                        key_stride: key_scales.strides[3],
                        values: &value_scales.values[offset * value_scales.strides[2]..],
                        value_stride: value_scales.strides[2],
                    };
                    Tile::Int8(block.tile(keys, values), scales)
                }
            }
        }
        ChunkSource::New { row } => {
            let head = HeadIndex {
                batch: 0,
                head: kv_head,
            };
            let values = views.new_value.head(head).rows(row, count);
            let (keys, key_stride) = views.new_key_columns.keys(kv_head, row, count);
            Tile::Float(simd::KeyTile {
                keys,
                key_stride,
                values: values.values,
                value_stride: values.row_stride,
                count,
            })
        }
    }
}

/// Bytes ahead of the unit it computes (in a task's order: unit by unit, key/value head by
/// key/value head within a unit) from which a task asks the CPU for a unit's keys and values,
/// line by line as it computes (see [`simd::Ahead`]): a block's keys and values are a few KiB
/// each, and the hardware prefetchers do not follow the block table from one to the next (at
/// 32 sequences of 128-4096 positions the step took about 40% longer without).
const PREFETCH_BYTES: usize = 16 << 10;

/// How many units on a task asks for, units of `unit_bytes` keys and values:
/// [`PREFETCH_BYTES`] ahead (two f32 tiles of 64 features by 16 positions, eight in int8; one
/// run of four such blocks in f32 or f16, two in int8), at least the next one.
fn prefetch_distance(unit_bytes: usize) -> usize {
    PREFETCH_BYTES.div_ceil(unit_bytes.max(1)).max(1)
}

/// A task's chunks, grouped into units, and every (unit, key/value head) tile, made once: the
/// prefetch ahead and the computation read the same list, unit by unit.
struct TaskTiles<'a> {
    chunks: Vec<Chunk>,
    units: Vec<Unit>,
    /// Unit by unit, `n_kv_heads` each.
    tiles: Vec<UnitTile<'a>>,
    n_kv_heads: usize,
    /// Units (of key/value heads) between the one a task computes and the one it asks for.
    distance: usize,
}

impl<'a> TaskTiles<'a> {
    fn new(
        views: &Views<'a>,
        sizes: Sizes,
        sequence: &PagedSequence,
        positions: Range<usize>,
    ) -> Self {
        let Sizes {
            n_kv_heads,
            head_dim,
            block_size,
            ..
        } = sizes;
        let chunks: Vec<Chunk> = chunks(sequence, block_size, positions).collect();
        let units = units(&chunks, block_size, simd::runs_read_whole(head_dim));
        let unit_positions = if units.iter().any(Unit::is_run) {
            RUN_BLOCKS * block_size
        } else {
            tile_positions(block_size)
        };
        let mut tiles = Vec::with_capacity(units.len() * n_kv_heads);
        for unit in &units {
            tiles.extend(
                (0..n_kv_heads)
                    .map(|kv_head| UnitTile::of((views, sequence), &chunks, unit, kv_head)),
            );
        }
        TaskTiles {
            chunks,
            units,
            tiles,
            n_kv_heads,
            distance: prefetch_distance(unit_positions * 2 * head_dim * views.pool.element_bytes()),
        }
    }

    /// Unit `index`'s keys and values of key/value head `kv_head`.
    fn unit(&self, index: usize, kv_head: usize) -> &UnitTile<'a> {
        &self.tiles[index * self.n_kv_heads + kv_head]
    }

    /// The (unit, key/value head) to ask for while computing unit `index`'s head `kv_head`.
    fn ahead_of(&self, index: usize, kv_head: usize) -> Option<&UnitTile<'a>> {
        self.tiles
            .get(index * self.n_kv_heads + kv_head + self.distance)
    }
}

/// The softmaxes of `task`'s rows over its positions, unfinished ([`PartialRows`]): unit by
/// unit of the keys the rows see (a tile: a block, or 64 positions of a longer one, at most; or
/// a run of four blocks of 16), every key/value head in turn within a unit, so that a task
/// reads each block's heads (adjacent in the pool) close together, and each (unit, key/value
/// head) is read by every row that sees it before the next (one [`simd::attend_tile`] or
/// [`simd::attend_run`] per row, for the query heads that share the key/value head; a row that
/// sees part of a run reads its blocks' parts one at a time).
pub(super) fn task_softmaxes(
    views: &Views,
    sizes: Sizes,
    params: &PagedParams,
    task: &Task,
) -> PartialRows {
    let (n_heads, n_kv_heads, head_dim) = (sizes.n_heads, sizes.n_kv_heads, sizes.head_dim);
    let Task {
        sequence,
        rows,
        positions,
    } = task;
    assert!(
        !rows.is_empty() && sequence.rows.start <= rows.start && rows.end <= sequence.rows.end,
        "paged attention: rows {rows:?} are not rows of the sequence's {:?}",
        sequence.rows
    );
    let group = n_heads / n_kv_heads;
    let mut rows = RowStates::new(views, params, task, (n_heads, head_dim));
    let task_tiles = TaskTiles::new(views, sizes, sequence, positions.clone());
    for (index, unit) in task_tiles.units.iter().enumerate() {
        let asker = rows.asker(&unit.positions);
        for kv_head in 0..n_kv_heads {
            let ahead = task_tiles.ahead_of(index, kv_head);
            if let Some(ahead) = ahead {
                prefetch_scales(ahead);
            }
            let mut ahead = ahead.map(UnitTile::ahead);
            let current = task_tiles.unit(index, kv_head);
            let heads = kv_head * group..(kv_head + 1) * group;
            for row in 0..rows.visible.len() {
                let (visible, position) = (rows.visible[row].clone(), rows.positions[row]);
                let seen = overlap(&visible, &unit.positions);
                if seen.is_empty() {
                    continue;
                }
                let ahead = if row == asker { ahead.take() } else { None };
                let rule = |first: usize| simd::LogitRule {
                    softcap: params.softcap,
                    alibi: params.alibi.as_ref().map(|slopes| &slopes[heads.clone()]),
                    first_distance: position - first,
                };
                if seen == unit.positions {
                    let rule = rule(seen.start);
                    rows.attend(row, current, heads.clone(), rule, ahead);
                    continue;
                }
                // Part of the unit (a prompt's row, a window's first): chunk by chunk, each
                // narrowed to what the row sees.
                let mut ahead = ahead;
                for chunk in &task_tiles.chunks[unit.chunks.clone()] {
                    let seen = overlap(&visible, &chunk.positions);
                    if !seen.is_empty() {
                        let rule = rule(seen.start);
                        let narrowed = tile(views, sequence, kv_head, &chunk.narrowed(seen));
                        rows.attend(
                            row,
                            &UnitTile::Tile(narrowed),
                            heads.clone(),
                            rule,
                            ahead.take(),
                        );
                    }
                }
            }
        }
    }
    rows.partial()
}

/// The positions of `a` that are in `b` (empty if none).
fn overlap(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    a.start.max(b.start)..a.end.min(b.end)
}

/// The rows of a task and their online softmaxes under way, row-major.
struct RowStates {
    /// Each row's position in its sequence.
    positions: Vec<usize>,
    /// The positions each row sees that the task reads: a window's, up to itself (empty where
    /// the task's part holds none of them).
    visible: Vec<Range<usize>>,
    /// `[rows, n_heads · head_dim]`, multiplied by the softmax scale once, so that the dot
    /// products are the scores.
    queries: Vec<f32>,
    /// `[rows, n_heads]`: each head's largest logit so far.
    maxima: Vec<f32>,
    /// `[rows, n_heads]`: each head's sum of exponentials so far.
    sums: Vec<f32>,
    /// `[rows, n_heads · head_dim]`: each head's weighted sum of values so far.
    outputs: Vec<f32>,
    n_heads: usize,
    head_dim: usize,
}

impl RowStates {
    fn new(
        views: &Views,
        params: &PagedParams,
        task: &Task,
        (n_heads, head_dim): (usize, usize),
    ) -> Self {
        let Task {
            sequence,
            rows,
            positions: part,
        } = task;
        let width = n_heads * head_dim;
        let positions: Vec<usize> = rows
            .clone()
            .map(|row| sequence.past + row - sequence.rows.start)
            .collect();
        let visible = positions
            .iter()
            .map(|&position| {
                let seen = visible(position, params.window, sequence.hidden);
                let start = seen.start.max(part.start);
                start..seen.end.min(part.end).max(start)
            })
            .collect();
        let mut queries = vec![0.0f32; rows.len() * width];
        for (local, row) in rows.clone().enumerate() {
            for head in 0..n_heads {
                let query = views.query.row(HeadIndex { batch: 0, head }, row);
                simd::scaled_copy(
                    &mut queries[local * width + head * head_dim..][..head_dim],
                    query,
                    params.scale,
                );
            }
        }
        Self {
            positions,
            visible,
            queries,
            maxima: vec![f32::NEG_INFINITY; rows.len() * n_heads],
            sums: vec![0.0f32; rows.len() * n_heads],
            outputs: vec![0.0f32; rows.len() * width],
            n_heads,
            head_dim,
        }
    }

    /// The row that asks for the unit ahead while it reads the unit at `positions`: the first
    /// that sees all of it, else the last that sees part of it (a prompt's rows see their own
    /// chunk up to themselves), since a row asks for as many positions of the unit ahead as
    /// it reads of its own.
    fn asker(&self, positions: &Range<usize>) -> usize {
        let whole = |visible: &Range<usize>| {
            visible.start <= positions.start && positions.end <= visible.end
        };
        let part =
            |visible: &Range<usize>| visible.start < positions.end && positions.start < visible.end;
        self.visible
            .iter()
            .position(whole)
            .or_else(|| self.visible.iter().rposition(part))
            .unwrap_or(0)
    }

    /// Row `row`'s softmax of query heads `heads`, asking for `ahead` as it goes.
    fn online_row<'s>(
        &'s mut self,
        row: usize,
        heads: Range<usize>,
        ahead: Option<simd::Ahead<'s>>,
    ) -> simd::OnlineRow<'s> {
        let (width, head_dim) = (self.n_heads * self.head_dim, self.head_dim);
        let features = row * width + heads.start * head_dim..row * width + heads.end * head_dim;
        let heads = row * self.n_heads + heads.start..row * self.n_heads + heads.end;
        simd::OnlineRow {
            queries: &self.queries[features.clone()],
            outputs: &mut self.outputs[features],
            maxima: &mut self.maxima[heads.clone()],
            sums: &mut self.sums[heads],
            ahead,
        }
    }

    /// Adds `unit`'s positions to row `row`'s softmax of query heads `heads` (those sharing the
    /// unit's key/value head), asking for `ahead` as it goes; a run the row sees whole.
    fn attend(
        &mut self,
        row: usize,
        unit: &UnitTile,
        heads: Range<usize>,
        rule: simd::LogitRule,
        ahead: Option<simd::Ahead>,
    ) {
        let mut online = self.online_row(row, heads, ahead);
        match unit {
            UnitTile::Tile(Tile::Float(tile)) => simd::attend_tile(&mut online, *tile, rule),
            UnitTile::Tile(Tile::Half(tile)) => simd::attend_half_tile(&mut online, *tile, rule),
            UnitTile::Tile(Tile::Int8(tile, scales)) => {
                simd::attend_int8_tile(&mut online, *tile, *scales, rule)
            }
            UnitTile::Run(Run::Float(blocks)) => simd::attend_run(&mut online, blocks, rule),
            UnitTile::Run(Run::Half(blocks)) => simd::attend_half_run(&mut online, blocks, rule),
            UnitTile::Run(Run::Int8(blocks, scales)) => {
                simd::attend_int8_run(&mut online, blocks, scales, rule)
            }
        }
    }

    /// The rows' softmaxes so far.
    fn partial(self) -> PartialRows {
        PartialRows {
            maxima: self.maxima,
            sums: self.sums,
            outputs: self.outputs,
        }
    }
}

/// Asks the CPU for an int8 tile's or run's scales (a line or two a block; their keys and
/// values are asked for by the unit computed before it, through [`UnitTile::ahead`]).
fn prefetch_scales(unit: &UnitTile) {
    let prefetch = |tile: &simd::KeyTile<i8>, scales: &simd::TileScales| {
        simd::prefetch(scales.keys, tile.count * scales.key_stride);
        simd::prefetch(scales.values, tile.count * scales.value_stride);
    };
    match unit {
        UnitTile::Tile(Tile::Int8(tile, scales)) => prefetch(tile, scales),
        UnitTile::Run(Run::Int8(blocks, scales)) => {
            blocks
                .iter()
                .zip(scales)
                .for_each(|(tile, scales)| prefetch(tile, scales));
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_asks_for_the_tiles_16_kib_ahead_and_at_least_the_next() {
        // f32, f16 and int8 tiles of 64 features by 16 positions, keys and values.
        assert_eq!(prefetch_distance(16 * 2 * 64 * 4), 2);
        assert_eq!(prefetch_distance(16 * 2 * 64 * 2), 4);
        assert_eq!(prefetch_distance(16 * 2 * 64), 8);
        // Runs of four such blocks.
        assert_eq!(prefetch_distance(64 * 2 * 64 * 4), 1);
        assert_eq!(prefetch_distance(64 * 2 * 64 * 2), 1);
        assert_eq!(prefetch_distance(64 * 2 * 64), 2);
        assert_eq!(prefetch_distance(64 << 10), 1);
        assert_eq!(prefetch_distance(0), PREFETCH_BYTES);
    }
}
