//! The attention core, `softmax(q kᵀ · scale + bias) v`, on split heads: Burn's fused kernel
//! and the explicit path that can also return the weights, apply dropout or a quiet softmax.

use burn::nn::Dropout;
use burn::tensor::activation::softmax;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, Tensor};

use crate::mask::{ScoreMasks, causal_mask};

/// How the scores are turned into probabilities.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SoftmaxOptions {
    pub scale: f64,
    /// `scale` is `1/sqrt(head_dim)`; the fused kernel is then told nothing, which keeps
    /// CubeCL backends on their flash kernel (they fall back on a custom scale).
    pub default_scale: bool,
    pub quiet: bool,
}

/// Burn's fused attention. Key/value heads are repeated to the query heads first, since only
/// some backends accept fewer key/value heads.
///
/// # Shapes
///
/// - query: `[batch, n_heads, seq_q, head_dim]`
/// - key, value: `[batch, n_kv_heads, seq_k, head_dim]`
/// - output: `[batch, n_heads, seq_q, head_dim]`
pub(crate) fn fused_attention(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    masks: ScoreMasks,
    options: SoftmaxOptions,
) -> Tensor<4> {
    let n_heads = query.dims()[1];
    let key = repeat_kv_heads(key, n_heads);
    let value = repeat_kv_heads(value, n_heads);
    let [batch, _, seq_q, _] = query.dims();
    let seq_k = key.dims()[2];
    let full = [batch, n_heads, seq_q, seq_k];
    attention(
        query,
        key,
        value,
        masks.forbid.map(|mask| mask.expand(full)),
        masks.bias.map(|bias| bias.expand(full)),
        AttentionModuleOptions {
            scale: (!options.default_scale).then_some(options.scale),
            softcap: None,
            is_causal: masks.causal,
        },
    )
}

/// `[batch, n_kv_heads, seq, d]` → `[batch, n_heads, seq, d]`, query head `i` reading key/value
/// head `i / (n_heads / n_kv_heads)` (PyTorch's `repeat_interleave` for GQA).
pub(crate) fn repeat_kv_heads(tensor: Tensor<4>, n_heads: usize) -> Tensor<4> {
    let [batch, n_kv_heads, seq, dim] = tensor.dims();
    if n_kv_heads == n_heads {
        return tensor;
    }
    let groups = n_heads / n_kv_heads;
    tensor
        .unsqueeze_dim::<5>(2)
        .expand([batch, n_kv_heads, groups, seq, dim])
        .reshape([batch, n_heads, seq, dim])
}

/// The attention probabilities `[batch, n_heads, seq_q, seq_k]` (before dropout).
///
/// Query heads are grouped onto their key/value head by a reshape, so GQA needs no copy of the
/// keys. A row whose keys are all forbidden is all zeros, with zero (not NaN) gradients.
pub(crate) fn attention_probabilities(
    query: Tensor<4>,
    key: Tensor<4>,
    masks: &ScoreMasks,
    options: SoftmaxOptions,
) -> Tensor<4> {
    let [batch, n_heads, seq_q, head_dim] = query.dims();
    let [_, n_kv_heads, seq_k, _] = key.dims();
    let groups = n_heads / n_kv_heads;
    let grouped_query =
        query
            .mul_scalar(options.scale)
            .reshape([batch, n_kv_heads, groups * seq_q, head_dim]);
    let scores_shape = [batch, n_heads, seq_q, seq_k];
    let mut scores = grouped_query
        .matmul(key.swap_dims(2, 3))
        .reshape(scores_shape);
    let causal = masks
        .causal
        .then(|| causal_mask(seq_q, seq_k, &scores.device()).reshape([1, 1, seq_q, seq_k]));
    let forbid = match (masks.forbid.clone(), causal) {
        (Some(forbid), Some(causal)) => Some(forbid.bool_or(causal)),
        (forbid, causal) => forbid.or(causal),
    };
    if options.quiet || masks.bias.is_some() {
        // A float bias may hold `-inf` anywhere, so only the row-checking softmax is safe.
        if let Some(bias) = &masks.bias {
            scores = scores + bias.clone().expand(scores_shape);
        }
        if let Some(forbid) = forbid {
            scores = scores.mask_fill(forbid.expand(scores_shape), f32::NEG_INFINITY);
        }
        return if options.quiet {
            quiet_softmax_last_dim(scores)
        } else {
            safe_softmax_last_dim(scores)
        };
    }
    match forbid {
        None => softmax(scores, 3),
        Some(forbid) => {
            // Burn's one-op softmax (fused on flex) is several times faster than the row-checking
            // one, but turns a row of `-inf` into NaN. Forbidden scores get the lowest finite
            // value instead (still exactly 0 after the exponential next to any allowed key),
            // and the rows with no allowed key, known from the mask alone, are zeroed.
            let any_allowed = forbid.clone().bool_not().any_dim(3).float();
            let scores = scores.mask_fill(forbid.expand(scores_shape), f32::MIN);
            softmax(scores, 3) * any_allowed
        }
    }
}

