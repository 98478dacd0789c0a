//! Continuous batching through a causal [`TransformerEncoder`] (a decoder-only model): one
//! [`PagedKvCache`] per layer, the same sequences in each.

use burn::nn::{Dropout, LayerNorm};
use burn::tensor::Tensor;

use super::encoder::{TransformerEncoder, TransformerEncoderLayer};
use super::residual;
use crate::{
    MultiHeadAttention, PagedCacheError, PagedKvCache, PagedKvCacheConfig, PromptMatch, SequenceId,
    Token,
};

/// A self-attention sub-layer of a stack's layer: its attention, and the norm, dropout and norm
/// placement around it.
pub(super) struct SubLayer<'a> {
    pub attention: &'a MultiHeadAttention,
    pub norm: &'a LayerNorm,
    pub dropout: &'a Dropout,
    pub norm_first: bool,
}

/// `sublayer`'s residual connection ([`residual`]) around
/// [`MultiHeadAttention::forward_paged`] through `cache`.
///
/// # Shapes
///
/// - x: `[1, rows, d_model]`
/// - output: `[1, rows, d_model]`
///
/// # Errors
///
/// As [`MultiHeadAttention::forward_paged`].
pub(super) fn paged_self_attention(
    sublayer: SubLayer,
    x: Tensor<3>,
    cache: &mut PagedKvCache,
    sequences: &[SequenceId],
) -> Result<Tensor<3>, PagedCacheError> {
    let [_, rows, d_model] = x.dims();
    let mut result = Ok(());
    let x = residual(
        x,
        sublayer.norm,
        sublayer.dropout,
        sublayer.norm_first,
        |x| {
            let attended = sublayer.attention.forward_paged(
                x.clone().reshape([rows, d_model]),
                cache,
                sequences,
            );
            match attended {
                Ok(output) => output.reshape([1, rows, d_model]),
                Err(error) => {
                    result = Err(error);
                    x.zeros_like()
                }
            }
        },
    );
    result.map(|()| x)
}

/// One [`PagedKvCache`] per layer of a causal [`TransformerEncoder`], holding the same
/// sequences, for [`TransformerEncoder::forward_paged`]. Layers whose attentions have the same
/// sliding window (or none) hold the same block tables; under different windows each gives back
/// the blocks behind its own, and their pools differ. Made by
/// [`TransformerEncoder::new_paged_cache`].
#[derive(Debug, Clone)]
pub struct PagedTransformerCache {
    layers: Vec<PagedKvCache>,
}

impl PagedTransformerCache {
    /// A new, empty sequence in every layer.
    pub fn add_sequence(&mut self) -> SequenceId {
        self.each(|cache| Ok(cache.add_sequence()))
            .expect("adding a sequence is never refused")
    }

    /// A new sequence whose positions will hold `prompt`'s tokens, sharing in every layer the
    /// whole blocks of the longest prefix of `prompt` that every layer holds
    /// ([`PagedKvCache::add_sequence_with_prompt`]; the step feeds `prompt[cached..]`).
    ///
    /// In f16 and int8 storage a layer's step reads its own new keys and values unrounded and
    /// earlier ones as stored, so the next layer's keys at a position depend, by the storage's
    /// rounding, on how the sequence that stored them was cut into steps: a prompt sharing
    /// them gets what computing it alone gives to within that rounding (in f32, the same).
    pub fn add_sequence_with_prompt(&mut self, prompt: &[Token]) -> PromptMatch {
        let blocks = self
            .layers
            .iter()
            .map(|cache| cache.matched_blocks(prompt))
            .min()
            .unwrap_or(0);
        self.each(|cache| Ok(cache.add_sequence_matching(prompt, blocks)))
            .expect("adding a sequence is never refused")
    }

    /// Tells every layer the tokens of `id`'s next positions ([`PagedKvCache::extend_tokens`]).
    ///
    /// # Errors
    ///
    /// [`PagedCacheError::UnknownSequence`] if `id` is not a sequence of the cache.
    pub fn extend_tokens(
        &mut self,
        id: SequenceId,
        tokens: &[Token],
    ) -> Result<(), PagedCacheError> {
        self.each(|cache| cache.extend_tokens(id, tokens))
    }

