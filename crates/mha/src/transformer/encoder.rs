//! [`TransformerEncoder`]: self-attention + feed-forward layers.

use burn::config::Config;
use burn::module::Module;
use burn::nn::activation::ActivationConfig;
use burn::nn::transformer::{PositionWiseFeedForward, PositionWiseFeedForwardConfig};
use burn::nn::{Dropout, DropoutConfig, Initializer, LayerNorm, LayerNormConfig};
use burn::tensor::{Bool, Device, Int, Tensor};

use super::{BURN_TRANSFORMER_INITIALIZER, feed_forward, residual};
use crate::{
    AttentionInitializer, AttnMask, CacheError, IntoAttnMask, KvCache, MhaInput,
    MultiHeadAttention, MultiHeadAttentionConfig, RopeConfig,
};

/// Configuration of a [`TransformerEncoder`]: burn-nn's `TransformerEncoderConfig` fields (same
/// names, same defaults) and this crate's attention options.
#[derive(Config, Debug)]
pub struct TransformerEncoderConfig {
    /// The width of the model.
    pub d_model: usize,
    /// The hidden width of the position-wise feed-forward network.
    pub d_ff: usize,
    /// Query heads of every self-attention.
    pub n_heads: usize,
    /// Layers in the stack.
    pub n_layers: usize,
    /// Dropout on the attention weights, inside the feed-forward network and on every
    /// sub-layer's output. Default: 0.1 (burn-nn's).
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Layer norm before each sub-layer (pre-norm) instead of after its residual (post-norm).
    /// Default: false (burn-nn's and PyTorch's).
    #[config(default = false)]
    pub norm_first: bool,
    /// The quiet softmax in every attention. Default: false.
    #[config(default = false)]
    pub quiet_softmax: bool,
    /// The initializer of every parameter. Default: burn-nn's Kaiming-uniform with gain
    /// `1/sqrt(3)`.
    #[config(
        default = "Initializer::KaimingUniform { gain: BURN_TRANSFORMER_INITIALIZER, fan_out_only: false }"
    )]
    pub initializer: Initializer,
    /// The feed-forward network's activation. Default: GELU.
    #[config(default = "ActivationConfig::Gelu")]
    pub activation: ActivationConfig,
    /// The layer norms' epsilon. Default: 1e-5.
    #[config(default = 1e-5)]
    pub layer_norm_eps: f64,
    /// Key/value heads (grouped-query attention). Default: `None`, one per query head.
    #[config(default = "None")]
    pub n_kv_heads: Option<usize>,
    /// Rotary position embeddings in every self-attention. Default: `None`.
    #[config(default = "None")]
    pub rope: Option<RopeConfig>,
    /// ALiBi in every self-attention. Default: false.
    #[config(default = false)]
    pub alibi: bool,
    /// Sliding-window self-attention ([`MultiHeadAttentionConfig::window`]). Default: `None`.
    #[config(default = "None")]
    pub window: Option<usize>,
    /// Causal self-attention in every layer (a decoder-only model); needed for
    /// [`TransformerEncoder::forward_cached`]. Default: false.
    #[config(default = false)]
    pub causal: bool,
}

impl TransformerEncoderConfig {
    /// The configuration of each layer's self-attention.
    pub fn attention(&self) -> MultiHeadAttentionConfig {
        MultiHeadAttentionConfig::new(self.d_model, self.n_heads)
            .with_n_kv_heads(self.n_kv_heads)
            .with_dropout(self.dropout)
            .with_quiet_softmax(self.quiet_softmax)
            .with_rope(self.rope.clone())
            .with_alibi(self.alibi)
            .with_window(self.window)
            .with_initializer(AttentionInitializer::Custom(self.initializer.clone()))
    }

    /// Initializes the stack on `device`.
    ///
    /// # Panics
    ///
    /// If the attention configuration is invalid ([`MultiHeadAttentionConfig::init`]).
    pub fn init(&self, device: &Device) -> TransformerEncoder {
        TransformerEncoder {
            layers: (0..self.n_layers)
                .map(|_| TransformerEncoderLayer::new(self, device))
                .collect(),
        }
    }
}

/// A stack of [`TransformerEncoderLayer`]s.
#[derive(Module, Debug)]
pub struct TransformerEncoder {
    /// The layers, first to last.
    pub layers: Vec<TransformerEncoderLayer>,
}

/// Self-attention then a position-wise feed-forward network, each with a residual connection,
/// dropout and a layer norm.
#[derive(Module, Debug)]
pub struct TransformerEncoderLayer {
    /// Self-attention.
    pub attention: MultiHeadAttention,
    /// The position-wise feed-forward network (burn-nn's module).
    pub feed_forward: PositionWiseFeedForward,
    /// The attention sub-layer's norm: before it with `norm_first`, after its residual
    /// otherwise.
    pub attention_norm: LayerNorm,
    /// The feed-forward sub-layer's norm, placed likewise.
    pub feed_forward_norm: LayerNorm,
    /// On each sub-layer's output.
    pub dropout: Dropout,
    /// Pre-norm (`true`) or post-norm.
    pub norm_first: bool,
    /// Causal self-attention.
    pub causal: bool,
}

