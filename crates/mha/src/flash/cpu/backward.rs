//! The backward: one task per key/value head, which owns that head's key and value gradients
//! outright and writes the query gradients of its group's query heads, recomputing every score
//! block from the forward's softmax statistics.

use std::ops::Range;

use burn::backend::tensor::FloatTensor;
use burn::backend::{TensorData, TensorMetadata};

use super::scores::ScoreBlock;
use super::{Kernel, Readable, TransposedHead};
use crate::cpu::matrix::{
    HeadIndex, HeadsView, Matrix, MatrixMut, Write, for_each_task, gemm, grown,
    sequence_major_heads,
};
use crate::cpu::simd;
use crate::cpu::storage::CpuStorage;
use crate::flash::inputs::{FlashGrads, FlashState};
use crate::geometry::Geometry;

/// The backward on f32 storage; `None` for inputs it does not take.
///
/// # Panics
///
/// If the inputs' shapes do not fit together, or the output gradient's shape is not the
/// output's.
pub(in crate::flash) fn backward<B: CpuStorage>(
    state: &FlashState<B>,
    output_grad: &FloatTensor<B>,
) -> Option<FlashGrads<B>> {
    let inputs = &state.inputs;
    let geometry = inputs.geometry();
    state.check_output_grad(output_grad);
    let readable = Readable::of(inputs)?;
    let kernel = Kernel::new(&readable, geometry, &inputs.params)?;
    let saved = [
        B::readable(output_grad)?,
        B::readable(&state.softmax_stats)?,
        B::readable(&state.output)?,
    ];
    let rows = SavedRows {
        output_grad: B::heads_view(&saved[0])?,
        softmax_stats: B::heads_view(&saved[1])?,
        output: B::heads_view(&saved[2])?,
    };
    let shapes = GradShapes::of(&geometry);
    let fresh = inputs.params.execution.fresh_outputs;
    // Every element is written.
    let mut query_grad = B::output_buffer(shapes.query.iter().product(), fresh);
    // GEMMs accumulate into these, so they are filled with -0.0 (-0.0 + x = x): zeros would be
    // untouched pages that the first accumulating read maps to the shared zero page, and the
    // write after it would then take a copy-on-write fault and a TLB shootdown of every other
    // core, page by page (15% of a training step at batch 4, 512 tokens, d_model 512).
    let mut key_grad = B::filled_buffer(shapes.key.iter().product(), -0.0);
    let mut value_grad = B::filled_buffer(shapes.value.iter().product(), -0.0);
    let Geometry {
        batch,
        n_heads,
        n_kv_heads,
        ..
    } = geometry;
    // Per (batch, head): the sink logit's gradient; each task owns its group's heads.
    let mut sink_grads = vec![0.0f32; batch * n_heads];
    let tasks = kv_head_tasks(
        &geometry,
        [
            sequence_major_heads(&mut query_grad, shapes.query),
            sequence_major_heads(&mut key_grad, shapes.key),
            sequence_major_heads(&mut value_grad, shapes.value),
        ],
        &mut sink_grads,
    );
    for_each_task(
        tasks.into_iter().enumerate().collect(),
        kernel.threads(),
        BackwardScratch::default,
        |scratch, (index, mut grads)| {
            let kv_head = HeadIndex {
                batch: index / n_kv_heads,
                head: index % n_kv_heads,
            };
            kernel.backward_kv_head(scratch, &rows, kv_head, &mut grads);
        },
    );
    let sinks = inputs.sinks.as_ref().map(|_| {
        let per_head: Vec<f32> = (0..n_heads)
            .map(|h| (0..batch).map(|b| sink_grads[b * n_heads + h]).sum())
            .collect();
        B::float_from_data(TensorData::new(per_head, [n_heads]), &inputs.query.device())
    });
    Some(FlashGrads {
        query: B::sequence_major(query_grad, shapes.query),
        key: B::sequence_major(key_grad, shapes.key),
        value: B::sequence_major(value_grad, shapes.value),
        sinks,
    })
}

