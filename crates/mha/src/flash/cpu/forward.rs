//! The forward: each head's output rows and softmax statistics, query block by query block,
//! and, when asked for, the attention weights as each block's probabilities are found.

use std::ops::Range;

use super::scores::ScoreBlock;
use super::{Kernel, Readable, weights};
use crate::cpu::matrix::{
    HeadIndex, Matrix, MatrixMut, Write, for_each_task, gemm, grown, sequence_major_heads,
};
use crate::cpu::simd;
use crate::cpu::storage::CpuStorage;
use crate::flash::inputs::{FlashForward, FlashInputs};
use crate::geometry::Geometry;

/// The forward on f32 storage; `None` for inputs it does not take (another dtype), which the
/// generic body then computes.
///
/// # Panics
///
/// If the inputs' shapes do not fit together ([`FlashInputs::geometry`]).
pub(in crate::flash) fn forward<B: CpuStorage>(inputs: &FlashInputs<B>) -> Option<FlashForward<B>> {
    forward_writing::<B>(inputs, Weights::Skipped).map(|(forward, _)| forward)
}

/// Whether a forward writes the attention weights.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Weights {
    Skipped,
    Written,
}

/// What the forward writes for one head: its softmax statistics (`[seq_q, 2]` flattened) and,
/// when asked for, its weights (`[seq_q, seq_k]` flattened).
pub(super) struct HeadRows<'s> {
    pub stats: &'s mut [f32],
    pub weights: Option<&'s mut [f32]>,
}

/// What the forward writes for one head or one query block of it: [`HeadRows`] and the output
/// rows.
struct HeadOutputs<'s, 'm, 'b> {
    rows: HeadRows<'s>,
    output: &'m mut MatrixMut<'b>,
}

/// The forward's results, and the weights' buffer (`[batch, n_heads, seq_q, seq_k]`) when
/// `weights` asks for them; `None` for inputs it does not take.
///
/// # Panics
///
/// As [`forward`].
pub(super) fn forward_writing<B: CpuStorage>(
    inputs: &FlashInputs<B>,
    weights: Weights,
) -> Option<(FlashForward<B>, Option<Vec<f32>>)> {
    let geometry = inputs.geometry();
    let readable = Readable::of(inputs)?;
    let kernel = Kernel::new(&readable, geometry, &inputs.params)?;
    let fresh = inputs.params.execution.fresh_outputs;
    let Geometry {
        batch,
        n_heads,
        seq_q,
        value_dim,
        ..
    } = geometry;
    let output_shape = [batch, n_heads, seq_q, value_dim];
    // Every element of these is written (recycled buffers hold an earlier call's values).
    let mut output = B::output_buffer(output_shape.iter().product(), fresh);
    // Per query: the score maximum and the inverse sum of exponentials.
    let stats_shape = [batch, n_heads, seq_q, 2];
    let mut softmax_stats = B::output_buffer(stats_shape.iter().product(), fresh);
    let mut weights_buffer = match weights {
        Weights::Written => Some(weights::buffer::<B>(&geometry, fresh)),
        Weights::Skipped => None,
    };
    let heads = weights::per_head(&mut softmax_stats, weights_buffer.as_deref_mut(), &geometry);
    let head_outputs = sequence_major_heads(&mut output, output_shape);
    if kernel.reads_values_once_per_group() {
        kernel.forward_groups(heads, head_outputs)
    } else {
        kernel.forward_heads(heads, head_outputs)
    }
    let forward = FlashForward {
        output: B::sequence_major(output, output_shape),
        softmax_stats: B::contiguous(softmax_stats, stats_shape),
    };
    Some((forward, weights_buffer))
}

#[derive(Default)]
struct ForwardScratch {
    block: BlockScratch,
    /// The head's keys as `[head_dim, seq_k]` ([`crate::cpu::matrix::transposed_copy`]).
    transposed_key: Vec<f32>,
    /// The head's values as dense rows ([`crate::cpu::matrix::dense_copy`]).
    dense_value: Vec<f32>,
    /// [`Kernel::forward_group`]: each query head's block, and the group's unscaled output rows.
    group_blocks: Vec<BlockScratch>,
    group_output: Vec<f32>,
}

#[derive(Default)]
struct BlockScratch {
    scores: Vec<f32>,
    inverse_sums: Vec<f32>,
}

