//! From burn-nn: a `burn::nn::attention::MultiHeadAttention`, or a burn-nn Transformer encoder
//! or decoder, as this crate's module with the same weights, so that a trained model gets this
//! crate's kernels without retraining.
//!
//! ```
//! use burn::nn::attention::MultiHeadAttentionConfig as BurnMhaConfig;
//! use burn::tensor::{Device, Distribution, Tensor};
//! use mha::MhaInput;
//!
//! let device = Device::flex();
//! let theirs = BurnMhaConfig::new(32, 4).with_dropout(0.0).init(&device);
//! let ours = mha::MultiHeadAttention::from(theirs.clone());
//! let x = Tensor::<3>::random([2, 5, 32], Distribution::Normal(0.0, 1.0), &device);
//! let expected = theirs.forward(burn::nn::attention::MhaInput::self_attn(x.clone())).context;
//! let actual = ours.forward(MhaInput::self_attn(x)).context;
//! assert!((actual - expected).abs().max().into_scalar::<f32>() < 1e-5);
//! ```
//!
//! What carries over: the four projections, the head count, dropout, the quiet softmax. The
//! scale is burn-nn's `1/sqrt(d_k)` either way. One behaviour differs: burn-nn fills masked
//! scores with a large negative number, so a query whose every key is masked gets uniform
//! weights over them; here it gets zero weights and a zero attention output (before the output
//! projection's bias).

use burn::nn::attention::MultiHeadAttention as BurnMultiHeadAttention;
use burn::nn::transformer::{
    TransformerDecoder as BurnTransformerDecoder,
    TransformerDecoderLayer as BurnTransformerDecoderLayer,
    TransformerEncoder as BurnTransformerEncoder,
    TransformerEncoderLayer as BurnTransformerEncoderLayer,
};

use crate::transformer::{
    TransformerDecoder, TransformerDecoderLayer, TransformerEncoder, TransformerEncoderLayer,
};
use crate::{MultiHeadAttention, MultiHeadAttentionConfig};

impl From<BurnMultiHeadAttention> for MultiHeadAttention {
    /// The same attention: burn-nn's projections, head count, dropout and quiet softmax, on the
    /// device of its weights.
    fn from(burn: BurnMultiHeadAttention) -> Self {
        let device = burn.query.weight.device();
        let mut module = MultiHeadAttentionConfig::new(burn.d_model, burn.n_heads)
            .with_dropout(burn.dropout.prob)
            .with_quiet_softmax(burn.quiet_softmax)
            .init(&device);
        module.query = burn.query;
        module.key = burn.key;
        module.value = burn.value;
        module.output = burn.output;
        module
    }
}

impl From<BurnTransformerEncoderLayer> for TransformerEncoderLayer {
    /// The same layer. burn-nn names its norms by position, whose roles swap with
    /// `norm_first`: pre-norm applies `norm_2` before the attention and `norm_1` before the
    /// feed-forward network; post-norm applies `norm_1` after the attention and `norm_2` after
    /// the feed-forward network.
    fn from(burn: BurnTransformerEncoderLayer) -> Self {
        let (attention_norm, feed_forward_norm) = if burn.norm_first {
            (burn.norm_2, burn.norm_1)
        } else {
            (burn.norm_1, burn.norm_2)
        };
        Self {
            attention: burn.mha.into(),
            feed_forward: burn.pwff,
            attention_norm,
            feed_forward_norm,
            dropout: burn.dropout,
            norm_first: burn.norm_first,
            causal: false,
        }
    }
}

impl From<BurnTransformerEncoder> for TransformerEncoder {
    /// The same stack, layer by layer. burn-nn's encoder has no causal flag (a causal model
    /// passes a mask): make the layers causal with
    /// [`TransformerEncoder::with_causal`] to drop it.
    fn from(burn: BurnTransformerEncoder) -> Self {
        Self {
            layers: burn.layers.into_iter().map(Into::into).collect(),
        }
    }
}

impl From<BurnTransformerDecoderLayer> for TransformerDecoderLayer {
    /// The same layer, causal: burn-nn's decoder applies `norm_3`, `norm_1`, `norm_2` before
    /// self-attention, cross-attention and feed-forward with `norm_first`, and `norm_1`,
    /// `norm_2`, `norm_3` after them otherwise.
    fn from(burn: BurnTransformerDecoderLayer) -> Self {
        let (self_norm, cross_norm, feed_forward_norm) = if burn.norm_first {
            (burn.norm_3, burn.norm_1, burn.norm_2)
        } else {
            (burn.norm_1, burn.norm_2, burn.norm_3)
        };
        Self {
            self_attention: burn.self_attn.into(),
            cross_attention: burn.cross_attn.into(),
            feed_forward: burn.pwff,
            self_attention_norm: self_norm,
            cross_attention_norm: cross_norm,
            feed_forward_norm,
            dropout: burn.dropout,
            norm_first: burn.norm_first,
            causal: true,
        }
    }
}

impl From<BurnTransformerDecoder> for TransformerDecoder {
    /// The same stack, layer by layer, with causal self-attention (burn-nn's decoder is used
    /// with an autoregressive `target_mask_attn`, which the causal flag replaces; pass
    /// [`TransformerDecoder::with_causal`]`(false)` to keep your own).
    fn from(burn: BurnTransformerDecoder) -> Self {
        Self {
            layers: burn.layers.into_iter().map(Into::into).collect(),
        }
    }
}