#[derive(Default)]
struct BackwardScratch {
    block: BlockScratch,
    /// The key/value head's keys and values as `[dim, seq_k]`
    /// ([`crate::cpu::matrix::transposed_copy`]).
    transposed_key: Vec<f32>,
    transposed_value: Vec<f32>,
    /// The key/value head's keys as dense rows ([`crate::cpu::matrix::dense_copy`]).
    dense_key: Vec<f32>,
}

#[derive(Default)]
struct BlockScratch {
    probabilities: Vec<f32>,
    score_grads: Vec<f32>,
    /// `1 - tanh²` of the capped scores, under a soft cap.
    cap_derivatives: Vec<f32>,
    /// Each row's sink probability, under sinks.
    sink_probabilities: Vec<f32>,
}

/// What the backward reads of the forward and of the output gradient.
struct SavedRows<'a> {
    output_grad: HeadsView<'a>,
    /// `[batch, n_heads, seq_q, 2]`: maximum and inverse sum per query.
    softmax_stats: HeadsView<'a>,
    /// The forward's output, `[batch, n_heads, seq_q, value_dim]`.
    output: HeadsView<'a>,
}

struct GradShapes {
    query: [usize; 4],
    key: [usize; 4],
    value: [usize; 4],
}

impl GradShapes {
    fn of(geometry: &Geometry) -> Self {
        let Geometry {
            batch,
            n_heads,
            n_kv_heads,
            seq_q,
            seq_k,
            head_dim,
            value_dim,
        } = *geometry;
        Self {
            query: [batch, n_heads, seq_q, head_dim],
            key: [batch, n_kv_heads, seq_k, head_dim],
            value: [batch, n_kv_heads, seq_k, value_dim],
        }
    }
}

/// One backward task's gradients: the query heads of a group, their key/value head's, and the
/// group's sink logits'.
struct KvHeadGrads<'a, 's> {
    query: Vec<MatrixMut<'a>>,
    key: MatrixMut<'a>,
    value: MatrixMut<'a>,
    sinks: &'s mut [f32],
}

/// Each key/value head's gradients, in head order, from the heads of the query, key and value
/// gradients (each in head order) and the per-(batch, query head) sink gradients.
fn kv_head_tasks<'a, 's>(
    geometry: &Geometry,
    [query, key, value]: [Vec<MatrixMut<'a>>; 3],
    sink_grads: &'s mut [f32],
) -> Vec<KvHeadGrads<'a, 's>> {
    let groups = geometry.groups();
    // Key/value head `(b, kv)` serves query heads `(b, kv · groups..(kv + 1) · groups)`: in head
    // order, the next `groups` of them.
    let mut query = query.into_iter();
    key.into_iter()
        .zip(value)
        .zip(sink_grads.chunks_mut(groups))
        .map(|((key, value), sinks)| KvHeadGrads {
            query: query.by_ref().take(groups).collect(),
            key,
            value,
            sinks,
        })
        .collect()
}

/// One backward query block's gradient targets: its query rows, the whole key/value head, and
/// its head's sink logit.
struct BlockGrads<'q, 'k, 'b> {
    query: MatrixMut<'q>,
    key: &'k mut MatrixMut<'b>,
    value: &'k mut MatrixMut<'b>,
    sink: Option<&'k mut f32>,
}

/// Where [`Kernel::probabilities`] writes: the probabilities, which the caller then reads, and
/// the scratch beside them.
struct ProbabilityBuffers<'s, 'o> {
    probabilities: &'s mut Vec<f32>,
    cap_derivatives: &'o mut Vec<f32>,
    sink_probabilities: &'o mut Vec<f32>,
}

/// The factors a backward block reads of its key/value head: `Kᵀ` and `Vᵀ`, and the keys as
/// rows.
#[derive(Clone, Copy)]
struct KvFactors<'t> {
    transposed: TransposedHead<'t>,
    key_rows: Matrix<'t>,
}

