//! Transformer layers built on [`MultiHeadAttention`](crate::MultiHeadAttention): an encoder
//! (a stack of self-attention + feed-forward layers, causal for a decoder-only model) and a
//! decoder (self-attention, cross-attention over a memory, feed-forward), pre- or post-norm.
//!
//! The configurations use the names and defaults of burn-nn's `TransformerEncoderConfig` and
//! `TransformerDecoderConfig` (`d_model`, `d_ff`, `n_heads`, `n_layers`, `dropout`,
//! `norm_first`, `quiet_softmax`, `initializer`, `activation`, `layer_norm_eps`), so that a
//! model written for burn-nn changes one import; they add this crate's attention options
//! (`n_kv_heads`, `rope`, `alibi`, `window`, `causal`). A burn-nn model converts with its
//! weights ([`crate::burn_nn`]). Both stacks decode with KV caches through every layer; the
//! causal encoder (a decoder-only model) also serves many sequences at once through a
//! [`PagedTransformerCache`].

mod decoder;
mod encoder;
mod paged;

pub use decoder::{
    TransformerDecoder, TransformerDecoderCache, TransformerDecoderConfig, TransformerDecoderInput,
    TransformerDecoderLayer,
};
pub use encoder::{
    TransformerEncoder, TransformerEncoderCache, TransformerEncoderConfig, TransformerEncoderInput,
    TransformerEncoderLayer,
};
pub use paged::PagedTransformerCache;

use burn::nn::{Dropout, LayerNorm};
use burn::tensor::Tensor;

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
