//! The merge of a run of rows' parts: each task leaves its rows' softmaxes unfinished (each
//! head's largest logit, sum of exponentials and weighted sum of values); the parts of a run
//! are rescaled to their larger maxima and added, then divided by their sums once (a sink's
//! term added then).

use std::ops::Range;

use super::PagedParams;
use super::plan::Task;

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
    use crate::paged::cpu::PagedSequence;
    use crate::paged::cpu::plan::tasks;

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
        // A decoding row each: 11 positions in one part, 3001 in two.
        let decoding = |row: usize, past: usize| PagedSequence {
            rows: row..row + 1,
            past,
            blocks: (0..(past + 1).div_ceil(16)).collect(),
            hidden: 0,
        };
        let sequences = [decoding(0, 10), decoding(1, 3000)];
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
