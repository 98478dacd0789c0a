//! [`TransformerDecoder`]: self-attention, cross-attention over a memory, feed-forward.

use burn::config::Config;
use burn::module::Module;
use burn::nn::activation::ActivationConfig;
use burn::nn::transformer::{PositionWiseFeedForward, PositionWiseFeedForwardConfig};
use burn::nn::{Dropout, DropoutConfig, Initializer, LayerNorm, LayerNormConfig};
use burn::tensor::{Bool, Device, Tensor};

use super::{BURN_TRANSFORMER_INITIALIZER, feed_forward, residual};
use crate::{
    AttentionInitializer, AttnMask, CacheError, CrossAttentionCache, IntoAttnMask, KvCache,
    MhaInput, MultiHeadAttention, MultiHeadAttentionConfig, NeedWeights, RopeConfig,
};

/// Configuration of a [`TransformerDecoder`]: burn-nn's `TransformerDecoderConfig` fields (same
/// names, same defaults) and this crate's attention options, which apply to the
/// self-attention (the cross-attention has no positions).
#[derive(Config, Debug)]
pub struct TransformerDecoderConfig {
    /// The width of the model (and of the memory).
    pub d_model: usize,
    /// The hidden width of the position-wise feed-forward network.
    pub d_ff: usize,
    /// Query heads of every attention.
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
    /// Key/value heads of every attention (grouped-query attention). Default: `None`, one per
    /// query head.
    #[config(default = "None")]
    pub n_kv_heads: Option<usize>,
    /// Rotary position embeddings in every self-attention. Default: `None`.
    #[config(default = "None")]
    pub rope: Option<RopeConfig>,
    /// ALiBi in every self-attention. Default: false.
    #[config(default = false)]
    pub alibi: bool,
    /// Sliding-window self-attention. Default: `None`.
    #[config(default = "None")]
    pub window: Option<usize>,
    /// Causal self-attention (each target position sees the ones up to itself). Default: true;
    /// burn-nn's decoder has no such flag and takes a `target_mask_attn` instead.
    #[config(default = true)]
    pub causal: bool,
}

impl TransformerDecoderConfig {
    /// The configuration of each layer's cross-attention.
    pub fn cross_attention(&self) -> MultiHeadAttentionConfig {
        MultiHeadAttentionConfig::new(self.d_model, self.n_heads)
            .with_n_kv_heads(self.n_kv_heads)
            .with_dropout(self.dropout)
            .with_quiet_softmax(self.quiet_softmax)
            .with_initializer(AttentionInitializer::Custom(self.initializer.clone()))
    }

    /// The configuration of each layer's self-attention.
    pub fn self_attention(&self) -> MultiHeadAttentionConfig {
        self.cross_attention()
            .with_rope(self.rope.clone())
            .with_alibi(self.alibi)
            .with_window(self.window)
    }

    /// Initializes the stack on `device`.
    ///
    /// # Panics
    ///
    /// If an attention configuration is invalid ([`MultiHeadAttentionConfig::init`]).
    pub fn init(&self, device: &Device) -> TransformerDecoder {
        TransformerDecoder {
            layers: (0..self.n_layers)
                .map(|_| TransformerDecoderLayer::new(self, device))
                .collect(),
        }
    }
}

/// A stack of [`TransformerDecoderLayer`]s.
#[derive(Module, Debug)]
pub struct TransformerDecoder {
    /// The layers, first to last.
    pub layers: Vec<TransformerDecoderLayer>,
}

/// Self-attention, cross-attention over the memory, then a position-wise feed-forward network,
/// each with a residual connection, dropout and a layer norm.
#[derive(Module, Debug)]
pub struct TransformerDecoderLayer {
    /// Self-attention over the target.
    pub self_attention: MultiHeadAttention,
    /// Attention from the target to the memory.
    pub cross_attention: MultiHeadAttention,
    /// The position-wise feed-forward network (burn-nn's module).
    pub feed_forward: PositionWiseFeedForward,
    /// The self-attention sub-layer's norm: before it with `norm_first`, after its residual
    /// otherwise.
    pub self_attention_norm: LayerNorm,
    /// The cross-attention sub-layer's norm, placed likewise.
    pub cross_attention_norm: LayerNorm,
    /// The feed-forward sub-layer's norm, placed likewise.
    pub feed_forward_norm: LayerNorm,
    /// On each sub-layer's output.
    pub dropout: Dropout,
    /// Pre-norm (`true`) or post-norm.
    pub norm_first: bool,
    /// Causal self-attention.
    pub causal: bool,
}

