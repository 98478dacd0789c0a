//! Decoding entry points of [`MultiHeadAttention`]: self-attention over a [`KvCache`] that
//! feeds only the new tokens, and cross-attention over a memory projected once
//! ([`CrossAttentionCache`]). They share every stage with `forward`.

use burn::tensor::Tensor;

use crate::cache::{
    CacheError, CacheLimit, CacheStorage, CrossAttentionCache, KvCache, beyond_half_range,
};
use crate::input::{AttentionPath, MhaInput, MhaOutput, NeedWeights};
use crate::mask::Visibility;
use crate::module::{MultiHeadAttention, RopeStarts, Sequences};
use crate::shape::check_shape;

impl MultiHeadAttention {
    /// An empty [`KvCache`] for this module: with a `window`, one that keeps only the positions
    /// a next query still sees ([`CacheLimit::SlidingWindow`]); without, every position.
    pub(crate) fn new_cache(&self) -> KvCache {
        match self.window {
            Some(window) => KvCache::with_limit(CacheLimit::SlidingWindow(window)),
            None => KvCache::new(),
        }
    }

    /// Incremental self-attention: `input` holds **only the new tokens** (as query, key and
    /// value), whose keys and values are appended to `cache`. Each new query attends to every
    /// cached position and to the new ones its masks allow — with `.causal()`, new token `i`
    /// sees the cache and new tokens `≤ i` (bottom-right alignment). RoPE and ALiBi take the
    /// positions from the cache.
    ///
    /// Feeding a sequence in any number of steps gives the outputs of one causal
    /// [`forward`](Self::forward) over the whole sequence.
    ///
    /// `key_padding_mask` covers either the new keys (`[batch, new]`, remembered by the cache),
    /// cached plus new keys (`[batch, stored + new]`), or every position fed and the new ones
    /// (`[batch, len + new]`, as Hugging Face's models take it; once a window evicted, the
    /// cache picks the columns of the positions it holds); `attn_mask` covers
    /// `[new, stored + new]` or `[new, len + new]`.
    ///
    /// # Shapes
    ///
    /// - query, key, value: `[batch, new, d_model | d_key_input | d_value_input]`
    /// - context: `[batch, new, d_model]`
    ///
    /// # Errors
    ///
    /// [`CacheError`] when the step would exceed a fixed capacity, changes the batch size,
    /// brings a padding mask of another width, the cache was filled by another module, its
    /// storage cannot live on the device, or a new key or value is beyond the range of
    /// [`CacheStorage::Half`]; the cache is then unchanged.
    ///
    /// # Panics
    ///
    /// As [`forward`](Self::forward), and if the key and value do not have the query's length
    /// (they are the new tokens).
    pub fn forward_cached(
        &self,
        input: MhaInput,
        cache: &mut KvCache,
    ) -> Result<MhaOutput, CacheError> {
        let geometry = self.check_sequences(&input.query, &input.key, &input.value);
        assert!(
            geometry.seq_k == geometry.seq_q,
            "MultiHeadAttention: under a KV cache `key` and `value` are the new tokens and must \
             have the query's length {}, got {}",
            geometry.seq_q,
            geometry.seq_k
        );
        let MhaInput {
            query,
            key,
            value,
            key_padding_mask,
            attn_mask,
            causal,
            segment_ids,
            need_weights,
            path,
            shared_input,
        } = input;
        assert!(
            segment_ids.is_none(),
            "MultiHeadAttention: `segment_ids` (packed sequences) are not taken under a KV cache; \
             decode each sequence with its own cache"
        );
        let step = cache.begin(
            self.cache_owner(),
            geometry.batch,
            geometry.seq_q,
            key_padding_mask,
            &query.device(),
        )?;
        // A mask over every position fed, once a window evicted some: its kept columns.
        let attn_mask = match (attn_mask, &step.fed_columns) {
            (Some(mask), Some(columns)) if mask.dims()[3] == cache.len() + geometry.seq_q => {
                Some(mask.with_columns(columns))
            }
            (mask, _) => mask,
        };
        let visibility = Visibility {
            key_padding: step.padding.clone(),
            attn_mask,
            causal,
            window: match (step.window, self.window) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
            alibi: self.alibi,
            positions: step.positions,
            pinned_keys: step.pinned_keys,
            segments: None,
            extra_keys: self.extra_keys(),
        };
        let geometry = self.geometry(geometry.batch, geometry.seq_q, step.keys);
        let plan = self.plan(visibility, geometry, path, need_weights, &query.device());
        let first_query = step.positions.rope_query();
        let sequences = Sequences { query, key, value };
        let starts = RopeStarts {
            query: first_query,
            key: first_query,
        };
        let (query, key, value) = self.project(sequences, shared_input, starts);
        if cache.storage() == CacheStorage::Half
            && let Some(largest) = beyond_half_range([&key, &value])
        {
            return Err(CacheError::BeyondHalfRange { largest });
        }
        let (key, value) = cache.append(step, key, value);
        let (key, value) = self.append_extra_positions(key, value);
        Ok(self.attend(query, key, value, &plan))
    }

