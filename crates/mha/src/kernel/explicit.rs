//! The explicit path: scores, softmax and the weighted sum as separate tensor operations, with
//! the weights in hand for the caller, dropout and the quiet softmax.

use burn::nn::Dropout;
use burn::tensor::Tensor;
use burn::tensor::activation::softmax;

use super::{SoftmaxOptions, lowest_finite};
use crate::mask::{ScoreMasks, causal_mask};

/// The attention probabilities `[batch, n_heads, seq_q, seq_k]` (before dropout).
///
/// Query heads are grouped onto their key/value head by a reshape, so GQA needs no copy of the
/// keys. A row whose keys are all forbidden is all zeros, with zero (not NaN) gradients.
fn attention_probabilities(
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
            let any_allowed = forbid
                .clone()
                .bool_not()
                .any_dim(3)
                .float()
                .cast(scores.dtype());
            let lowest = lowest_finite(scores.dtype());
            let scores = scores.mask_fill(forbid.expand(scores_shape), lowest);
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
    let lowest = lowest_finite(scores.dtype());
    let max = scores.clone().detach().max_dim(3).clamp_min(lowest);
    let exp = (scores - max).exp();
    let sum = exp.clone().sum_dim(3);
    let empty_row = sum.clone().equal_elem(0.0).float().cast(sum.dtype());
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::repeat_kv_heads;
    use burn::tensor::{Device, Distribution, Tolerance};

    fn options() -> SoftmaxOptions {
        SoftmaxOptions {
            scale: 0.5,
            custom_scale: true,
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