/// Whether a block's `scale · Q Kᵀ` is already in its scratch ([`Kernel::group_dots`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Dots {
    /// [`Kernel::block_probabilities`] computes them.
    Wanted,
    /// In `BlockScratch::scores`, before the soft cap, biases and masks.
    Computed,
}

impl Kernel<'_> {
    /// One task per head, writing its output rows (`outputs`, in head order).
    fn forward_heads(&self, heads: Vec<HeadRows>, outputs: Vec<MatrixMut>) {
        let n_heads = self.geometry.n_heads;
        for_each_task(
            heads.into_iter().zip(outputs).enumerate().collect(),
            self.threads(),
            ForwardScratch::default,
            |scratch, (index, (rows, mut output))| {
                let head = HeadIndex {
                    batch: index / n_heads,
                    head: index % n_heads,
                };
                let outputs = HeadOutputs {
                    rows,
                    output: &mut output,
                };
                self.forward_head(scratch, head, outputs);
            },
        );
    }

    /// One task per key/value head, writing the output rows of its query heads (`outputs`, in
    /// head order).
    fn forward_groups(&self, heads: Vec<HeadRows>, outputs: Vec<MatrixMut>) {
        let (groups, n_kv_heads) = (self.geometry.groups(), self.geometry.n_kv_heads);
        let mut tasks: Vec<(Vec<HeadRows>, Vec<MatrixMut>)> = Vec::new();
        for (index, head) in heads.into_iter().zip(outputs).enumerate() {
            if index % groups == 0 {
                tasks.push((Vec::with_capacity(groups), Vec::with_capacity(groups)));
            }
            let (rows, outputs) = tasks.last_mut().expect("pushed above");
            rows.push(head.0);
            outputs.push(head.1);
        }
        for_each_task(
            tasks.into_iter().enumerate().collect(),
            self.threads(),
            ForwardScratch::default,
            |scratch, (index, (group, mut head_outputs))| {
                let kv_head = HeadIndex {
                    batch: index / n_kv_heads,
                    head: index % n_kv_heads,
                };
                let heads = group
                    .into_iter()
                    .zip(head_outputs.iter_mut())
                    .map(|(rows, output)| HeadOutputs { rows, output })
                    .collect();
                self.forward_group(scratch, kv_head, heads);
            },
        );
    }

    /// Writes head `head`'s outputs, query block by query block.
    fn forward_head(&self, scratch: &mut ForwardScratch, head: HeadIndex, outputs: HeadOutputs) {
        let seq_k = self.geometry.seq_k;
        let HeadOutputs {
            rows: HeadRows { stats, mut weights },
            output,
        } = outputs;
        let ForwardScratch {
            block: block_scratch,
            transposed_key,
            dense_value,
            ..
        } = scratch;
        let kv_head = HeadIndex {
            batch: head.batch,
            head: self.geometry.kv_head(head.head),
        };
        let key_t = self.transposed_head(transposed_key, None, kv_head).key;
        let value = self.dense_rows(dense_value, self.value.head(kv_head));
        for queries in self.query_blocks() {
            let mut output_rows = output.rows(queries.start, queries.len());
            let block = HeadOutputs {
                rows: HeadRows {
                    stats: &mut stats[2 * queries.start..2 * queries.end],
                    weights: weights
                        .as_deref_mut()
                        .map(|weights| &mut weights[queries.start * seq_k..queries.end * seq_k]),
                },
                output: &mut output_rows,
            };
            let keys = self.key_range(head.batch, &queries);
            let scores = ScoreBlock {
                head,
                queries,
                keys,
                key_t,
            };
            self.forward_query_block(block_scratch, &scores, value, block);
        }
    }

    /// Writes one query block's output rows, softmax statistics and, when asked for, weights.
    fn forward_query_block(
        &self,
        scratch: &mut BlockScratch,
        block: &ScoreBlock,
        value: Matrix,
        outputs: HeadOutputs,
    ) {
        let HeadOutputs { rows, output } = outputs;
        if !self.block_probabilities(scratch, block, rows, Dots::Wanted) {
            output.fill(0.0);
            return;
        }
        let (rows, width) = (block.queries.len(), block.keys.len());
        // O = P V, then each row divided by its sum.
        gemm(
            output,
            Write::Overwrite,
            Matrix::dense(&scratch.scores, rows, width),
            value.rows(block.keys.start, width),
            1.0,
        );
        for (row, inverse_sum) in scratch.inverse_sums.iter().enumerate() {
            output.row(row).iter_mut().for_each(|x| *x *= inverse_sum);
        }
    }

    /// One query block's softmax numerators over its keys (`[queries, keys]` in
    /// `scratch.scores`) and the inverse of each row's sum (`scratch.inverse_sums`); writes the
    /// rows' statistics and, when asked for, weights. False when no query of the block sees a
    /// key: the statistics then make every recomputed probability 0 (the sink's alone is 1),
    /// the weights are zeros, and the caller writes zero output rows.
    fn block_probabilities(
        &self,
        scratch: &mut BlockScratch,
        block: &ScoreBlock,
        rows: HeadRows,
        dots: Dots,
    ) -> bool {
        let HeadRows { stats, weights } = rows;
        let sink = self.sinks.map(|sinks| sinks[block.head.head]);
        if block.keys.is_empty() {
            let row_stats = match sink {
                Some(sink) => [sink, 1.0],
                None => [f32::MIN, 0.0],
            };
            for stats in stats.chunks_exact_mut(2) {
                stats.copy_from_slice(&row_stats);
            }
            if let Some(weights) = weights {
                weights.fill(0.0);
            }
            return false;
        }
        let width = block.keys.len();
        let BlockScratch {
            scores,
            inverse_sums,
        } = scratch;
        let scores = match dots {
            Dots::Wanted => self.score_block(scores, None, block),
            Dots::Computed => {
                let scores = &mut scores[..block.queries.len() * width];
                self.finish_scores(scores, None, block);
                scores
            }
        };
        inverse_sums.clear();
        for (row_scores, row_stats) in scores
            .chunks_exact_mut(width)
            .zip(stats.chunks_exact_mut(2))
        {
            let (max, inverse_sum) = softmax_numerators(row_scores, sink);
            inverse_sums.push(inverse_sum);
            row_stats.copy_from_slice(&[max, inverse_sum]);
        }
        if let Some(weights) = weights {
            let numerators = weights::BlockNumerators {
                values: scores,
                keys: &block.keys,
                inverse_sums,
            };
            weights::write_block(weights, self.geometry.seq_k, numerators);
        }
        true
    }

    /// The `scale · Q Kᵀ` of query block `queries` of every query head of key/value head
    /// `kv_head` over `keys`, one head's in each of `blocks`, in one pass over the keys where
    /// each head's would read them in place ([`Kernel::dots_in_place`]: a decoding step): the
    /// keys are then read from memory once for the group, not once per query head. Each score
    /// is the one the head's own [`Kernel::score_block`] computes, to the bit (the
    /// backward's). [`Dots::Wanted`] where the heads read their keys otherwise.
    fn group_dots(
        &self,
        blocks: &mut [BlockScratch],
        kv_head: HeadIndex,
        queries: &Range<usize>,
        keys: &Range<usize>,
        key_t: Matrix,
    ) -> Dots {
        let groups = blocks.len();
        let heads: Vec<HeadIndex> = (0..groups)
            .map(|group_index| HeadIndex {
                batch: kv_head.batch,
                head: kv_head.head * groups + group_index,
            })
            .collect();
        let outputs = blocks.iter_mut().map(|block| &mut block.scores);
        if self.dots_in_place(&heads, queries, keys, key_t, outputs) {
            Dots::Computed
        } else {
            Dots::Wanted
        }
    }

    /// Writes the outputs of key/value head `kv_head`'s query heads (`heads`, in order), query
    /// block by query block: each head's scores and probabilities as
    /// [`Kernel::forward_query_block`] finds them, then `P V` for all of them in one pass over
    /// the value rows ([`simd::weighted_row_sums`]), where a product per head would read them
    /// once per query head. The scores equal, to the bit, those the backward recomputes head
    /// by head (where the group's heads share a pass over the keys, [`Kernel::group_dots`]);
    /// only the output's summation order differs.
    fn forward_group(
        &self,
        scratch: &mut ForwardScratch,
        kv_head: HeadIndex,
        mut heads: Vec<HeadOutputs>,
    ) {
        let (groups, seq_k) = (self.geometry.groups(), self.geometry.seq_k);
        assert_eq!(
            heads.len(),
            groups,
            "forward_group: one output per query head"
        );
        let ForwardScratch {
            transposed_key,
            dense_value,
            group_blocks,
            group_output,
            ..
        } = scratch;
        let key_t = self.transposed_head(transposed_key, None, kv_head).key;
        let value = self.dense_rows(dense_value, self.value.head(kv_head));
        group_blocks.resize_with(groups, BlockScratch::default);
        for queries in self.query_blocks() {
            let keys = self.key_range(kv_head.batch, &queries);
            let dots = self.group_dots(group_blocks, kv_head, &queries, &keys, key_t);
            for (group_index, (head, block_scratch)) in
                heads.iter_mut().zip(group_blocks.iter_mut()).enumerate()
            {
                let rows =
                    HeadRows {
                        stats: &mut head.rows.stats[2 * queries.start..2 * queries.end],
                        weights: head.rows.weights.as_deref_mut().map(|weights| {
                            &mut weights[queries.start * seq_k..queries.end * seq_k]
                        }),
                    };
                let block = ScoreBlock {
                    head: HeadIndex {
                        batch: kv_head.batch,
                        head: kv_head.head * groups + group_index,
                    },
                    queries: queries.clone(),
                    keys: keys.clone(),
                    key_t,
                };
                self.block_probabilities(block_scratch, &block, rows, dots);
            }
            let values = value.rows(keys.start, keys.len());
            write_group_block(
                &mut heads,
                group_blocks,
                group_output,
                &queries,
                &keys,
                values,
            );
        }
    }
}