/// The input of a [`TransformerDecoder`]: the target, the memory and their masks, with
/// burn-nn's `TransformerDecoderInput` names.
#[derive(Debug, Clone)]
pub struct TransformerDecoderInput {
    target: Tensor<3>,
    memory: Tensor<3>,
    target_mask_pad: Option<Tensor<2, Bool>>,
    target_mask_attn: Option<AttnMask>,
    memory_mask_pad: Option<Tensor<2, Bool>>,
    memory_mask_attn: Option<AttnMask>,
}

impl TransformerDecoderInput {
    /// The target `[batch, seq, d_model]` and the memory `[batch, seq_memory, d_model]`.
    pub fn new(target: Tensor<3>, memory: Tensor<3>) -> Self {
        Self {
            target,
            memory,
            target_mask_pad: None,
            target_mask_attn: None,
            memory_mask_pad: None,
            memory_mask_attn: None,
        }
    }

    /// The target's padding, `[batch, seq]`, `true` = ignore this position as a key.
    pub fn target_mask_pad(mut self, mask: Tensor<2, Bool>) -> Self {
        self.target_mask_pad = Some(mask);
        self
    }

    /// A self-attention mask as [`MhaInput::attn_mask`] takes it.
    pub fn target_mask_attn(mut self, mask: impl IntoAttnMask) -> Self {
        self.target_mask_attn = Some(mask.into_attn_mask());
        self
    }

    /// The memory's padding, `[batch, seq_memory]`, `true` = ignore this memory position.
    pub fn memory_mask_pad(mut self, mask: Tensor<2, Bool>) -> Self {
        self.memory_mask_pad = Some(mask);
        self
    }

    /// A cross-attention mask as [`MhaInput::attn_mask`] takes it.
    pub fn memory_mask_attn(mut self, mask: impl IntoAttnMask) -> Self {
        self.memory_mask_attn = Some(mask.into_attn_mask());
        self
    }

    fn self_attention_input(&self, x: Tensor<3>, causal: bool) -> MhaInput {
        let mut input = MhaInput::self_attn(x);
        if let Some(mask) = &self.target_mask_pad {
            input = input.key_padding_mask(mask.clone());
        }
        if let Some(mask) = &self.target_mask_attn {
            input = input.attn_mask(mask.clone());
        }
        if causal {
            input = input.causal();
        }
        input
    }

    fn cross_attention_input(&self, x: Tensor<3>) -> MhaInput {
        let mut input = MhaInput::new(x, self.memory.clone(), self.memory.clone());
        if let Some(mask) = &self.memory_mask_pad {
            input = input.key_padding_mask(mask.clone());
        }
        if let Some(mask) = &self.memory_mask_attn {
            input = input.attn_mask(mask.clone());
        }
        input
    }
}

/// The caches of a [`TransformerDecoder`]'s incremental decoding: per layer, the
/// self-attention's [`KvCache`] and the memory projected once for the cross-attention.
#[derive(Debug, Clone, Default)]
pub struct TransformerDecoderCache {
    /// Layer `i`'s self-attention cache.
    pub self_attention: Vec<KvCache>,
    /// Layer `i`'s projected memory, made at the first step.
    pub memory: Vec<Option<CrossAttentionCache>>,
}

impl TransformerDecoderCache {
    /// Cuts every layer's self-attention cache back to its first `len` positions
    /// ([`KvCache::truncate`]; the projected memory stays): speculative decoding's rejected
    /// draft tokens through the stack, or a reply regenerated from some point.
    ///
    /// # Errors
    ///
    /// As [`KvCache::truncate`], from the first layer that refuses; no layer is then changed.
    pub fn truncate(&mut self, len: usize) -> Result<(), CacheError> {
        KvCache::truncate_all(&mut self.self_attention, len)
    }