/// Softmax over the last axis that returns zeros for a row of `-inf`.
///
/// The row maximum is detached (the shift does not change the value, so its gradient is zero
/// anyway) and clamped to a finite number, so an all-`-inf` row gives `exp(-inf) = 0` rather
/// than `-inf - -inf = NaN`. The denominator of such a row is 0, and 1 is added to it there
/// only, which leaves every other row exact and every gradient finite.
fn safe_softmax_last_dim(scores: Tensor<4>) -> Tensor<4> {
    let max = scores.clone().detach().max_dim(3).clamp_min(f32::MIN);
    let exp = (scores - max).exp();
    let sum = exp.clone().sum_dim(3);
    let empty_row = sum.clone().equal_elem(0.0).float();
    exp / (sum + empty_row)
}

/// `exp(x_i) / (1 + Σ_j exp(x_j))`, shifted by `max(0, max_j x_j)` for stability; an all-`-inf`
/// row gives zeros.
fn quiet_softmax_last_dim(scores: Tensor<4>) -> Tensor<4> {
    let shift = scores.clone().detach().max_dim(3).clamp_min(0.0);
    let exp = (scores - shift.clone()).exp();
    let denominator = exp.clone().sum_dim(3) + shift.neg().exp();
    exp / denominator
}

/// The explicit path: probabilities, dropout, weighted sum of the values.
///
/// Returns the per-head context `[batch, n_heads, seq_q, head_dim]` and the weights
/// `[batch, n_heads, seq_q, seq_k]` after dropout.
pub(crate) fn explicit_attention(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    masks: &ScoreMasks,
    options: SoftmaxOptions,
    dropout: &Dropout,
) -> (Tensor<4>, Tensor<4>) {
    let [batch, n_heads, seq_q, _] = query.dims();
    let [_, n_kv_heads, seq_k, value_dim] = value.dims();
    let groups = n_heads / n_kv_heads;
    let weights = dropout.forward(attention_probabilities(query, key, masks, options));
    let context = weights
        .clone()
        .reshape([batch, n_kv_heads, groups * seq_q, seq_k])
        .matmul(value)
        .reshape([batch, n_heads, seq_q, value_dim]);
    (context, weights)
}

/// Query and key block sizes of the chunked path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkSizes {
    /// Queries per block.
    pub query: usize,
    /// Keys per block.
    pub key: usize,
}

impl Default for ChunkSizes {
    fn default() -> Self {
        Self {
            query: 512,
            key: 1024,
        }
    }
}

/// `tensor` restricted to `range` along `axis`, unless that axis has size 1 (broadcast).
fn narrow_broadcast<const D: usize, K: burn::tensor::kind::Basic>(
    tensor: &Tensor<D, K>,
    axis: usize,
    start: usize,
    length: usize,
) -> Tensor<D, K> {
    if tensor.dims()[axis] == 1 {
        tensor.clone()
    } else {
        tensor.clone().narrow(axis, start, length)
    }
}