    /// Projects an encoder's memory once for a decoder's cross-attention; reuse the result at
    /// every decoding step with [`forward_cross_cached`](Self::forward_cross_cached).
    ///
    /// # Shapes
    ///
    /// - key: `[batch, seq_k, d_key_input]`
    /// - value: `[batch, seq_k, d_value_input]`
    ///
    /// # Panics
    ///
    /// On shapes as [`forward`](Self::forward), and for a module with RoPE or ALiBi, whose
    /// positions are those of self-attention.
    pub fn cross_attention_cache(&self, key: Tensor<3>, value: Tensor<3>) -> CrossAttentionCache {
        assert!(
            self.rope.is_none() && !self.alibi,
            "MultiHeadAttention: a cross-attention cache needs a module without RoPE or ALiBi"
        );
        let [batch, seq_k, _] = key.dims();
        self.check_key_value(&key, &value, batch);
        assert!(
            batch > 0 && seq_k > 0,
            "MultiHeadAttention: the memory `key` must have a non-empty batch and sequence, got {:?}",
            key.dims()
        );
        let (key, value) = self.project_key_value(key, value, 0);
        let (key, value) = self.append_extra_positions(key, value);
        CrossAttentionCache {
            key,
            value,
            seq_k,
            key_padding_mask: None,
            owner: self.cache_owner(),
        }
    }

    /// Cross-attention of `query` over a memory projected once by
    /// [`cross_attention_cache`](Self::cross_attention_cache). Gives the outputs of
    /// [`forward`](Self::forward) with the memory as key and value.
    ///
    /// # Shapes
    ///
    /// - query: `[batch, seq_q, d_model]`, the memory's batch
    /// - context: `[batch, seq_q, d_model]`
    ///
    /// # Panics
    ///
    /// If `query` does not have shape `[batch, seq_q, d_model]` with the memory's batch, or
    /// the cache was projected by another module.
    pub fn forward_cross_cached(
        &self,
        query: Tensor<3>,
        cache: &CrossAttentionCache,
        need_weights: NeedWeights,
    ) -> MhaOutput {
        assert!(
            cache.owner == self.cache_owner(),
            "MultiHeadAttention: this cross-attention cache was projected by another module ({}), \
             not this one ({})",
            cache.owner,
            self.cache_owner()
        );
        let [batch, seq_q, _] = query.dims();
        check_shape(
            "query",
            query.dims(),
            [
                ("batch", Some(cache.batch())),
                ("seq_q", None),
                ("d_model", Some(self.d_model)),
            ],
        );
        assert!(
            seq_q > 0,
            "MultiHeadAttention: `query` must have a non-empty sequence, got {:?}",
            query.dims()
        );
        let visibility = Visibility {
            key_padding: cache.key_padding_mask.clone(),
            extra_keys: self.extra_keys(),
            ..Visibility::nothing_hidden()
        };
        let geometry = self.geometry(batch, seq_q, cache.seq_k);
        let plan = self.plan(
            visibility,
            geometry,
            AttentionPath::Auto,
            need_weights,
            &query.device(),
        );
        let query = self.project_query(query, 0);
        self.attend(query, cache.key.clone(), cache.value.clone(), &plan)
    }
}