impl Kernel<'_> {
    /// Every query head of key/value head `kv_head`: its query gradients, its share of the
    /// key/value head's, and its sink logit's.
    fn backward_kv_head(
        &self,
        scratch: &mut BackwardScratch,
        rows: &SavedRows,
        kv_head: HeadIndex,
        grads: &mut KvHeadGrads,
    ) {
        let groups = self.geometry.groups();
        let KvHeadGrads {
            query,
            key,
            value,
            sinks,
        } = grads;
        let BackwardScratch {
            block: block_scratch,
            transposed_key,
            transposed_value,
            dense_key,
        } = scratch;
        let factors = KvFactors {
            transposed: self.transposed_head(transposed_key, Some(transposed_value), kv_head),
            key_rows: self.dense_rows(dense_key, self.key.head(kv_head)),
        };
        for (group_index, query_grad) in query.iter_mut().enumerate() {
            let head = HeadIndex {
                batch: kv_head.batch,
                head: kv_head.head * groups + group_index,
            };
            for queries in self.query_blocks() {
                let mut block_grads = BlockGrads {
                    query: query_grad.rows(queries.start, queries.len()),
                    key: &mut *key,
                    value: &mut *value,
                    sink: match self.sinks {
                        Some(_) => sinks.get_mut(group_index),
                        None => None,
                    },
                };
                let keys = self.key_range(head.batch, &queries);
                let block = ScoreBlock {
                    head,
                    queries,
                    keys,
                    key_t: factors.transposed.key,
                };
                self.backward_query_block(block_scratch, rows, &block, factors, &mut block_grads);
            }
        }
    }

    /// One query block: `P = exp(S - max) / Σ`, `dV += Pᵀ dO`, `dS = P ∘ (dO Vᵀ - D)` with
    /// `D = rowsum(P ∘ dO Vᵀ)` (times `1 - tanh²` under a soft cap), `dQ = scale · dS K`,
    /// `dK += scale · dSᵀ Q`, `d sink -= P_sink · D`.
    fn backward_query_block(
        &self,
        scratch: &mut BlockScratch,
        rows: &SavedRows,
        block: &ScoreBlock,
        factors: KvFactors,
        grads: &mut BlockGrads,
    ) {
        let ScoreBlock {
            head,
            queries,
            keys,
            ..
        } = block;
        if keys.is_empty() {
            // Zero query gradient rows; nothing reaches the keys or the sink (D = 0).
            grads.query.fill(0.0);
            return;
        }
        let (q_len, width) = (queries.len(), keys.len());
        let BlockScratch {
            probabilities,
            score_grads,
            cap_derivatives,
            sink_probabilities,
        } = scratch;
        let buffers = ProbabilityBuffers {
            probabilities,
            cap_derivatives: &mut *cap_derivatives,
            sink_probabilities: &mut *sink_probabilities,
        };
        let probabilities = self.probabilities(buffers, rows, block);
        let output_grad = rows.output_grad.head(*head).rows(queries.start, q_len);
        gemm(
            &mut grads.value.rows(keys.start, width),
            Write::Accumulate,
            probabilities.transposed(),
            output_grad,
            1.0,
        );
        let score_grads = grown(score_grads, q_len * width);
        let mut probability_grads = MatrixMut::dense(score_grads, q_len, width);
        gemm(
            &mut probability_grads,
            Write::Overwrite,
            output_grad,
            factors.transposed.value.columns(keys.start, width),
            1.0,
        );
        // D_i = Σ_j P_ij dP_ij from the row itself rather than FlashAttention-2's rowsum(dO ∘ O):
        // the two are equal in exact arithmetic, but this one is computed from the very dP the
        // row's dS subtracts it from, so a saturated row (P one-hot) gets dS = 0 exactly, as
        // autodiff through the explicit softmax does; dO · O, summed in another order, leaves
        // a rounding residue that large inputs amplify into the weight gradients. This kernel
        // holds a query block's whole rows, so the sum costs one pass over them.
        //
        // dO · O still serves, as a shift c: dP_ij - D_i = (dP_ij - c) - Σ_k P_ik (dP_ik - c)
        // when the row's P sums to 1. In a nearly saturated row (one P within an ulp of 1, the
        // others tiny) D_i is within an ulp of its top key's dP, and dS there is the difference
        // of two numbers of that size: summed unshifted, its rounding (an ulp of dP) outweighed
        // the true value, a sum of the tiny P times their keys' dP differences (seen: a query
        // gradient off by half where the explicit path was off by 3%); shifted by c, which is
        // as close to the top key's dP, every term is of the size of the result.
        let output = rows.output.head(*head).rows(queries.start, q_len);
        for (row, grad_row) in score_grads.chunks_exact_mut(width).enumerate() {
            let row_p = probabilities.row(row);
            let shift = simd::dot(output_grad.row(row), output.row(row));
            grad_row.iter_mut().for_each(|grad| *grad -= shift);
            // The sink's dP is 0, shifted to -c.
            let sink_p = sink_probabilities[row];
            let row_dot = simd::dot(row_p, grad_row) - sink_p * shift;
            simd::softmax_grad(grad_row, row_p, row_dot);
            if let Some(sink_grad) = grads.sink.as_deref_mut() {
                // P_sink (dP_sink - D) with the sink's shifted dP, -c.
                *sink_grad -= sink_p * (shift + row_dot);
            }
        }
        if self.params.softcap.is_some() {
            for (grad, derivative) in score_grads.iter_mut().zip(cap_derivatives.iter()) {
                *grad *= derivative;
            }
        }
        self.score_grads_into(
            grads,
            block,
            Matrix::dense(score_grads, q_len, width),
            factors,
        );
    }

    /// `P = exp(S - max) / Σ` of `block` from the forward's statistics, in
    /// `buffers.probabilities` (`[queries, keys]`), and each row's sink probability in
    /// `buffers.sink_probabilities` under sinks; under a soft cap, `buffers.cap_derivatives`.
    fn probabilities<'s>(
        &self,
        buffers: ProbabilityBuffers<'s, '_>,
        rows: &SavedRows,
        block: &ScoreBlock,
    ) -> Matrix<'s> {
        let ProbabilityBuffers {
            probabilities,
            cap_derivatives,
            sink_probabilities,
        } = buffers;
        let probabilities = self.score_block(probabilities, Some(cap_derivatives), block);
        let (q_len, width) = (block.queries.len(), block.keys.len());
        let sink = self.sinks.map(|sinks| sinks[block.head.head]);
        sink_probabilities.clear();
        sink_probabilities.resize(q_len, 0.0);
        for (row, row_p) in probabilities.chunks_exact_mut(width).enumerate() {
            let stats = rows
                .softmax_stats
                .row(block.head, block.queries.start + row);
            let (max, inverse_sum) = (stats[0], stats[1]);
            simd::exp_shifted(row_p, max);
            row_p.iter_mut().for_each(|p| *p *= inverse_sum);
            if let Some(sink) = sink {
                sink_probabilities[row] = (sink - max).exp() * inverse_sum;
            }
        }
        Matrix::dense(probabilities, q_len, width)
    }

    /// `dQ = scale · dS K` and `dK += scale · dSᵀ Q` for one block's score gradients.
    fn score_grads_into(
        &self,
        grads: &mut BlockGrads,
        block: &ScoreBlock,
        score_grads: Matrix,
        factors: KvFactors,
    ) {
        let scale = self.params.scale as f32;
        let keys: &Range<usize> = &block.keys;
        let key = factors.key_rows.rows(keys.start, keys.len());
        let query = self
            .query
            .head(block.head)
            .rows(block.queries.start, block.queries.len());
        gemm(&mut grads.query, Write::Overwrite, score_grads, key, scale);
        gemm(
            &mut grads.key.rows(keys.start, keys.len()),
            Write::Accumulate,
            score_grads.transposed(),
            query,
            scale,
        );
    }
}
