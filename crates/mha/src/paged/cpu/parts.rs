//! The tasks of a paged call and the merge of their results. A task is a run of at most
//! [`TASK_ROWS`] rows of one sequence and a part of the positions those rows see: a long
//! sequence's positions are split into parts of at least [`MIN_PART_POSITIONS`] that separate
//! tasks read (FlashDecoding's split of the keys), so that one long sequence — a batch-1
//! decoding step — is spread over rayon's threads too. Each task leaves its rows' softmaxes
//! unfinished (each head's largest logit, sum of exponentials and weighted sum of values);
//! the parts of a run of rows are merged, then divided by their sums.

use std::ops::Range;

use super::sequence::chunks;
use super::{PagedParams, PagedSequence};

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
    fn same_rows(&self, other: &Task) -> bool {
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

/// A task's rows' softmaxes before the division by their sums, row-major: what the parts of
/// a run of rows merge.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct PartialRows {
    /// `[rows, n_heads]`: each head's largest logit (`-∞` where the part holds nothing the row
    /// sees).
    pub maxima: Vec<f32>,
    /// `[rows, n_heads]`: each head's sum of `e^(logit - max)`.
    pub sums: Vec<f32>,
    /// `[rows, n_heads · head_dim]`: each head's sum of values weighted by `e^(logit - max)`.
    pub outputs: Vec<f32>,
}

impl PartialRows {
    /// Adds `other`, the same rows' softmaxes over other positions, to `self`: both rescaled to
    /// the larger maximum of each head.
    ///
    /// # Panics
    ///
    /// If `other` holds other sizes.
    pub fn merge(&mut self, other: &PartialRows, head_dim: usize) {
        assert!(
            self.maxima.len() == other.maxima.len() && self.outputs.len() == other.outputs.len(),
            "paged attention: the parts of a run of rows hold different sizes"
        );
        let head_outputs = self
            .outputs
            .chunks_exact_mut(head_dim)
            .zip(other.outputs.chunks_exact(head_dim));
        for (head, (output, other_output)) in head_outputs.enumerate() {
            let (mine, theirs) = (self.maxima[head], other.maxima[head]);
            let max = mine.max(theirs);
            if max == f32::NEG_INFINITY {
                // Neither part holds a position the row sees.
                continue;
            }
            // `e^(-∞) = 0`: a part that holds nothing for the row adds nothing.
            let (keep, add) = ((mine - max).exp(), (theirs - max).exp());
            self.sums[head] = self.sums[head] * keep + other.sums[head] * add;
            self.maxima[head] = max;
            output
                .iter_mut()
                .zip(other_output)
                .for_each(|(value, other)| *value = *value * keep + other * add);
        }
    }

    /// The rows' outputs `[rows, n_heads, head_dim]`: each head's weighted sum divided by its
    /// softmax sum, the sink's term (if any) added first.
    pub fn normalized(mut self, params: &PagedParams, head_dim: usize) -> Vec<f32> {
        // One output per (row, query head), row-major; the sinks one per query head.
        let head_outputs = self.outputs.chunks_exact_mut(head_dim);
        for (row_head, output) in head_outputs.enumerate() {
            let (mut max, mut sum) = (self.maxima[row_head], self.sums[row_head]);
            let mut scale = 1.0;
            if let Some(sinks) = &params.sinks {
                let sink = sinks[row_head % sinks.len()];
                let with_sink = max.max(sink);
                scale = (max - with_sink).exp();
                sum = sum * scale + (sink - with_sink).exp();
                max = with_sink;
            }
            debug_assert!(max > f32::NEG_INFINITY, "a query sees at least itself");
            let factor = scale / sum;
            output.iter_mut().for_each(|value| *value *= factor);
        }
        self.outputs
    }
}