/// Attention by query blocks × key blocks with an online softmax (running maximum and sum, as
/// FlashAttention and Rabe & Staats, "Self-attention does not need O(n²) memory"): at no time
/// is more than one `[batch, n_heads, query block, key block]` score block held, instead of the
/// full `[batch, n_heads, seq_q, seq_k]` matrix.
///
/// Exact up to summation order; a query whose keys are all forbidden outputs zero. Key blocks
/// entirely in a query block's causal future are skipped. Under autodiff, every block's
/// intermediates are kept for the backward pass, so this bounds inference memory only.
pub(crate) fn chunked_attention(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    masks: &ScoreMasks,
    options: SoftmaxOptions,
    chunks: ChunkSizes,
) -> Tensor<4> {
    let [batch, n_heads, seq_q, head_dim] = query.dims();
    let [_, n_kv_heads, seq_k, value_dim] = value.dims();
    let groups = n_heads / n_kv_heads;
    let device = query.device();
    let query = query.mul_scalar(options.scale);
    let causal_offset = seq_k as i64 - seq_q as i64;
    let mut outputs = Vec::new();
    for q_start in (0..seq_q).step_by(chunks.query.max(1)) {
        let q_len = chunks.query.min(seq_q - q_start);
        let block_query = query.clone().narrow(2, q_start, q_len).reshape([
            batch,
            n_kv_heads,
            groups * q_len,
            head_dim,
        ]);
        let block_shape = |k_len| [batch, n_heads, q_len, k_len];
        let mut running_max =
            Tensor::<4>::full([batch, n_heads, q_len, 1], f32::NEG_INFINITY, &device);
        let mut running_sum = Tensor::<4>::zeros([batch, n_heads, q_len, 1], &device);
        let mut accumulator = Tensor::<4>::zeros([batch, n_heads, q_len, value_dim], &device);
        for k_start in (0..seq_k).step_by(chunks.key.max(1)) {
            let k_len = chunks.key.min(seq_k - k_start);
            // The last query of the block sees keys up to q_start + q_len - 1 + offset.
            if masks.causal && k_start as i64 > q_start as i64 + q_len as i64 - 1 + causal_offset {
                break;
            }
            let block_key = key.clone().narrow(2, k_start, k_len);
            let mut scores = block_query
                .clone()
                .matmul(block_key.swap_dims(2, 3))
                .reshape(block_shape(k_len));
            if let Some(bias) = &masks.bias {
                let bias = narrow_broadcast(
                    &narrow_broadcast(bias, 2, q_start, q_len),
                    3,
                    k_start,
                    k_len,
                );
                scores = scores + bias.expand(block_shape(k_len));
            }
            if let Some(forbid) = &masks.forbid {
                let forbid = narrow_broadcast(
                    &narrow_broadcast(forbid, 2, q_start, q_len),
                    3,
                    k_start,
                    k_len,
                );
                scores = scores.mask_fill(forbid.expand(block_shape(k_len)), f32::NEG_INFINITY);
            }
            if masks.causal {
                let offset = q_start as i64 - k_start as i64 + causal_offset;
                let future = Tensor::<2, Bool>::tril_mask([q_len, k_len], offset, &device)
                    .reshape([1, 1, q_len, k_len])
                    .expand(block_shape(k_len));
                scores = scores.mask_fill(future, f32::NEG_INFINITY);
            }
            let block_max = scores.clone().max_dim(3);
            let new_max = running_max.clone().max_pair(block_max).clamp_min(f32::MIN);
            let correction = (running_max - new_max.clone()).exp();
            let probabilities = (scores - new_max.clone()).exp();
            running_sum = running_sum * correction.clone() + probabilities.clone().sum_dim(3);
            let block_value = value.clone().narrow(2, k_start, k_len);
            let contribution = probabilities
                .reshape([batch, n_kv_heads, groups * q_len, k_len])
                .matmul(block_value)
                .reshape([batch, n_heads, q_len, value_dim]);
            accumulator = accumulator * correction + contribution;
            running_max = new_max;
        }
        let empty_row = running_sum.clone().equal_elem(0.0).float();
        outputs.push(accumulator / (running_sum + empty_row));
    }
    Tensor::cat(outputs, 2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, Distribution, Tolerance};

    fn options() -> SoftmaxOptions {
        SoftmaxOptions {
            scale: 0.5,
            default_scale: true,
            quiet: false,
        }
    }

    #[test]
    fn grouped_probabilities_equal_repeated_heads() {
        let device = Device::flex();
        device.seed(1);
        let query = Tensor::<4>::random([2, 4, 3, 4], Distribution::Normal(0.0, 1.0), &device);
        let key = Tensor::<4>::random([2, 2, 5, 4], Distribution::Normal(0.0, 1.0), &device);
        let masks = ScoreMasks::default();
        let grouped = attention_probabilities(query.clone(), key.clone(), &masks, options());
        let repeated = attention_probabilities(query, repeat_kv_heads(key, 4), &masks, options());
        grouped
            .into_data()
            .assert_approx_eq::<f32>(&repeated.into_data(), Tolerance::absolute(1e-6));
    }

    #[test]
    fn all_masked_rows_are_zero_and_others_sum_to_one() {
        let device = Device::flex();
        let scores = Tensor::<4>::from_data(
            [[[
                [f32::NEG_INFINITY, f32::NEG_INFINITY],
                [0.0, f32::NEG_INFINITY],
                [1.0, 2.0],
            ]]],
            &device,
        );
        let probabilities = safe_softmax_last_dim(scores).into_data();
        let e = 1.0f32.exp();
        let expected = [[[
            [0.0, 0.0],
            [1.0, 0.0],
            [e / (e + e * e), e * e / (e + e * e)],
        ]]];
        probabilities.assert_approx_eq::<f32>(&expected.into(), Tolerance::absolute(1e-6));
    }

    #[test]
    fn quiet_softmax_leaves_room_for_attending_to_nothing() {
        let device = Device::flex();
        let scores = Tensor::<4>::from_data(
            [[[
                [0.0, 0.0],
                [f32::NEG_INFINITY, f32::NEG_INFINITY],
                [30.0, 30.0],
            ]]],
            &device,
        );
        let probabilities = quiet_softmax_last_dim(scores).into_data();
        let expected = [[[[1.0 / 3.0, 1.0 / 3.0], [0.0, 0.0], [0.5, 0.5]]]];
        probabilities.assert_approx_eq::<f32>(&expected.into(), Tolerance::absolute(1e-6));
    }
}