    /// Keeps the batch elements `elements` of every layer's self-attention cache and projected
    /// memory, in that order, each as many times as it is named ([`KvCache::select_batch`],
    /// [`CrossAttentionCache::select_batch`]): beam search's surviving beams, a finished
    /// sequence leaving the batch. The next step's memory is that of the elements kept.
    ///
    /// # Panics
    ///
    /// As [`KvCache::select_batch`].
    pub fn select_batch(&mut self, elements: &[usize]) {
        for cache in &mut self.self_attention {
            cache.select_batch(elements);
        }
        for memory in self.memory.iter_mut().flatten() {
            memory.select_batch(elements);
        }
    }
}

impl TransformerDecoderLayer {
    /// A layer of `config`.
    pub fn new(config: &TransformerDecoderConfig, device: &Device) -> Self {
        let norm = || {
            LayerNormConfig::new(config.d_model)
                .with_epsilon(config.layer_norm_eps)
                .init(device)
        };
        Self {
            self_attention: config.self_attention().init(device),
            cross_attention: config.cross_attention().init(device),
            feed_forward: PositionWiseFeedForwardConfig::new(config.d_model, config.d_ff)
                .with_dropout(config.dropout)
                .with_initializer(config.initializer.clone())
                .with_activation(config.activation.clone())
                .init(device),
            self_attention_norm: norm(),
            cross_attention_norm: norm(),
            feed_forward_norm: norm(),
            dropout: DropoutConfig::new(config.dropout).init(),
            norm_first: config.norm_first,
            causal: config.causal,
        }
    }

    /// The layer on target `x` with `input`'s memory and masks.
    ///
    /// # Shapes
    ///
    /// - x: `[batch, seq, d_model]`
    /// - output: `[batch, seq, d_model]`
    ///
    /// # Panics
    ///
    /// As [`MultiHeadAttention::forward`] on a wrong shape or mask.
    pub fn forward(&self, x: Tensor<3>, input: &TransformerDecoderInput) -> Tensor<3> {
        let x = self.sublayer(x, &self.self_attention_norm, |x| {
            self.self_attention
                .forward(input.self_attention_input(x, self.causal))
                .context
        });
        let x = self.sublayer(x, &self.cross_attention_norm, |x| {
            self.cross_attention
                .forward(input.cross_attention_input(x))
                .context
        });
        self.sublayer(x, &self.feed_forward_norm, |x| {
            feed_forward(&self.feed_forward, x)
        })
    }

    /// One sub-layer of this layer's norm placement and dropout ([`residual`]).
    pub(super) fn sublayer(
        &self,
        x: Tensor<3>,
        norm: &LayerNorm,
        sublayer: impl FnOnce(Tensor<3>) -> Tensor<3>,
    ) -> Tensor<3> {
        residual(x, norm, &self.dropout, self.norm_first, sublayer)
    }

    /// [`forward`](Self::forward) for new target positions `x`: self-attention through
    /// `cache`, cross-attention over `memory` (projected once).
    ///
    /// # Shapes
    ///
    /// - x: `[batch, new, d_model]`
    /// - output: `[batch, new, d_model]`
    ///
    /// # Panics
    ///
    /// As [`MultiHeadAttention::forward_cached`] and
    /// [`MultiHeadAttention::forward_cross_cached`].
    pub fn forward_cached(
        &self,
        x: Tensor<3>,
        input: &TransformerDecoderInput,
        cache: &mut KvCache,
        memory: &CrossAttentionCache,
    ) -> Result<Tensor<3>, CacheError> {
        let mut result = Ok(());
        let x = self.sublayer(x, &self.self_attention_norm, |x| {
            match self
                .self_attention
                .forward_cached(input.self_attention_input(x.clone(), true), cache)
            {
                Ok(output) => output.context,
                Err(error) => {
                    result = Err(error);
                    x.zeros_like()
                }
            }
        });
        result?;
        let x = self.sublayer(x, &self.cross_attention_norm, |x| {
            self.cross_attention
                .forward_cross_cached(x, memory, NeedWeights::No)
                .context
        });
        Ok(self.sublayer(x, &self.feed_forward_norm, |x| {
            feed_forward(&self.feed_forward, x)
        }))
    }

    /// The memory projected by this layer's cross-attention, with its padding.
    fn project_memory(&self, input: &TransformerDecoderInput) -> CrossAttentionCache {
        assert!(
            input.memory_mask_attn.is_none(),
            "TransformerDecoder::forward_cached: `memory_mask_attn` is not taken under a cache \
             (use `memory_mask_pad`)"
        );
        let memory = self
            .cross_attention
            .cross_attention_cache(input.memory.clone(), input.memory.clone());
        match &input.memory_mask_pad {
            Some(mask) => memory.with_key_padding_mask(mask.clone()),
            None => memory,
        }
    }
}