/// The input of a [`TransformerEncoder`]: the sequence and its masks (burn-nn's
/// `TransformerEncoderInput`, with a float mask and packed segments besides).
#[derive(Debug, Clone)]
pub struct TransformerEncoderInput {
    tensor: Tensor<3>,
    mask_pad: Option<Tensor<2, Bool>>,
    mask_attn: Option<AttnMask>,
    segment_ids: Option<Tensor<2, Int>>,
}

impl TransformerEncoderInput {
    /// The sequence, `[batch, seq, d_model]`.
    pub fn new(tensor: Tensor<3>) -> Self {
        Self {
            tensor,
            mask_pad: None,
            mask_attn: None,
            segment_ids: None,
        }
    }

    /// Padding, `[batch, seq]`, `true` = ignore this position as a key.
    pub fn mask_pad(mut self, mask_pad: Tensor<2, Bool>) -> Self {
        self.mask_pad = Some(mask_pad);
        self
    }

    /// An attention mask as [`MhaInput::attn_mask`] takes it (bool `true` = may not attend, or
    /// float, added).
    pub fn mask_attn(mut self, mask_attn: impl IntoAttnMask) -> Self {
        self.mask_attn = Some(mask_attn.into_attn_mask());
        self
    }

    /// Packed sequences ([`MhaInput::segment_ids`]), `[batch, seq]`.
    pub fn segment_ids(mut self, ids: Tensor<2, Int>) -> Self {
        self.segment_ids = Some(ids);
        self
    }

    /// The self-attention input of a layer whose (normalised) input is `x`.
    fn attention_input(&self, x: Tensor<3>, causal: bool) -> MhaInput {
        let mut input = MhaInput::self_attn(x);
        if let Some(mask) = &self.mask_pad {
            input = input.key_padding_mask(mask.clone());
        }
        if let Some(mask) = &self.mask_attn {
            input = input.attn_mask(mask.clone());
        }
        if let Some(ids) = &self.segment_ids {
            input = input.segment_ids(ids.clone());
        }
        if causal {
            input = input.causal();
        }
        input
    }
}

/// One [`KvCache`] per layer of a causal [`TransformerEncoder`], for incremental decoding.
#[derive(Debug, Clone, Default)]
pub struct TransformerEncoderCache {
    /// Layer `i`'s self-attention cache.
    pub layers: Vec<KvCache>,
}

impl TransformerEncoderCache {
    /// Cuts every layer's cache back to its first `len` positions ([`KvCache::truncate`]):
    /// speculative decoding's rejected draft tokens through the stack, or a reply regenerated
    /// from some point.
    ///
    /// # Errors
    ///
    /// As [`KvCache::truncate`], from the first layer that refuses; no layer is then changed.
    pub fn truncate(&mut self, len: usize) -> Result<(), CacheError> {
        KvCache::truncate_all(&mut self.layers, len)
    }

    /// Keeps the batch elements `elements` of every layer's cache, in that order, each as many
    /// times as it is named ([`KvCache::select_batch`]): beam search's surviving beams, a
    /// finished sequence leaving the batch, one prompt repeated for several samples.
    ///
    /// # Panics
    ///
    /// As [`KvCache::select_batch`].
    pub fn select_batch(&mut self, elements: &[usize]) {
        for cache in &mut self.layers {
            cache.select_batch(elements);
        }
    }
}

impl TransformerEncoderLayer {
    /// A layer of `config`.
    pub fn new(config: &TransformerEncoderConfig, device: &Device) -> Self {
        let norm = || {
            LayerNormConfig::new(config.d_model)
                .with_epsilon(config.layer_norm_eps)
                .init(device)
        };
        Self {
            attention: config.attention().init(device),
            feed_forward: PositionWiseFeedForwardConfig::new(config.d_model, config.d_ff)
                .with_dropout(config.dropout)
                .with_initializer(config.initializer.clone())
                .with_activation(config.activation.clone())
                .init(device),
            attention_norm: norm(),
            feed_forward_norm: norm(),
            dropout: DropoutConfig::new(config.dropout).init(),
            norm_first: config.norm_first,
            causal: config.causal,
        }
    }

    /// The layer on `x` with `input`'s masks.
    ///
    /// # Shapes
    ///
    /// - x: `[batch, seq, d_model]`
    /// - output: `[batch, seq, d_model]`
    ///
    /// # Panics
    ///
    /// As [`MultiHeadAttention::forward`] on a wrong shape or mask.
    pub fn forward(&self, x: Tensor<3>, input: &TransformerEncoderInput) -> Tensor<3> {
        let x = residual(
            x,
            &self.attention_norm,
            &self.dropout,
            self.norm_first,
            |x| {
                self.attention
                    .forward(input.attention_input(x, self.causal))
                    .context
            },
        );
        self.feed_forward_sublayer(x)
    }