    /// Removes a sequence from every layer; its blocks are free at once.
    ///
    /// # Errors
    ///
    /// [`PagedCacheError::UnknownSequence`] if `id` is not a sequence of the cache.
    pub fn remove_sequence(&mut self, id: SequenceId) -> Result<(), PagedCacheError> {
        self.each(|cache| cache.remove_sequence(id))
    }

    /// A new sequence sharing every block of `id` ([`PagedKvCache::fork`]) in every layer.
    ///
    /// # Errors
    ///
    /// As [`PagedKvCache::fork`].
    pub fn fork(&mut self, id: SequenceId) -> Result<SequenceId, PagedCacheError> {
        self.each(|cache| cache.fork(id))
    }

    /// A new sequence holding the first `prefix` positions of `id`
    /// ([`PagedKvCache::fork_prefix`]) in every layer.
    ///
    /// # Errors
    ///
    /// As [`PagedKvCache::fork_prefix`].
    pub fn fork_prefix(
        &mut self,
        id: SequenceId,
        prefix: usize,
    ) -> Result<SequenceId, PagedCacheError> {
        // Layers of different windows gave back different blocks: each is asked first.
        for cache in &self.layers {
            cache.check_prefix(id, prefix)?;
        }
        self.each(|cache| cache.fork_prefix(id, prefix))
    }

    /// Cuts `id` back to its first `len` positions in every layer
    /// ([`PagedKvCache::truncate`]).
    ///
    /// # Errors
    ///
    /// As [`PagedKvCache::truncate`]; no layer is then changed.
    pub fn truncate(&mut self, id: SequenceId, len: usize) -> Result<(), PagedCacheError> {
        for cache in &self.layers {
            cache.check_truncate(id, len)?;
        }
        self.each(|cache| cache.truncate(id, len))
    }

    /// The first of `id`'s positions that every layer still holds, as
    /// [`PagedKvCache::first_held`] (layers under different sliding windows give back
    /// different blocks).
    pub fn first_held(&self, id: SequenceId) -> Option<usize> {
        self.layers
            .iter()
            .map(|cache| cache.first_held(id))
            .max()
            .flatten()
    }

    /// The tokens `id` was told, as [`PagedKvCache::tokens`] (every layer was told the same).
    pub fn tokens(&self, id: SequenceId) -> Option<&[Token]> {
        self.layers[0].tokens(id)
    }

    /// Positions `id` holds, or `None` if it is not a sequence of the cache.
    pub fn len(&self, id: SequenceId) -> Option<usize> {
        self.layers[0].len(id)
    }

    /// Whether the cache has no sequence.
    pub fn is_empty(&self) -> bool {
        self.layers[0].is_empty()
    }

