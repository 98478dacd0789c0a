//! Continuous batching through a [`TransformerDecoder`] (an encoder-decoder model's decoder,
//! as in translation or speech recognition): each sequence decodes over its own memory, of its
//! own length, projected once by every layer's cross-attention when the sequence joins; the
//! self-attention caches are paged as a decoder-only stack's.

use std::collections::BTreeMap;

use burn::tensor::Tensor;

use super::decoder::{TransformerDecoder, TransformerDecoderLayer};
use super::feed_forward;
use super::paged::{PagedTransformerCache, SubLayer, paged_self_attention};
use crate::paged::{SequenceRows, sequence_rows};
use crate::{CrossAttentionCache, PagedCacheError, PagedKvCache, PagedKvCacheConfig, SequenceId};

/// The paged caches of a [`TransformerDecoder`], for
/// [`TransformerDecoder::forward_paged`]: one [`PagedKvCache`] per layer for the
/// self-attention (a [`PagedTransformerCache`]), and each sequence's memory as every layer's
/// cross-attention projected it ([`CrossAttentionCache`]). Made by
/// [`TransformerDecoder::new_paged_cache`]; sequences join with their memories through
/// [`TransformerDecoder::add_paged_sequence`].
///
/// There is no sharing of prompts by their tokens here (no `add_sequence_with_prompt`): a
/// decoder's keys at a position depend on the sequence's memory as well as on its tokens.
/// [`fork`](Self::fork) shares blocks and memory where both are the same.
///
/// ```
/// use burn::tensor::{Device, Distribution, Tensor};
/// use mha::PagedKvCacheConfig;
/// use mha::transformer::TransformerDecoderConfig;
///
/// let device = Device::flex();
/// let decoder = TransformerDecoderConfig::new(16, 32, 4, 2).init(&device);
/// let mut cache = decoder.new_paged_cache(PagedKvCacheConfig::new(64));
/// // Two sources of different lengths, each encoded on its own (`[seq_memory, d_model]`).
/// let memory_a = Tensor::<2>::random([7, 16], Distribution::Default, &device);
/// let memory_b = Tensor::<2>::random([3, 16], Distribution::Default, &device);
/// let a = decoder.add_paged_sequence(&mut cache, memory_a);
/// let b = decoder.add_paged_sequence(&mut cache, memory_b);
/// // `a`'s first two target tokens and `b`'s first, in one step; then one token each.
/// let first = Tensor::<2>::random([3, 16], Distribution::Default, &device);
/// decoder.forward_paged(first, &mut cache, &[a, a, b]).unwrap();
/// let next = Tensor::<2>::random([2, 16], Distribution::Default, &device);
/// let output = decoder.forward_paged(next, &mut cache, &[a, b]).unwrap();
/// assert_eq!(output.dims(), [2, 16]);
/// assert_eq!((cache.len(a), cache.len(b)), (Some(3), Some(2)));
/// assert_eq!((cache.memory_len(a), cache.memory_len(b)), (Some(7), Some(3)));
/// ```
#[derive(Debug, Clone)]
pub struct PagedTransformerDecoderCache {
    self_attention: PagedTransformerCache,
    /// Each sequence's memory, projected by each layer's cross-attention, first layer first.
    memories: BTreeMap<SequenceId, Vec<CrossAttentionCache>>,
}

impl PagedTransformerDecoderCache {
    /// The self-attention's pools: the blocks in use and free, whether a step fits
    /// ([`PagedTransformerCache::fits`]), each sequence's length.
    pub fn self_attention(&self) -> &PagedTransformerCache {
        &self.self_attention
    }

    /// The number of positions of `id`'s memory, if `id` is a sequence of the cache.
    pub fn memory_len(&self, id: SequenceId) -> Option<usize> {
        self.memories
            .get(&id)
            .map(|layers| layers.first().expect("a stack has layers").len())
    }

    /// The number of target positions `id` holds, if it is a sequence of the cache.
    pub fn len(&self, id: SequenceId) -> Option<usize> {
        self.self_attention.len(id)
    }

    /// Whether the cache holds no sequence.
    pub fn is_empty(&self) -> bool {
        self.memories.is_empty()
    }

