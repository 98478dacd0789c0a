//! The tasks of a paged call. A task is a run of at most [`TASK_ROWS`] rows of one sequence and
//! a part of the positions those rows see: a long sequence's positions are split into parts of
//! at least [`MIN_PART_POSITIONS`] that separate tasks read (FlashDecoding's split of the keys),
//! so that one long sequence — a batch-1 decoding step — is spread over rayon's threads too.
//! A task reads its positions in chunks, a tile of at most [`MAX_TILE_POSITIONS`] each: a
//! stored block (or part of one), or the step's new rows.

use std::ops::Range;

use super::PagedSequence;
use crate::cpu::simd::{RUN_BLOCK_POSITIONS, RUN_BLOCKS};

/// Rows of one sequence that one task takes at most: a prompt's rows are spread over rayon's
/// threads, and each task reads the keys and values its rows see once, tile by tile, for all
/// of them.
pub(super) const TASK_ROWS: usize = 16;

/// Positions a part of a split sequence holds at least: a sequence whose rows see fewer is
/// one task's.
///
/// Why: a part is a task of its own, worth handing to another thread where it reads about a
/// MiB of f32 keys and values (1024 positions of two key/value heads of 64 features): tens of
/// microseconds of work, more than the handover costs where the thread is awake; shorter
/// sequences are spread over the threads well enough by being many.
pub(super) const MIN_PART_POSITIONS: usize = 1024;

/// One task of a paged call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Task<'a> {
    /// The sequence whose rows and positions these are.
    pub sequence: &'a PagedSequence,
    /// The step's rows it computes, rows of `sequence`.
    pub rows: Range<usize>,
    /// The positions of the sequence it reads for them: all they see, or a part of it.
    pub positions: Range<usize>,
}

impl Task<'_> {
    /// Whether `self` and `other` compute the same rows of the same sequence (parts of one run
    /// of rows).
    pub(super) fn same_rows(&self, other: &Task) -> bool {
        std::ptr::eq(self.sequence, other.sequence) && self.rows == other.rows
    }
}

/// The positions a row at `position` sees: a `window`'s up to itself, none before `hidden`
/// (and always itself).
pub(super) fn visible(position: usize, window: Option<usize>, hidden: usize) -> Range<usize> {
    let first = window.map_or(0, |window| (position + 1).saturating_sub(window));
    first.max(hidden).min(position)..position + 1
}

/// The call's tasks, sequence by sequence, run of rows by run of rows, part by part.
pub(super) fn tasks<'a>(
    sequences: &'a [PagedSequence],
    block_size: usize,
    window: Option<usize>,
) -> Vec<Task<'a>> {
    let mut tasks = Vec::with_capacity(sequences.len());
    for sequence in sequences {
        let rows = sequence.rows.clone();
        for start in rows.clone().step_by(TASK_ROWS) {
            let rows = start..(start + TASK_ROWS).min(rows.end);
            let position = |row: usize| sequence.past + row - sequence.rows.start;
            // Every row sees a span that starts no earlier and ends later than the row
            // before's.
            let span = visible(position(rows.start), window, sequence.hidden).start
                ..visible(position(rows.end - 1), window, sequence.hidden).end;
            tasks.extend(parts(sequence, block_size, span).map(|positions| Task {
                sequence,
                rows: rows.clone(),
                positions,
            }));
        }
    }
    tasks
}

/// `span` cut into `len / MIN_PART_POSITIONS` parts (at least one) of about equal length, at
/// the boundaries of the tiles the kernel reads, so that every part reads whole tiles: cut `i`
/// at the first tile's end at or past `i / count` of the span (not a part's length past the
/// last cut, whose overshoots would add up and leave a last part of a few positions), so that
/// every part is within a tile of `len / count`.
fn parts(
    sequence: &PagedSequence,
    block_size: usize,
    span: Range<usize>,
) -> impl Iterator<Item = Range<usize>> {
    let count = (span.len() / MIN_PART_POSITIONS).max(1);
    let mut cuts = Vec::with_capacity(count + 1);
    cuts.push(span.start);
    if count > 1 {
        let mut next = 1;
        for chunk in chunks(sequence, block_size, span.clone()) {
            let end = chunk.positions.end;
            if next < count && end < span.end && end - span.start >= next * span.len() / count {
                cuts.push(end);
                next += 1;
            }
        }
    }
    cuts.push(span.end);
    (1..cuts.len()).map(move |index| cuts[index - 1]..cuts[index])
}

/// Consecutive positions of a sequence that one tile covers, for every key/value head: a
/// stored block's (or part of one), or the step's new rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Chunk {
    /// The sequence's positions the tile holds.
    pub positions: Range<usize>,
    /// Where its keys and values lie.
    pub source: ChunkSource,
}

