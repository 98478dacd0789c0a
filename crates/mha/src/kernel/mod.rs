//! The attention core in ordinary tensor operations, `softmax(q kᵀ · scale + bias) v` on split
//! heads: the explicit path (the reference, and the only one that applies dropout or returns
//! weights that carry a gradient), Burn's fused op, and the chunked online-softmax path. The
//! flash op, with its own backward (and the weights for inference), is `crate::flash`.

mod chunked;
mod explicit;
mod fused;

use burn::tensor::{DType, Tensor};

pub(crate) use chunked::chunked_attention;
pub(crate) use explicit::{explicit_attention, soft_cap};
pub(crate) use fused::fused_attention;

/// How the scores are turned into probabilities.
#[derive(Debug, Clone)]
pub(crate) struct SoftmaxOptions {
    pub scale: f64,
    /// `scale` was given by the caller rather than being `1/sqrt(head_dim)`. The fused op is
    /// told only a custom scale, which keeps CubeCL backends on their flash kernel (they fall
    /// back on any scale).
    pub custom_scale: bool,
    /// Scores become `softcap · tanh(score / softcap)` after scaling, before masks and biases.
    pub softcap: Option<f64>,
    /// One more logit per query head in every softmax's denominator, `[n_heads]`: learned
    /// attention sinks, or zeros for the quiet softmax.
    pub sinks: Option<Tensor<1>>,
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

/// The most negative finite value of a float type: what stands for "forbidden" where `-inf`
/// would turn a row with no allowed key into NaN. (`f32::MIN` itself rounds to `-inf` in f16
/// and bf16.)
pub(crate) fn lowest_finite(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => -65504.0,
        DType::BF16 => -3.389_531_4e38,
        _ => f32::MIN,
    }
}