impl TransformerDecoder {
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
    /// - target: `[batch, seq, d_model]`, memory: `[batch, seq_memory, d_model]`
    /// - output: `[batch, seq, d_model]`
    ///
    /// # Panics
    ///
    /// As [`MultiHeadAttention::forward`] on a wrong shape or mask.
    pub fn forward(&self, input: TransformerDecoderInput) -> Tensor<3> {
        let x = input.target.clone();
        self.layers
            .iter()
            .fold(x, |x, layer| layer.forward(x, &input))
    }

    /// An empty cache for [`forward_cached`](Self::forward_cached): a self-attention layer
    /// with a `window` keeps only the positions it still sees
    /// ([`CacheLimit::SlidingWindow`](crate::CacheLimit::SlidingWindow)), the others every
    /// position.
    pub fn new_cache(&self) -> TransformerDecoderCache {
        TransformerDecoderCache {
            self_attention: self
                .layers
                .iter()
                .map(|layer| layer.self_attention.new_cache())
                .collect(),
            memory: self.layers.iter().map(|_| None).collect(),
        }
    }

    /// Incremental decoding: `input`'s target holds the new positions; each layer's
    /// self-attention attends to its cached positions and the new ones, and its
    /// cross-attention to the memory, projected at the first step and reused after (the
    /// memory of later steps is not read again). Feeding a target in any steps gives what
    /// [`forward`](Self::forward) gives for the whole of it. A step is refused by the first
    /// layer or not at all, and a refused step leaves the cache as it was. A later layer's keys
    /// may exceed [`CacheStorage::Half`](crate::CacheStorage)'s range
    /// ([`CacheError::BeyondHalfRange`]) after the layers before it cached the step: those take
    /// it back (a windowed layer's cache holds its tensors from before a step until the next,
    /// shared, not copied).
    ///
    /// # Shapes
    ///
    /// - target: `[batch, new, d_model]`, memory: `[batch, seq_memory, d_model]`
    /// - output: `[batch, new, d_model]`
    ///
    /// # Panics
    ///
    /// If the self-attention is not causal, `cache` has another number of layers, or a
    /// `memory_mask_attn` is given (a memory padding mask is taken); as
    /// [`MultiHeadAttention::forward_cached`] on a wrong shape.
    pub fn forward_cached(
        &self,
        input: TransformerDecoderInput,
        cache: &mut TransformerDecoderCache,
    ) -> Result<Tensor<3>, CacheError> {
        assert!(
            self.layers.iter().all(|layer| layer.causal),
            "TransformerDecoder::forward_cached: decoding needs causal self-attention \
             (TransformerDecoderConfig::causal)"
        );
        assert!(
            cache.self_attention.len() == self.layers.len()
                && cache.memory.len() == self.layers.len(),
            "TransformerDecoder::forward_cached: `cache` has {} layers, the stack {} (make it \
             with `new_cache`)",
            cache.self_attention.len(),
            self.layers.len()
        );
        cache.self_attention.iter_mut().for_each(KvCache::keep_undo);
        let mut x = input.target.clone();
        for (index, layer) in self.layers.iter().enumerate() {
            let projected_before = cache.memory[index].is_some();
            let memory = cache.memory[index]
                .take()
                .unwrap_or_else(|| layer.project_memory(&input));
            let output = layer.forward_cached(x, &input, &mut cache.self_attention[index], &memory);
            // A refused first step keeps no projected memory either.
            if projected_before || output.is_ok() {
                cache.memory[index] = Some(memory);
            }
            match output {
                Ok(output) => x = output,
                Err(error) => {
                    // Only f16's range refusal comes from a later layer; the layers before it
                    // cached the step, and take it back to stay in step.
                    cache.self_attention[..index]
                        .iter_mut()
                        .for_each(KvCache::undo_last_step);
                    if index > 0 && cache.self_attention[0].is_empty() {
                        // A later layer refused the first step: the next is the first, and
                        // projects its memory.
                        cache.memory.iter_mut().for_each(|slot| *slot = None);
                    }
                    return Err(error);
                }
            }
        }
        Ok(x)
    }
}