/// Where a chunk's keys and values lie.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ChunkSource {
    /// Index `index` of the block table, from `offset` positions into the block.
    Stored { index: usize, offset: usize },
    /// The step's rows from `row` on.
    New { row: usize },
}

/// Positions a tile holds at most: a paged pool's block (16 by default) is one tile (four
/// whole ones in a row are read as one run, [`units`]); a
/// [`KvCache`](crate::KvCache)'s buffer, which the kernel reads as one block per sequence, is
/// read in tiles of this many positions, so that the prefetch ahead (`sequence.rs`'s
/// `PREFETCH_BYTES`) follows the sequence tile by tile.
pub(super) const MAX_TILE_POSITIONS: usize = 64;

/// The positions of a tile of blocks of `block_size`.
pub(super) fn tile_positions(block_size: usize) -> usize {
    block_size.clamp(1, MAX_TILE_POSITIONS)
}

/// The chunks rows of `sequence` that see positions `visible` read, in order: its stored
/// positions block by block (in tiles of at most [`MAX_TILE_POSITIONS`]), then the step's new
/// ones, a tile at a time.
pub(super) fn chunks(
    sequence: &PagedSequence,
    block_size: usize,
    visible: Range<usize>,
) -> impl Iterator<Item = Chunk> + '_ {
    let tile = tile_positions(block_size);
    let stored = visible.start..visible.end.min(sequence.past);
    let blocks = if stored.is_empty() {
        0..0
    } else {
        stored.start / block_size..stored.end.div_ceil(block_size)
    };
    let stored_chunks = blocks.flat_map(move |index| {
        let first = (index * block_size).max(stored.start);
        let end = ((index + 1) * block_size).min(stored.end);
        (first..end).step_by(tile).map(move |start| Chunk {
            positions: start..(start + tile).min(end),
            source: ChunkSource::Stored {
                index,
                offset: start - index * block_size,
            },
        })
    });
    let new = visible.start.max(sequence.past)..visible.end;
    let new_chunks = new.clone().step_by(tile).map(move |first| Chunk {
        positions: first..(first + tile).min(new.end),
        source: ChunkSource::New {
            row: sequence.rows.start + first - sequence.past,
        },
    });
    stored_chunks.chain(new_chunks)
}

impl Chunk {
    /// The part of the chunk at `positions` (inside it).
    pub fn narrowed(&self, positions: Range<usize>) -> Chunk {
        let skipped = positions.start - self.positions.start;
        let source = match self.source {
            ChunkSource::Stored { index, offset } => ChunkSource::Stored {
                index,
                offset: offset + skipped,
            },
            ChunkSource::New { row } => ChunkSource::New { row: row + skipped },
        };
        Chunk { positions, source }
    }
}

/// Chunks of a task that the kernel reads as one: a run of [`RUN_BLOCKS`] whole stored blocks
/// of [`RUN_BLOCK_POSITIONS`] (a pool's default blocks of 16), one wide part of the kernel
/// (`simd::attend_run`), else one chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Unit {
    /// The sequence's positions the unit holds.
    pub positions: Range<usize>,
    /// Its chunks' indices in the task's chunk list.
    pub chunks: Range<usize>,
}

impl Unit {
    /// Whether the unit is a run of blocks, not one chunk.
    pub fn is_run(&self) -> bool {
        self.chunks.len() == RUN_BLOCKS
    }
}

