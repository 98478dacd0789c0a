//! Attention by query blocks × key blocks with an online softmax, in ordinary tensor
//! operations.

use burn::tensor::Tensor;

use super::{SoftmaxOptions, lowest_finite, soft_cap};
use crate::geometry::Geometry;
use crate::input::BlockSizes;
use crate::mask::ScoreMasks;

/// Attention by query blocks × key blocks with an online softmax (running maximum and sum, as
/// FlashAttention and Rabe & Staats, "Self-attention does not need O(n²) memory"): at no time
/// is more than one `[batch, n_heads, query block, key block]` score block held, instead of the
/// full `[batch, n_heads, seq_q, seq_k]` matrix — rules (causal, window, segments, ALiBi)
/// included, which are made for each block alone.
///
/// Exact up to summation order; a query whose keys are all forbidden outputs zero. Key blocks
/// no query of a block may see are skipped. Under autodiff, every block's intermediates are
/// kept for the backward pass, so this bounds inference memory only.
///
/// # Shapes
///
/// As [`explicit_attention`](super::explicit_attention), without the weights.
pub(crate) fn chunked_attention(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    masks: &ScoreMasks,
    options: &SoftmaxOptions,
    blocks: BlockSizes,
) -> Tensor<4> {
    let geometry = Geometry::of_heads(query.dims(), key.dims(), value.dims());
    let query = query.mul_scalar(options.scale);
    let outputs = (0..geometry.seq_q)
        .step_by(blocks.query)
        .map(|q_start| {
            let q_len = blocks.query.min(geometry.seq_q - q_start);
            let block = QueryBlock {
                geometry,
                masks,
                options,
                q_start,
                q_len,
                query: query.clone().narrow(2, q_start, q_len).reshape([
                    geometry.batch,
                    geometry.n_kv_heads,
                    geometry.groups() * q_len,
                    geometry.head_dim,
                ]),
            };
            block.attend(&key, &value, blocks.key)
        })
        .collect();
    Tensor::cat(outputs, 2)
}

/// One block of scaled queries, grouped onto their key/value heads.
struct QueryBlock<'a> {
    geometry: Geometry,
    masks: &'a ScoreMasks,
    options: &'a SoftmaxOptions,
    q_start: usize,
    q_len: usize,
    /// `[batch, n_kv_heads, groups · q_len, head_dim]`
    query: Tensor<4>,
}

impl QueryBlock<'_> {
    /// The block's output `[batch, n_heads, q_len, value_dim]`.
    fn attend(&self, key: &Tensor<4>, value: &Tensor<4>, key_block: usize) -> Tensor<4> {
        let Geometry {
            batch,
            n_heads,
            n_kv_heads,
            value_dim,
            ..
        } = self.geometry;
        let device = key.device();
        // In the inputs' float type, which need not be the device's default.
        let dtype = self.query.dtype();
        let per_query = [batch, n_heads, self.q_len, 1];
        // A sink is one more logit with no value: the softmax starts from it.
        let (mut running_max, mut running_sum) = match &self.options.sinks {
            Some(sinks) => (
                sinks
                    .clone()
                    .cast(dtype)
                    .reshape([1, n_heads, 1, 1])
                    .expand(per_query),
                Tensor::<4>::ones(per_query, &device).cast(dtype),
            ),
            None => (
                Tensor::<4>::full(per_query, f32::NEG_INFINITY, &device).cast(dtype),
                Tensor::<4>::zeros(per_query, &device).cast(dtype),
            ),
        };
        let mut accumulator =
            Tensor::<4>::zeros([batch, n_heads, self.q_len, value_dim], &device).cast(dtype);
        let visible = (0..batch)
            .map(|b| {
                self.masks.rules.key_range(
                    b,
                    self.q_start..self.q_start + self.q_len,
                    self.geometry.seq_k,
                )
            })
            .reduce(|a, b| a.start.min(b.start)..a.end.max(b.end))
            .unwrap_or(0..0);
        for k_start in (0..self.geometry.seq_k).step_by(key_block) {
            let k_len = key_block.min(self.geometry.seq_k - k_start);
            if k_start + k_len <= visible.start || k_start >= visible.end {
                continue;
            }
            let scores = self.scores(key.clone().narrow(2, k_start, k_len), k_start, k_len);
            let new_max = running_max
                .clone()
                .max_pair(scores.clone().max_dim(3))
                .clamp_min(lowest_finite(dtype));
            let correction = (running_max - new_max.clone()).exp();
            let probabilities = (scores - new_max.clone()).exp();
            running_sum = running_sum * correction.clone() + probabilities.clone().sum_dim(3);
            let contribution = probabilities
                .reshape([
                    batch,
                    n_kv_heads,
                    self.geometry.groups() * self.q_len,
                    k_len,
                ])
                .matmul(value.clone().narrow(2, k_start, k_len))
                .reshape([batch, n_heads, self.q_len, value_dim]);
            accumulator = accumulator * correction + contribution;
            running_max = new_max;
        }
        let empty_row = running_sum.clone().equal_elem(0.0).float().cast(dtype);
        accumulator / (running_sum + empty_row)
    }

    /// Scores of the block against keys `k_start..k_start + k_len`, capped, biased, masked
    /// entries `-inf`: `[batch, n_heads, q_len, k_len]`.
    fn scores(&self, key: Tensor<4>, k_start: usize, k_len: usize) -> Tensor<4> {
        let Geometry { batch, n_heads, .. } = self.geometry;
        let shape = [batch, n_heads, self.q_len, k_len];
        let mut scores = self
            .query
            .clone()
            .matmul(key.swap_dims(2, 3))
            .reshape(shape);
        if let Some(cap) = self.options.softcap {
            scores = soft_cap(scores, cap);
        }
        let (forbid, bias) = self.masks.block(
            [batch, n_heads],
            self.q_start..self.q_start + self.q_len,
            k_start..k_start + k_len,
            (&scores.device(), scores.dtype()),
        );
        if let Some(bias) = bias {
            scores = scores + bias.expand(shape);
        }
        if let Some(forbid) = forbid {
            scores = scores.mask_fill(forbid.expand(shape), f32::NEG_INFINITY);
        }
        scores
    }
}