    pub(super) fn feed_forward_sublayer(&self, x: Tensor<3>) -> Tensor<3> {
        residual(
            x,
            &self.feed_forward_norm,
            &self.dropout,
            self.norm_first,
            |x| feed_forward(&self.feed_forward, x),
        )
    }

    /// [`forward`](Self::forward) for new positions `x`, their keys and values added to
    /// `cache` (causal masking under the cache).
    ///
    /// # Shapes
    ///
    /// - x: `[batch, new, d_model]`
    /// - output: `[batch, new, d_model]`
    ///
    /// # Panics
    ///
    /// As [`MultiHeadAttention::forward_cached`].
    pub fn forward_cached(
        &self,
        x: Tensor<3>,
        input: &TransformerEncoderInput,
        cache: &mut KvCache,
    ) -> Result<Tensor<3>, CacheError> {
        let mut result = Ok(());
        let x = residual(
            x,
            &self.attention_norm,
            &self.dropout,
            self.norm_first,
            |x| {
                let attended = self
                    .attention
                    .forward_cached(input.attention_input(x.clone(), true), cache);
                match attended {
                    Ok(output) => output.context,
                    Err(error) => {
                        result = Err(error);
                        x.zeros_like()
                    }
                }
            },
        );
        result.map(|()| self.feed_forward_sublayer(x))
    }
}

impl TransformerEncoder {
    /// The stack with causal self-attention in every layer, or none.
    pub fn with_causal(mut self, causal: bool) -> Self {
        self.layers
            .iter_mut()
            .for_each(|layer| layer.causal = causal);
        self
    }

    /// Every layer in turn.
    ///
    /// # Shapes
    ///
    /// - input: `[batch, seq, d_model]`, masks `[batch, seq]` (padding) and as
    ///   [`MhaInput::attn_mask`]
    /// - output: `[batch, seq, d_model]`
    ///
    /// # Panics
    ///
    /// As [`MultiHeadAttention::forward`] on a wrong shape or mask.
    pub fn forward(&self, input: TransformerEncoderInput) -> Tensor<3> {
        let x = input.tensor.clone();
        self.layers
            .iter()
            .fold(x, |x, layer| layer.forward(x, &input))
    }

    /// An empty cache for [`forward_cached`](Self::forward_cached), one [`KvCache`] per layer:
    /// a layer with a `window` keeps only the positions it still sees
    /// ([`CacheLimit::SlidingWindow`](crate::CacheLimit::SlidingWindow)), the others every
    /// position.
    pub fn new_cache(&self) -> TransformerEncoderCache {
        TransformerEncoderCache {
            layers: self
                .layers
                .iter()
                .map(|layer| layer.attention.new_cache())
                .collect(),
        }
    }

    /// Incremental decoding of a causal stack: `input` holds the new positions; each layer
    /// attends to its cached positions and the new ones, and caches the new ones. Feeding a
    /// sequence in any steps gives what [`forward`](Self::forward) gives for the whole of it.
    /// Every layer's cache holds the same positions, so a step is refused by the first layer
    /// or not at all, and a refused step leaves the cache as it was. A later layer's keys may
    /// exceed [`CacheStorage::Half`](crate::CacheStorage)'s range
    /// ([`CacheError::BeyondHalfRange`]) after the layers before it cached the step: those take
    /// it back. To do so, a windowed layer's cache holds its tensors from before a step until
    /// the next (shared, not copied).
    ///
    /// # Shapes
    ///
    /// - input: `[batch, new, d_model]`; masks cover the keys as in
    ///   [`MultiHeadAttention::forward_cached`] (the new positions, cached plus new ones, or
    ///   every position fed plus the new ones)
    /// - output: `[batch, new, d_model]`
    ///
    /// # Panics
    ///
    /// If the layers are not causal, or `cache` has another number of layers; as
    /// [`MultiHeadAttention::forward_cached`] on a wrong shape.
    pub fn forward_cached(
        &self,
        input: TransformerEncoderInput,
        cache: &mut TransformerEncoderCache,
    ) -> Result<Tensor<3>, CacheError> {
        assert!(
            self.layers.iter().all(|layer| layer.causal),
            "TransformerEncoder::forward_cached: decoding needs a causal stack \
             (TransformerEncoderConfig::causal)"
        );
        assert_eq!(
            cache.layers.len(),
            self.layers.len(),
            "TransformerEncoder::forward_cached: `cache` has {} layers, the stack {} (make it \
             with `new_cache`)",
            cache.layers.len(),
            self.layers.len()
        );
        cache.layers.iter_mut().for_each(KvCache::keep_undo);
        let mut x = input.tensor.clone();
        for (index, layer) in self.layers.iter().enumerate() {
            match layer.forward_cached(x, &input, &mut cache.layers[index]) {
                Ok(output) => x = output,
                Err(error) => {
                    // Only f16's range refusal comes from a later layer; the layers before it
                    // cached the step, and take it back to stay in step.
                    cache.layers[..index]
                        .iter_mut()
                        .for_each(KvCache::undo_last_step);
                    return Err(error);
                }
            }
        }
        Ok(x)
    }
}
