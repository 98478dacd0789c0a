//! Transformer layers built on [`MultiHeadAttention`](crate::MultiHeadAttention): an encoder
//! (a stack of self-attention + feed-forward layers, causal for a decoder-only model) and a
//! decoder (self-attention, cross-attention over a memory, feed-forward), pre- or post-norm.
//!
//! The configurations use the names and defaults of burn-nn's `TransformerEncoderConfig` and
//! `TransformerDecoderConfig` (`d_model`, `d_ff`, `n_heads`, `n_layers`, `dropout`,
//! `norm_first`, `quiet_softmax`, `initializer`, `activation`, `layer_norm_eps`), so that a
//! model written for burn-nn changes one import; they add this crate's attention options
//! (`n_kv_heads`, `rope`, `alibi`, `window`, `causal`). A burn-nn model converts with its
//! weights ([`crate::burn_nn`]). Both stacks decode with KV caches through every layer, and
//! both serve many sequences at once: the causal encoder (a decoder-only model) through a
//! [`PagedTransformerCache`], the decoder, each sequence over its own memory, through a
//! [`PagedTransformerDecoderCache`].

mod decoder;
mod encoder;
mod paged;
mod paged_decoder;

pub use decoder::{
    TransformerDecoder, TransformerDecoderCache, TransformerDecoderConfig, TransformerDecoderInput,
    TransformerDecoderLayer,
};
pub use encoder::{
    TransformerEncoder, TransformerEncoderCache, TransformerEncoderConfig, TransformerEncoderInput,
    TransformerEncoderLayer,
};
pub use paged::PagedTransformerCache;
pub use paged_decoder::PagedTransformerDecoderCache;

use burn::nn::activation::Activation;
use burn::nn::transformer::PositionWiseFeedForward;
use burn::nn::{Dropout, LayerNorm, Linear};
use burn::tensor::Tensor;

use crate::cpu::{GeluKind, native_gelu, native_linear};

/// Burn's default initializer for its Transformer modules (Kaiming-uniform with gain
/// `1/sqrt(3)`), as a config default expression.
pub(crate) const BURN_TRANSFORMER_INITIALIZER: f64 = 0.577_350_269_189_625_8;

/// One sub-layer with its residual connection and layer norm: `x + dropout(f(norm(x)))` when
/// `norm_first` (pre-norm), `norm(x + dropout(f(x)))` otherwise (post-norm, the original
/// Transformer's and burn-nn's default).
fn residual(
    x: Tensor<3>,
    norm: &LayerNorm,
    dropout: &Dropout,
    norm_first: bool,
    sublayer: impl FnOnce(Tensor<3>) -> Tensor<3>,
) -> Tensor<3> {
    if norm_first {
        x.clone() + dropout.forward(sublayer(norm.forward(x)))
    } else {
        norm.forward(x.clone() + dropout.forward(sublayer(x)))
    }
}

/// [`PositionWiseFeedForward::forward`] with its two projections through this crate's
/// projection op and its GELU (exact or tanh-approximated) through the vectorised one where
/// they run (an f32 input on
/// flex or ndarray, with or without autodiff: the bias written into the output rows and the
/// product accumulated onto it, no zeroed-then-copied outputs, native backwards), else
/// `Linear::forward` and Burn's activation: the same values either way (the GELU to within a
/// few ulp).
fn feed_forward(feed_forward: &PositionWiseFeedForward, x: Tensor<3>) -> Tensor<3> {
    let project = |linear: &Linear, x: Tensor<3>| {
        native_linear(linear, &x).unwrap_or_else(|| linear.forward(x))
    };
    let x = project(&feed_forward.linear_inner, x);
    let x = match &feed_forward.activation {
        Activation::Gelu(gelu) => {
            let kind = if gelu.approximate {
                GeluKind::Tanh
            } else {
                GeluKind::Exact
            };
            native_gelu(&x, kind).unwrap_or_else(|| feed_forward.activation.forward(x))
        }
        activation => activation.forward(x),
    };
    let x = feed_forward.dropout.forward(x);
    project(&feed_forward.linear_outer, x)
}

#[cfg(test)]
mod tests {
    use burn::module::Module;
    use burn::nn::activation::ActivationConfig;
    use burn::nn::transformer::PositionWiseFeedForwardConfig;
    use burn::tensor::{Device, Distribution, Tolerance};

    use super::*;

    /// The feed-forward through the projection op and the native GELU (exact, tanh; ReLU
    /// through Burn's) gives burn-nn's values and gradients (input and both weights) on flex,
    /// with and without autodiff; on ndarray it is held to burn-nn's on flex (Burn's ndarray
    /// GELU gradient is off by up to 1e-3).
    #[test]
    fn the_feed_forward_equals_burn_nns() {
        let flex = Device::flex().autodiff();
        // ndarray is deprecated in Burn 0.22 but still one of the two native backends.
        #[allow(deprecated)]
        let devices = [Device::flex(), Device::ndarray()];
        let activations = [
            ActivationConfig::Gelu,
            ActivationConfig::GeluApproximate,
            ActivationConfig::Relu,
        ];
        for (device, activation) in devices.into_iter().flat_map(|device| {
            activations
                .clone()
                .map(move |activation| (device.clone(), activation))
        }) {
            let device = device.autodiff();
            let module = PositionWiseFeedForwardConfig::new(16, 48)
                .with_dropout(0.0)
                .with_activation(activation)
                .init(&device);
            let reference = module.clone().fork(&flex);
            let x = Tensor::<3>::random([2, 5, 16], Distribution::Default, &device);
            let on_flex = |x: &Tensor<3>| Tensor::<3>::from_data(x.to_data(), &flex);
            let ours = feed_forward(&module.valid(), x.clone().inner());
            let burns = reference.valid().forward(on_flex(&x).inner());
            ours.into_data()
                .assert_approx_eq::<f32>(&burns.into_data(), Tolerance::absolute(1e-5));
            let gradients = |module: &PositionWiseFeedForward,
                             x: Tensor<3>,
                             forward: &dyn Fn(Tensor<3>) -> Tensor<3>| {
                let x = x.require_grad();
                let grads = (forward(x.clone()).powi_scalar(2)).sum().backward();
                let weight_grad = |linear: &Linear| {
                    linear
                        .weight
                        .grad(&grads)
                        .expect("tracked")
                        .unsqueeze::<3>()
                };
                [
                    x.grad(&grads).expect("x is tracked"),
                    weight_grad(&module.linear_inner),
                    weight_grad(&module.linear_outer),
                ]
            };
            let ours = gradients(&module, x.clone(), &|x| feed_forward(&module, x));
            let burns = gradients(&reference, on_flex(&x), &|x| reference.forward(x));
            for (ours, burns) in ours.into_iter().zip(burns) {
                ours.into_data()
                    .assert_approx_eq::<f32>(&burns.into_data(), Tolerance::absolute(1e-5));
            }
        }
    }
}