    /// The sequences of the cache, in the order they joined.
    pub fn sequences(&self) -> impl Iterator<Item = SequenceId> + '_ {
        self.memories.keys().copied()
    }

    /// Removes a sequence: its blocks are free at once, its memory dropped.
    ///
    /// # Errors
    ///
    /// [`PagedCacheError::UnknownSequence`] if `id` is not a sequence of the cache.
    pub fn remove_sequence(&mut self, id: SequenceId) -> Result<(), PagedCacheError> {
        self.self_attention.remove_sequence(id)?;
        self.memories.remove(&id);
        Ok(())
    }

    /// A new sequence sharing every block and the memory of `id`
    /// ([`PagedTransformerCache::fork`]): beam search or parallel sampling from one point.
    ///
    /// # Errors
    ///
    /// As [`PagedKvCache::fork`].
    pub fn fork(&mut self, id: SequenceId) -> Result<SequenceId, PagedCacheError> {
        let forked = self.self_attention.fork(id)?;
        self.share_memory(id, forked);
        Ok(forked)
    }

    /// A new sequence holding the first `prefix` target positions of `id`, over its memory
    /// ([`PagedTransformerCache::fork_prefix`]).
    ///
    /// # Errors
    ///
    /// As [`PagedKvCache::fork_prefix`].
    pub fn fork_prefix(
        &mut self,
        id: SequenceId,
        prefix: usize,
    ) -> Result<SequenceId, PagedCacheError> {
        let forked = self.self_attention.fork_prefix(id, prefix)?;
        self.share_memory(id, forked);
        Ok(forked)
    }

    /// Cuts `id` back to its first `len` target positions in every layer
    /// ([`PagedTransformerCache::truncate`]); its memory stays.
    ///
    /// # Errors
    ///
    /// As [`PagedKvCache::truncate`]; no layer is then changed.
    pub fn truncate(&mut self, id: SequenceId, len: usize) -> Result<(), PagedCacheError> {
        self.self_attention.truncate(id, len)
    }

    /// `forked` decodes over `id`'s memory: the projected tensors are shared, not copied.
    fn share_memory(&mut self, id: SequenceId, forked: SequenceId) {
        let memory = self.memories[&id].clone();
        self.memories.insert(forked, memory);
    }
}

impl TransformerDecoderLayer {
    /// [`forward_cached`](Self::forward_cached) for a ragged batch of sequences: the
    /// self-attention through the layer's pool
    /// ([`MultiHeadAttention::forward_paged`](crate::MultiHeadAttention::forward_paged)), the
    /// cross-attention of each sequence's run of rows over its own memory (`memories[i]` for
    /// the `i`-th run), the feed-forward network row by row.
    fn forward_paged(
        &self,
        x: Tensor<2>,
        cache: &mut PagedKvCache,
        sequences: &[SequenceId],
        memories: &[(usize, &CrossAttentionCache)],
    ) -> Result<Tensor<2>, PagedCacheError> {
        let [rows, d_model] = x.dims();
        let x = paged_self_attention(
            SubLayer {
                attention: &self.self_attention,
                norm: &self.self_attention_norm,
                dropout: &self.dropout,
                norm_first: self.norm_first,
            },
            x.reshape([1, rows, d_model]),
            cache,
            sequences,
        )?;
        let x = self.sublayer(x, &self.cross_attention_norm, |x| {
            // Each run's queries over its own memory, read in place: the memories differ in
            // length, and a batch of them would copy every memory at every step.
            self.cross_attention
                .forward_cross_runs(x.reshape([rows, d_model]), memories)
                .reshape([1, rows, d_model])
        });
        let x = self.sublayer(x, &self.feed_forward_norm, |x| {
            feed_forward(&self.feed_forward, x)
        });
        Ok(x.reshape([rows, d_model]))
    }
}

impl TransformerDecoder {
    /// An empty paged cache for [`forward_paged`](Self::forward_paged): a self-attention pool
    /// of `config` per layer (a layer with a sliding `window` gives back the blocks behind
    /// it, as [`TransformerEncoder::new_paged_cache`](super::TransformerEncoder::new_paged_cache)
    /// describes), and no sequence.
    ///
    /// # Panics
    ///
    /// If the stack has no layers, or as [`PagedKvCacheConfig::init`].
    pub fn new_paged_cache(&self, config: PagedKvCacheConfig) -> PagedTransformerDecoderCache {
        PagedTransformerDecoderCache {
            self_attention: PagedTransformerCache::new(
                "TransformerDecoder",
                self.layers.len(),
                config,
            ),
            memories: BTreeMap::new(),
        }
    }