/// `P V` of one query block of every query head of a group, in one pass over the value rows
/// `values` (the block's keys), each row divided by its sum; zeros where the block sees no key.
fn write_group_block(
    heads: &mut [HeadOutputs],
    blocks: &[BlockScratch],
    sums_buffer: &mut Vec<f32>,
    queries: &Range<usize>,
    keys: &Range<usize>,
    values: Matrix,
) {
    if keys.is_empty() {
        for head in heads {
            head.output.rows(queries.start, queries.len()).fill(0.0);
        }
        return;
    }
    let (rows, width, value_dim) = (queries.len(), keys.len(), values.columns);
    let probability_rows: Vec<&[f32]> = blocks
        .iter()
        .flat_map(|block| block.scores[..rows * width].chunks_exact(width))
        .collect();
    let sums = grown(sums_buffer, probability_rows.len() * value_dim);
    debug_assert_eq!(
        values.column_stride, 1,
        "heads are read with unit column stride"
    );
    simd::weighted_row_sums(sums, &probability_rows, values.values, values.row_stride);
    let mut sum_rows = sums.chunks_exact(value_dim.max(1));
    for (head, block) in heads.iter_mut().zip(blocks) {
        for (row, inverse_sum) in queries.clone().zip(&block.inverse_sums) {
            let sum_row = sum_rows.next().expect("one sum row per query row");
            for (out, &sum) in head.output.row(row).iter_mut().zip(sum_row) {
                *out = sum * inverse_sum;
            }
        }
    }
}

/// Turns one row of scores into `exp(score - max)` in place; returns the maximum and
/// `1 / Σ exp(score - max)`, the sum taking the head's sink logit (one more logit, with no
/// value) when there is one.
///
/// A row with no allowed key (and no sink) becomes zeros, with statistics (`f32::MIN`, 0)
/// that make every recomputed probability 0. A row holding NaN stays NaN, as in every other
/// path.
fn softmax_numerators(row: &mut [f32], sink: Option<f32>) -> (f32, f32) {
    let row_max = simd::max(row);
    if row_max == f32::NEG_INFINITY && row.iter().any(|score| score.is_nan()) {
        // `simd::max` skips NaN: tell an empty row from one of NaN scores.
        row.fill(f32::NAN);
        return (f32::NAN, f32::NAN);
    }
    let max = match sink {
        Some(sink) => row_max.max(sink),
        None => row_max,
    };
    if max == f32::NEG_INFINITY {
        row.fill(0.0);
        return (f32::MIN, 0.0);
    }
    let sum = simd::exp_shifted(row, max) + sink.map_or(0.0, |sink| (sink - max).exp());
    (max, 1.0 / sum)
}
