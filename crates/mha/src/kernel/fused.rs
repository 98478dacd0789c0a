//! Burn's fused attention op, `burn::tensor::module::attention`.

use burn::tensor::Tensor;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;

use super::{SoftmaxOptions, repeat_kv_heads};
use crate::mask::ScoreMasks;

/// Burn's fused attention. Key/value heads are repeated to the query heads first, since only
/// some backends accept fewer.
///
/// # Shapes
///
/// - query: `[batch, n_heads, seq_q, head_dim]`
/// - key, value: `[batch, n_kv_heads, seq_k, head_dim]`
/// - output: `[batch, n_heads, seq_q, head_dim]`
///
/// # Panics
///
/// With attention sinks, which Burn's op has no place for (the kernel choice never sends them
/// here).
pub(crate) fn fused_attention(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    masks: &ScoreMasks,
    options: &SoftmaxOptions,
) -> Tensor<4> {
    assert!(
        options.sinks.is_none(),
        "Burn's fused attention has no sinks"
    );
    let n_heads = query.dims()[1];
    let key = repeat_kv_heads(key, n_heads);
    let value = repeat_kv_heads(value, n_heads);
    let [batch, _, seq_q, _] = query.dims();
    let seq_k = key.dims()[2];
    let full = [batch, n_heads, seq_q, seq_k];
    // Plain causal masking goes as the op's flag (no mask tensor, and CubeCL backends keep their
    // flash kernel); any other rule is materialised.
    let is_causal = masks.rules.is_plain_causal(seq_q, seq_k);
    let device = query.device();
    let (forbid, bias) = if is_causal {
        let without_causal = ScoreMasks {
            rules: crate::rules::ScoreRules {
                causal: false,
                ..masks.rules.clone()
            },
            ..masks.clone()
        };
        without_causal.block(
            [batch, n_heads],
            0..seq_q,
            0..seq_k,
            (&device, query.dtype()),
        )
    } else {
        masks.block(
            [batch, n_heads],
            0..seq_q,
            0..seq_k,
            (&device, query.dtype()),
        )
    };
    // Burn's fused kernels (flex's, burn-flex 0.22.1 `ops/attention.rs`) take a row whose scores
    // are all NaN for a fully masked one and return zeros; `+ 0 · Σ q` carries a query's NaN
    // into its output row, as every other path does, and adds exactly 0 otherwise.
    let nan_carrier = query.clone().sum_dim(3).mul_scalar(0.0);
    let output = attention(
        query,
        key,
        value,
        forbid.map(|mask| mask.expand(full)),
        bias.map(|bias| bias.expand(full)),
        AttentionModuleOptions {
            scale: options.custom_scale.then_some(options.scale),
            softcap: options.softcap,
            is_causal,
        },
    );
    output + nan_carrier
}
