//! The explicit path: scores, softmax and the weighted sum as separate tensor operations, with
//! the weights in hand for the caller and dropout; the reference every other path is held to.

use burn::nn::Dropout;
use burn::tensor::Tensor;
use burn::tensor::activation::softmax;

use super::{SoftmaxOptions, lowest_finite};
use crate::mask::ScoreMasks;

/// The attention probabilities `[batch, n_heads, seq_q, seq_k]` (before dropout).
///
/// Query heads are grouped onto their key/value head by a reshape, so GQA needs no copy of the
/// keys. A row whose keys are all forbidden is all zeros, with zero (not NaN) gradients.
fn attention_probabilities(
    query: Tensor<4>,
    key: Tensor<4>,
    masks: &ScoreMasks,
    options: &SoftmaxOptions,
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
    if let Some(cap) = options.softcap {
        scores = soft_cap(scores, cap);
    }
    let device = scores.device();
    let (forbid, bias) = masks.block(
        [batch, n_heads],
        0..seq_q,
        0..seq_k,
        (&device, scores.dtype()),
    );
    if options.sinks.is_some() || bias.is_some() {
        // A float bias may hold `-inf` anywhere, so only the row-checking softmax is safe.
        if let Some(bias) = bias {
            scores = scores + bias.expand(scores_shape);
        }
        if let Some(forbid) = forbid {
            scores = scores.mask_fill(forbid.expand(scores_shape), f32::NEG_INFINITY);
        }
        return match &options.sinks {
            Some(sinks) => softmax_with_sinks(scores, sinks.clone()),
            None => safe_softmax_last_dim(scores),
        };
    }
    match forbid {
        None => softmax(scores, 3),
        Some(forbid) => {
            // Burn's one-op softmax (fused on flex) is several times faster than the row-checking
            // one, but turns a row of `-inf` into NaN. Forbidden scores get the lowest finite
            // value instead (still exactly 0 after the exponential next to any allowed key),
            // and the rows with no allowed key, known from the mask alone, are zeroed.
            let forbid = forbid.expand(scores_shape);
            let any_allowed = forbid
                .clone()
                .bool_not()
                .any_dim(3)
                .float()
                .cast(scores.dtype());
            let lowest = lowest_finite(scores.dtype());
            let scores = scores.mask_fill(forbid, lowest);
            softmax(scores, 3) * any_allowed
        }
    }
}

/// `cap · tanh(scores / cap)`: logit soft-capping (Gemma 2).
pub(crate) fn soft_cap<const D: usize>(scores: Tensor<D>, cap: f64) -> Tensor<D> {
    scores.div_scalar(cap).tanh().mul_scalar(cap)
}

/// Softmax over the last axis that returns zeros for a row of `-inf`.
///
/// The row maximum is detached (the shift does not change the value, so its gradient is zero
/// anyway) and clamped to a finite number, so an all-`-inf` row gives `exp(-inf) = 0` rather
/// than `-inf - -inf = NaN`. The denominator of such a row is 0, and 1 is added to it there
/// only, which leaves every other row exact and every gradient finite.
fn safe_softmax_last_dim(scores: Tensor<4>) -> Tensor<4> {
    let lowest = lowest_finite(scores.dtype());
    let max = scores.clone().detach().max_dim(3).clamp_min(lowest);
    let exp = (scores - max).exp();
    let sum = exp.clone().sum_dim(3);
    let empty_row = sum.clone().equal_elem(0.0).float().cast(sum.dtype());
    exp / (sum + empty_row)
}

/// `exp(x_i) / (exp(s_h) + Σ_j exp(x_j))`: a softmax whose denominator holds one more logit
/// per head, `s_h` (`sinks`, `[n_heads]`), that takes weight but has no value: attention sinks
/// (gpt-oss), or the quiet softmax with `s = 0`. Shifted by the detached maximum of the row and
/// the sink; a row of `-inf` gives zeros.
fn softmax_with_sinks(scores: Tensor<4>, sinks: Tensor<1>) -> Tensor<4> {
    let [batch, heads, seq_q, _] = scores.dims();
    let sinks = sinks
        .cast(scores.dtype())
        .reshape([1, heads, 1, 1])
        .expand([batch, heads, seq_q, 1]);
    let max = scores
        .clone()
        .detach()
        .max_dim(3)
        .max_pair(sinks.clone().detach());
    let exp = (scores - max.clone()).exp();
    let denominator = exp.clone().sum_dim(3) + (sinks - max).exp();
    exp / denominator
}

/// The explicit path: probabilities, dropout, weighted sum of the values.
///
/// Returns the per-head context `[batch, n_heads, seq_q, head_dim]` and the weights
/// `[batch, n_heads, seq_q, seq_k]` after dropout.
///
/// # Shapes
///
/// - query: `[batch, n_heads, seq_q, head_dim]`
/// - key: `[batch, n_kv_heads, seq_k, head_dim]`
/// - value: `[batch, n_kv_heads, seq_k, value_dim]`
pub(crate) fn explicit_attention(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    masks: &ScoreMasks,
    options: &SoftmaxOptions,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::repeat_kv_heads;
    use burn::tensor::{Device, Distribution, Tolerance};

    fn options() -> SoftmaxOptions {
        SoftmaxOptions {
            scale: 0.5,
            custom_scale: true,
            softcap: None,
            sinks: None,
        }
    }

    #[test]
    fn grouped_probabilities_equal_repeated_heads() {
        let device = Device::flex();
        device.seed(1);
        let query = Tensor::<4>::random([2, 4, 3, 4], Distribution::Normal(0.0, 1.0), &device);
        let key = Tensor::<4>::random([2, 2, 5, 4], Distribution::Normal(0.0, 1.0), &device);
        let masks = ScoreMasks::none(5);
        let grouped = attention_probabilities(query.clone(), key.clone(), &masks, &options());
        let repeated = attention_probabilities(query, repeat_kv_heads(key, 4), &masks, &options());
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

    /// The quiet softmax is a sink of logit 0: `exp(x_i) / (1 + Σ_j exp(x_j))`.
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
        let probabilities = softmax_with_sinks(scores, Tensor::zeros([1], &device)).into_data();
        let expected = [[[[1.0 / 3.0, 1.0 / 3.0], [0.0, 0.0], [0.5, 0.5]]]];
        probabilities.assert_approx_eq::<f32>(&expected.into(), Tolerance::absolute(1e-6));
    }

    /// A sink logit takes its share of every row: with sink `s`, `p_i = exp(x_i) / (exp(s) +
    /// Σ exp(x_j))`, per head.
    #[test]
    fn sinks_take_their_share_per_head() {
        let device = Device::flex();
        let scores = Tensor::<4>::from_data([[[[0.0, 1.0]], [[2.0, 2.0]]]], &device);
        let sinks = Tensor::<1>::from_data([1.0, f32::NEG_INFINITY], &device);
        let probabilities = softmax_with_sinks(scores, sinks).into_data();
        let e = 1.0f32.exp();
        let expected = [[[[1.0 / (e + 1.0 + e), e / (e + 1.0 + e)]], [[0.5, 0.5]]]];
        probabilities.assert_approx_eq::<f32>(&expected.into(), Tolerance::absolute(1e-6));
    }
}