    /// The sequences of the cache, in the order they were added.
    pub fn sequences(&self) -> impl Iterator<Item = SequenceId> + '_ {
        self.layers[0].sequences()
    }

    /// Blocks a step may still take from every layer's pool: the fewest any layer has free
    /// (layers under different sliding windows give back different blocks).
    pub fn free_blocks(&self) -> usize {
        self.layers
            .iter()
            .map(PagedKvCache::free_blocks)
            .min()
            .expect("a stack has layers")
    }

    /// Blocks some sequence refers to in the layer that holds the most (layers under
    /// different sliding windows give back different blocks).
    pub fn blocks_in_use(&self) -> usize {
        self.layers
            .iter()
            .map(PagedKvCache::blocks_in_use)
            .max()
            .expect("a stack has layers")
    }

    /// The blocks a step of `sequences` would take from the pool of the layer that needs the
    /// most ([`PagedKvCache::blocks_needed`]): the step fits if these are at most
    /// [`free_blocks`](Self::free_blocks). Where the layers' sliding windows differ that is
    /// enough but not needed (the layer that needs the most may not be the one with the fewest
    /// free blocks); [`fits`](Self::fits) asks each layer.
    ///
    /// # Errors
    ///
    /// As [`PagedKvCache::blocks_needed`].
    ///
    /// # Panics
    ///
    /// As [`PagedKvCache::blocks_needed`].
    pub fn blocks_needed(&self, sequences: &[SequenceId]) -> Result<usize, PagedCacheError> {
        let mut most = 0;
        for cache in &self.layers {
            most = most.max(cache.blocks_needed(sequences)?);
        }
        Ok(most)
    }

    /// Whether a step of `sequences` fits every layer's pool: each layer's
    /// [`PagedKvCache::blocks_needed`] at most its own [`PagedKvCache::free_blocks`]. A step
    /// that fits is not refused for want of blocks ([`PagedCacheError::PoolFull`]).
    ///
    /// # Errors
    ///
    /// As [`PagedKvCache::blocks_needed`].
    ///
    /// # Panics
    ///
    /// As [`PagedKvCache::blocks_needed`].
    pub fn fits(&self, sequences: &[SequenceId]) -> Result<bool, PagedCacheError> {
        for cache in &self.layers {
            if cache.blocks_needed(sequences)? > cache.free_blocks() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Bytes of the blocks in use, all layers together.
    pub fn bytes_in_use(&self) -> usize {
        self.layers.iter().map(PagedKvCache::bytes_in_use).sum()
    }

    /// Bytes the pools have allocated, all layers together.
    pub fn reserved_bytes(&self) -> usize {
        self.layers.iter().map(PagedKvCache::reserved_bytes).sum()
    }

    /// A cache of `layers` pools of `config`, each keeping its last step to take it back, for
    /// `stack`'s `new_paged_cache`.
    ///
    /// # Panics
    ///
    /// If `layers` is 0, naming `stack`; as [`PagedKvCacheConfig::init`].
    pub(crate) fn new(stack: &str, layers: usize, config: PagedKvCacheConfig) -> Self {
        assert!(
            layers > 0,
            "{stack}::new_paged_cache: the stack has no layers (n_layers = 0), so there is \
             nothing to cache"
        );
        let layer = |_| {
            let mut cache = config.init();
            cache.keep_undo();
            cache
        };
        Self {
            layers: (0..layers).map(layer).collect(),
        }
    }

    /// One step through a stack's layers: `layer(index, x, cache)` runs layer `index` on `x`
    /// through its pool. A layer's refusal leaves every layer as it was: the layers before it
    /// take the step back.
    pub(crate) fn forward_layers(
        &mut self,
        input: Tensor<2>,
        mut layer: impl FnMut(usize, Tensor<2>, &mut PagedKvCache) -> Result<Tensor<2>, PagedCacheError>,
    ) -> Result<Tensor<2>, PagedCacheError> {
        let mut x = input;
        for index in 0..self.layers.len() {
            match layer(index, x, &mut self.layers[index]) {
                Ok(output) => x = output,
                Err(error) => {
                    // A later layer's refusal (f16's range, or a fuller pool under another
                    // window): the layers before it stored the step, and take it back, so that
                    // the layers stay in step. Every layer forgets the filings of the blocks
                    // they overwrote, so that alike layers stay alike (under different windows
                    // the numbers may name other blocks of another layer's pool, whose filings
                    // are then lost: fewer prompts share them, nothing wrong is shared).
                    let (stored, later) = self.layers.split_at_mut(index);
                    PagedKvCache::take_back(stored, later);
                    return Err(error);
                }
            }
        }
        Ok(x)
    }

    /// The layers' caches, first to last.
    pub fn layers(&self) -> &[PagedKvCache] {
        &self.layers
    }

    /// `operation` on every layer's cache; they hold the same sequences, so it succeeds on all
    /// or fails on the first, before any changed.
    fn each<T: PartialEq + core::fmt::Debug>(
        &mut self,
        mut operation: impl FnMut(&mut PagedKvCache) -> Result<T, PagedCacheError>,
    ) -> Result<T, PagedCacheError> {
        let mut result = None;
        for cache in &mut self.layers {
            let value = operation(cache)?;
            if let Some(first) = &result {
                assert_eq!(first, &value, "the layers' caches hold the same sequences");
            }
            result = Some(value);
        }
        Ok(result.expect("a stack has layers"))
    }
}

impl TransformerEncoderLayer {
    /// [`forward_cached`](Self::forward_cached) for a ragged batch of sequences:
    /// [`MultiHeadAttention::forward_paged`](crate::MultiHeadAttention::forward_paged) for the
    /// attention, the rest row by row.
    ///
    /// # Shapes
    ///
    /// - x: `[rows, d_model]`
    /// - output: `[rows, d_model]`
    ///
    /// # Errors
    ///
    /// As [`MultiHeadAttention::forward_paged`](crate::MultiHeadAttention::forward_paged).
    ///
    /// # Panics
    ///
    /// As [`MultiHeadAttention::forward_paged`](crate::MultiHeadAttention::forward_paged).
    pub fn forward_paged(
        &self,
        x: Tensor<2>,
        cache: &mut PagedKvCache,
        sequences: &[SequenceId],
    ) -> Result<Tensor<2>, PagedCacheError> {
        let [rows, d_model] = x.dims();
        let x = paged_self_attention(
            SubLayer {
                attention: &self.attention,
                norm: &self.attention_norm,
                dropout: &self.dropout,
                norm_first: self.norm_first,
            },
            x.reshape([1, rows, d_model]),
            cache,
            sequences,
        )?;
        Ok(self.feed_forward_sublayer(x).reshape([rows, d_model]))
    }
}

impl TransformerEncoder {
    /// An empty paged cache for [`forward_paged`](Self::forward_paged): a pool of `config` per
    /// layer. A layer whose attention has a sliding `window` gives its blocks wholly behind a
    /// sequence's window back to its pool after each step
    /// ([`MultiHeadAttention::forward_paged`](crate::MultiHeadAttention::forward_paged)), so
    /// layers under different windows hold different blocks, and
    /// [`PagedTransformerCache::free_blocks`] is the fewest any layer has.
    ///
    /// # Panics
    ///
    /// If the stack has no layers, or as [`PagedKvCacheConfig::init`].
    pub fn new_paged_cache(&self, config: PagedKvCacheConfig) -> PagedTransformerCache {
        PagedTransformerCache::new("TransformerEncoder", self.layers.len(), config)
    }

    /// One step of continuous batching through the causal stack: row `i` of `input` is a new
    /// position of `sequences[i]` (each sequence's rows consecutive), and every sequence gets
    /// what [`forward_cached`](Self::forward_cached) gives it alone. A refused step leaves
    /// every sequence of every layer as it was. Every layer's cache holds the same sequences,
    /// so most refusals come from the first layer, before any layer stored the step; a later
    /// layer may refuse it after the layers before it stored it: its keys beyond
    /// [`CacheStorage::Half`](crate::CacheStorage)'s range
    /// ([`PagedCacheError::BeyondHalfRange`]), or, where the layers' attentions have different
    /// sliding windows (and so give back different blocks), a pool with fewer free blocks
    /// ([`PagedCacheError::PoolFull`]). The layers before it then take the step back, and the
    /// whole blocks it overwrote are no longer shared by later prompts (in any layer, so that
    /// alike layers stay alike). To do so, each layer keeps the list of blocks its last step
    /// took, copied and gave back, and its sequences' tables before it.
    ///
    /// # Shapes
    ///
    /// - input: `[rows, d_model]`
    /// - output: `[rows, d_model]`
    ///
    /// # Errors
    ///
    /// As [`MultiHeadAttention::forward_paged`](crate::MultiHeadAttention::forward_paged).
    ///
    /// # Panics
    ///
    /// If the layers are not causal, or `cache` has another number of layers; as
    /// [`MultiHeadAttention::forward_paged`](crate::MultiHeadAttention::forward_paged).
    pub fn forward_paged(
        &self,
        input: Tensor<2>,
        cache: &mut PagedTransformerCache,
        sequences: &[SequenceId],
    ) -> Result<Tensor<2>, PagedCacheError> {
        assert!(
            self.layers.iter().all(|layer| layer.causal),
            "TransformerEncoder::forward_paged: decoding needs a causal stack \
             (TransformerEncoderConfig::causal)"
        );
        assert_eq!(
            cache.layers.len(),
            self.layers.len(),
            "TransformerEncoder::forward_paged: `cache` has {} layers, the stack {} (make it \
             with `new_paged_cache`)",
            cache.layers.len(),
            self.layers.len()
        );
        cache.forward_layers(input, |index, x, layer_cache| {
            self.layers[index].forward_paged(x, layer_cache, sequences)
        })
    }
}