/// The outputs `[rows, n_heads, head_dim]` of each run of rows of `tasks`, from `partials`
/// (one per task, in order): the parts of a run merged, then normalized.
///
/// # Panics
///
/// If there is not one partial per task.
pub(super) fn merged_outputs<'a>(
    tasks: &'a [Task],
    partials: Vec<PartialRows>,
    params: &'a PagedParams,
    head_dim: usize,
) -> impl Iterator<Item = (Range<usize>, Vec<f32>)> + 'a {
    assert_eq!(
        tasks.len(),
        partials.len(),
        "paged attention: a result per task"
    );
    let mut partials = partials.into_iter().zip(tasks).peekable();
    std::iter::from_fn(move || {
        let (mut merged, first) = partials.next()?;
        while let Some((next, _)) = partials.next_if(|(_, task)| task.same_rows(first)) {
            merged.merge(&next, head_dim);
        }
        Some((first.rows.clone(), merged.normalized(params, head_dim)))
    })
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

    fn params(sinks: Option<Vec<f32>>) -> PagedParams {
        PagedParams {
            sequences: Vec::new().into(),
            scale: 1.0,
            softcap: None,
            alibi: None,
            window: None,
            sinks: sinks.map(Into::into),
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
    fn merged_parts_equal_one_softmax_over_all_positions() {
        // Two heads of width 2 over logits split 2 + 1 (the second head's first part empty).
        let logits = [
            [1.0f32, 3.0, -2.0],
            [f32::NEG_INFINITY, f32::NEG_INFINITY, 0.5],
        ];
        let values = [[1.0f32, 2.0], [3.0, -1.0], [0.5, 4.0]];
        let partial = |positions: Range<usize>| {
            let mut partial = PartialRows {
                maxima: vec![f32::NEG_INFINITY; 2],
                sums: vec![0.0; 2],
                outputs: vec![0.0; 4],
            };
            for (head, head_logits) in logits.iter().enumerate() {
                let max = positions
                    .clone()
                    .map(|p| head_logits[p])
                    .fold(f32::NEG_INFINITY, f32::max);
                if max == f32::NEG_INFINITY {
                    continue;
                }
                partial.maxima[head] = max;
                for p in positions.clone() {
                    let weight = (head_logits[p] - max).exp();
                    partial.sums[head] += weight;
                    partial.outputs[head * 2] += weight * values[p][0];
                    partial.outputs[head * 2 + 1] += weight * values[p][1];
                }
            }
            partial
        };
        let whole = partial(0..3).normalized(&params(None), 2);
        let mut merged = partial(0..2);
        merged.merge(&partial(2..3), 2);
        let merged = merged.normalized(&params(None), 2);
        // The other way round (the part merged in empty for the second head), and in three.
        let mut reversed = partial(2..3);
        reversed.merge(&partial(0..2), 2);
        let reversed = reversed.normalized(&params(None), 2);
        let mut three = partial(0..1);
        three.merge(&partial(1..2), 2);
        three.merge(&partial(2..3), 2);
        let three = three.normalized(&params(None), 2);
        for other in [&merged, &reversed, &three] {
            for (a, b) in whole.iter().zip(other) {
                assert!((a - b).abs() < 1e-6, "{whole:?} against {other:?}");
            }
        }
        // The second head sees position 2 only.
        assert_eq!(&merged[2..], &values[2]);
        // A sink adds to each head's denominator.
        let with_sink = partial(0..3).normalized(&params(Some(vec![0.0, 0.5])), 2);
        assert!((with_sink[2] - 0.25).abs() < 1e-6, "{with_sink:?}");
    }

    #[test]
    fn merged_outputs_merge_the_parts_of_each_run_of_rows() {
        let sequences = [sequence(10, 0..1, 0), sequence(3000, 1..2, 0)];
        let planned = tasks(&sequences, 16, None);
        assert_eq!(planned.len(), 3);
        let partial = |max: f32, sum: f32, value: f32| PartialRows {
            maxima: vec![max],
            sums: vec![sum],
            outputs: vec![value],
        };
        // The second sequence's parts at different maxima: rescaled to the larger.
        let partials = vec![
            partial(0.0, 1.0, 5.0),
            partial(1.0, 2.0, 4.0),
            partial(0.0, 1.0, 3.0),
        ];
        let outputs: Vec<_> = merged_outputs(&planned, partials, &params(None), 1).collect();
        let second = (4.0 + 3.0 / std::f32::consts::E) / (2.0 + 1.0 / std::f32::consts::E);
        assert_eq!(outputs[0], (0..1, vec![5.0]));
        assert_eq!(outputs[1].0, 1..2);
        assert!((outputs[1].1[0] - second).abs() < 1e-6, "{outputs:?}");
    }
}