/// `chunks` (one task's, in order) grouped into units: where `runs` (the kernel reads a run as
/// one part, `simd::runs_read_whole`), every [`RUN_BLOCKS`] whole stored blocks in a row a run
/// where the pool's blocks hold [`RUN_BLOCK_POSITIONS`]; each other chunk a unit of its own.
pub(super) fn units(chunks: &[Chunk], block_size: usize, runs: bool) -> Vec<Unit> {
    let whole_block = |chunk: &Chunk| {
        matches!(chunk.source, ChunkSource::Stored { offset: 0, .. })
            && chunk.positions.len() == block_size
    };
    let mut units = Vec::with_capacity(chunks.len());
    let mut first = 0;
    while first < chunks.len() {
        let run = runs
            && block_size == RUN_BLOCK_POSITIONS
            && chunks
                .get(first..first + RUN_BLOCKS)
                .is_some_and(|run| run.iter().all(whole_block));
        let end = first + if run { RUN_BLOCKS } else { 1 };
        units.push(Unit {
            positions: chunks[first].positions.start..chunks[end - 1].positions.end,
            chunks: first..end,
        });
        first = end;
    }
    units
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sequence(past: usize, rows: Range<usize>, hidden: usize) -> PagedSequence {
        PagedSequence {
            rows,
            past,
            blocks: (0..(past + 64).div_ceil(16)).collect(),
            hidden,
        }
    }

    #[test]
    fn a_short_sequence_is_one_task_and_a_long_one_parts_of_at_least_the_minimum() {
        let sequences = [sequence(100, 0..1, 0), sequence(4095, 1..2, 0)];
        let planned = tasks(&sequences, 16, None);
        let positions: Vec<_> = planned.iter().map(|task| task.positions.clone()).collect();
        // 4096 positions: four parts cut at blocks of 16.
        assert_eq!(
            positions,
            [0..101, 0..1024, 1024..2048, 2048..3072, 3072..4096]
        );
        assert!(planned[1..].iter().all(|task| task.rows == (1..2)));
        // 2047 positions are one part: two would hold fewer than the minimum.
        let sequences = [sequence(2046, 0..1, 0)];
        assert_eq!(tasks(&sequences, 16, None)[0].positions, 0..2047);
    }

    #[test]
    fn parts_stay_within_a_tile_of_an_equal_share_however_many() {
        // 65536 positions in tiles of 16: 64 parts; a buffer of 16383 in tiles of 64: 15.
        for (past, block_size, tile) in [(65535, 16, 16), (16382, 16384, 64)] {
            let sequence = PagedSequence {
                rows: 0..1,
                past,
                blocks: (0..(past + 1).div_ceil(block_size)).collect(),
                hidden: 0,
            };
            let planned = tasks(std::slice::from_ref(&sequence), block_size, None);
            let share = (past + 1) / planned.len();
            assert_eq!(planned.len(), (past + 1) / MIN_PART_POSITIONS);
            assert_eq!(planned[0].positions.start, 0);
            assert_eq!(planned[planned.len() - 1].positions.end, past + 1);
            for pair in planned.windows(2) {
                assert_eq!(pair[0].positions.end, pair[1].positions.start);
            }
            for task in &planned {
                let len = task.positions.len();
                assert!(
                    len + tile >= share && len <= share + tile,
                    "{:?} against a share of {share}",
                    task.positions
                );
            }
        }
    }

    #[test]
    fn parts_cover_the_rows_span_past_padding_and_a_window_and_cut_at_tiles() {
        // Hidden padding: the span starts at 37; a block of 4096 is read in tiles of 64 from
        // there.
        let padded = PagedSequence {
            rows: 0..1,
            past: 3000,
            blocks: vec![0],
            hidden: 37,
        };
        let positions: Vec<_> = tasks(std::slice::from_ref(&padded), 4096, None)
            .iter()
            .map(|task| task.positions.clone())
            .collect();
        assert_eq!(positions, [37..1573, 1573..3001]);
        // A window of 2500: the last row sees 2500 positions up to itself.
        let windowed = sequence(3000, 0..3, 0);
        let positions: Vec<_> = tasks(std::slice::from_ref(&windowed), 16, Some(2500))
            .iter()
            .map(|task| task.positions.clone())
            .collect();
        assert_eq!(positions, [501..1760, 1760..3003]);
        // Runs of 16 rows: each run's parts.
        let prompt = sequence(0, 0..40, 0);
        let runs: Vec<_> = tasks(std::slice::from_ref(&prompt), 16, None)
            .iter()
            .map(|task| (task.rows.clone(), task.positions.clone()))
            .collect();
        assert_eq!(runs, [(0..16, 0..16), (16..32, 0..32), (32..40, 0..40)]);
    }

    #[test]
    fn four_whole_blocks_of_16_in_a_row_make_a_run_and_every_other_chunk_a_unit() {
        // 150 stored positions seen from 5, then two new rows: block 0 from position 5, two
        // runs of four blocks, the last block's 6 positions and the new rows.
        let stored = sequence(150, 0..2, 0);
        let chunk_list: Vec<Chunk> = chunks(&stored, 16, 5..152).collect();
        let spans: Vec<(Range<usize>, bool)> = units(&chunk_list, 16, true)
            .iter()
            .map(|unit| (unit.positions.clone(), unit.is_run()))
            .collect();
        assert_eq!(
            spans,
            [
                (5..16, false),
                (16..80, true),
                (80..144, true),
                (144..150, false),
                (150..152, false)
            ]
        );
        let total: usize = units(&chunk_list, 16, true)
            .iter()
            .map(|unit| unit.chunks.len())
            .sum();
        assert_eq!(total, chunk_list.len());
        // A kernel that reads runs block by block gets no runs.
        assert!(
            units(&chunk_list, 16, false)
                .iter()
                .all(|unit| !unit.is_run())
        );
        // Blocks of 32 are read as tiles of their own.
        let chunk_list: Vec<Chunk> = chunks(&stored, 32, 0..152).collect();
        assert!(
            units(&chunk_list, 32, true)
                .iter()
                .all(|unit| !unit.is_run())
        );
    }
}
