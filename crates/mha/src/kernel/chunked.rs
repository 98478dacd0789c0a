//! Attention by query blocks × key blocks with an online softmax, in ordinary tensor
//! operations.

use burn::tensor::kind::Basic;
use burn::tensor::{Bool, Tensor};

use super::{SoftmaxOptions, lowest_finite};
use crate::geometry::{Geometry, causal_offset};
use crate::input::BlockSizes;
use crate::mask::ScoreMasks;

/// Attention by query blocks × key blocks with an online softmax (running maximum and sum, as
/// FlashAttention and Rabe & Staats, "Self-attention does not need O(n²) memory"): at no time
/// is more than one `[batch, n_heads, query block, key block]` score block held, instead of the
/// full `[batch, n_heads, seq_q, seq_k]` matrix.
///
/// Exact up to summation order; a query whose keys are all forbidden outputs zero. Key blocks
/// entirely in a query block's causal future are skipped. Under autodiff, every block's
/// intermediates are kept for the backward pass, so this bounds inference memory only.
///
/// # Shapes
///
/// As [`explicit_attention`](super::explicit_attention), without the weights.
pub(crate) fn chunked_attention(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    masks: &ScoreMasks,
    options: SoftmaxOptions,
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
        let per_query = [batch, n_heads, self.q_len, 1];
        // In the inputs' float type, which need not be the device's default.
        let dtype = self.query.dtype();
        let mut running_max = Tensor::<4>::full(per_query, f32::NEG_INFINITY, &device).cast(dtype);
        let mut running_sum = Tensor::<4>::zeros(per_query, &device).cast(dtype);
        let mut accumulator =
            Tensor::<4>::zeros([batch, n_heads, self.q_len, value_dim], &device).cast(dtype);
        // The block's last query sees keys up to this one (bottom-right causal).
        let key_end = self.geometry.causal_key_end(self.q_start + self.q_len - 1);
        for k_start in (0..self.geometry.seq_k).step_by(key_block) {
            if self.masks.causal && k_start >= key_end {
                break;
            }
            let k_len = key_block.min(self.geometry.seq_k - k_start);
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

    /// Scores of the block against keys `k_start..k_start + k_len`, masked entries `-inf`:
    /// `[batch, n_heads, q_len, k_len]`.
    fn scores(&self, key: Tensor<4>, k_start: usize, k_len: usize) -> Tensor<4> {
        let Geometry {
            batch,
            n_heads,
            seq_q,
            seq_k,
            ..
        } = self.geometry;
        let (q_start, q_len) = (self.q_start, self.q_len);
        let shape = [batch, n_heads, q_len, k_len];
        let mut scores = self
            .query
            .clone()
            .matmul(key.swap_dims(2, 3))
            .reshape(shape);
        if let Some(bias) = &self.masks.bias {
            scores = scores + narrow_block(bias, (q_start, q_len), (k_start, k_len)).expand(shape);
        }
        if let Some(forbid) = &self.masks.forbid {
            let forbid = narrow_block(forbid, (q_start, q_len), (k_start, k_len));
            scores = scores.mask_fill(forbid.expand(shape), f32::NEG_INFINITY);
        }
        if self.masks.causal {
            let offset = q_start as i64 - k_start as i64 + causal_offset(seq_q, seq_k);
            let future = Tensor::<2, Bool>::tril_mask([q_len, k_len], offset, &scores.device())
                .reshape([1, 1, q_len, k_len])
                .expand(shape);
            scores = scores.mask_fill(future, f32::NEG_INFINITY);
        }
        scores
    }
}

/// A mask's `[.., .., queries, keys]` block, where an axis of size 1 (broadcast) is kept whole.
fn narrow_block<K: Basic>(
    tensor: &Tensor<4, K>,
    (q_start, q_len): (usize, usize),
    (k_start, k_len): (usize, usize),
) -> Tensor<4, K> {
    let narrow = |tensor: Tensor<4, K>, axis: usize, start: usize, length: usize| {
        if tensor.dims()[axis] == 1 {
            tensor
        } else {
            tensor.narrow(axis, start, length)
        }
    };
    narrow(narrow(tensor.clone(), 2, q_start, q_len), 3, k_start, k_len)
}