    /// A new, empty sequence of `cache` that decodes over `memory` (the encoder's output for
    /// this sequence alone, of any length), projected now by every layer's cross-attention and
    /// read at every step. Its first step feeds its first target tokens.
    ///
    /// # Shapes
    ///
    /// - memory: `[seq_memory, d_model]`, `seq_memory > 0`
    ///
    /// # Panics
    ///
    /// If `memory` is not `[seq_memory, d_model]` with `seq_memory > 0`, or `cache` has
    /// another number of layers.
    pub fn add_paged_sequence(
        &self,
        cache: &mut PagedTransformerDecoderCache,
        memory: Tensor<2>,
    ) -> SequenceId {
        self.check_paged_cache("add_paged_sequence", cache);
        let [seq_memory, width] = memory.dims();
        let d_model = self.layers[0].cross_attention.d_model;
        assert!(
            seq_memory > 0 && width == d_model,
            "TransformerDecoder::add_paged_sequence: `memory` must have shape [seq_memory, \
             d_model = {d_model}] with seq_memory > 0, got {:?}",
            memory.dims()
        );
        let memory = memory.reshape([1, seq_memory, d_model]);
        let projected = self
            .layers
            .iter()
            .map(|layer| {
                layer
                    .cross_attention
                    .cross_attention_cache(memory.clone(), memory.clone())
            })
            .collect();
        let id = cache.self_attention.add_sequence();
        cache.memories.insert(id, projected);
        id
    }

    /// One step of continuous batching through the decoder: row `i` of `target` is a new
    /// target position of `sequences[i]` (each sequence's rows consecutive), and every
    /// sequence gets what [`forward_cached`](Self::forward_cached) gives it alone with its own
    /// memory. The self-attention reads each layer's pool as
    /// [`TransformerEncoder::forward_paged`](super::TransformerEncoder::forward_paged) does; the
    /// cross-attention attends each sequence's rows to its own projected memory in place, one
    /// sequence at a time (memories differ in length, and batching them would copy each at
    /// every step). A refused step leaves every sequence of every layer as it was.
    ///
    /// # Shapes
    ///
    /// - target: `[rows, d_model]`
    /// - sequences: `rows` ids
    /// - output: `[rows, d_model]`
    ///
    /// # Errors
    ///
    /// As [`MultiHeadAttention::forward_paged`](crate::MultiHeadAttention::forward_paged):
    /// [`PagedCacheError::UnknownSequence`] for a sequence not in `cache`,
    /// [`PagedCacheError::PoolFull`] when a pool lacks blocks for the step.
    ///
    /// # Panics
    ///
    /// If the self-attention is not causal, `cache` has another number of layers, or a
    /// sequence's memory was projected by another decoder's
    /// [`add_paged_sequence`](Self::add_paged_sequence); as
    /// [`MultiHeadAttention::forward_paged`](crate::MultiHeadAttention::forward_paged) on a
    /// wrong shape or `sequences`.
    pub fn forward_paged(
        &self,
        target: Tensor<2>,
        cache: &mut PagedTransformerDecoderCache,
        sequences: &[SequenceId],
    ) -> Result<Tensor<2>, PagedCacheError> {
        assert!(
            self.layers.iter().all(|layer| layer.causal),
            "TransformerDecoder::forward_paged: decoding needs causal self-attention \
             (TransformerDecoderConfig::causal)"
        );
        self.check_paged_cache("forward_paged", cache);
        // Each run of rows and its sequence, checked before any layer stores the step.
        let runs = sequence_rows("TransformerDecoder::forward_paged", sequences);
        for &SequenceRows { id, .. } in &runs {
            let Some(memories) = cache.memories.get(&id) else {
                return Err(PagedCacheError::UnknownSequence(id));
            };
            let projected_here = memories
                .iter()
                .zip(&self.layers)
                .all(|(memory, layer)| memory.owner() == layer.cross_attention.cache_owner());
            assert!(
                projected_here,
                "TransformerDecoder::forward_paged: {id:?}'s memory was projected by another \
                 decoder (`add_paged_sequence` of the decoder that steps it)"
            );
        }
        let PagedTransformerDecoderCache {
            self_attention,
            memories,
        } = cache;
        self_attention.forward_layers(target, |index, x, layer_cache| {
            let layer_memories: Vec<(usize, &CrossAttentionCache)> = runs
                .iter()
                .map(|run| (run.rows.len(), &memories[&run.id][index]))
                .collect();
            self.layers[index].forward_paged(x, layer_cache, sequences, &layer_memories)
        })
    }

    /// Panics unless `cache` has a pool per layer of the stack.
    fn check_paged_cache(&self, method: &str, cache: &PagedTransformerDecoderCache) {
        let layers = cache.self_attention.layers().len();
        assert_eq!(
            layers,
            self.layers.len(),
            "TransformerDecoder::{method}: `cache` has {layers} layers, the stack {} (make it with \
             `new_paged_cache`)",
            self.layers.len()
        );
    }
}
