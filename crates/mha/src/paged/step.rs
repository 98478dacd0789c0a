//! [`MultiHeadAttention::forward_paged`]: one causal self-attention step for a ragged batch of
//! sequences of a [`PagedKvCache`], each row at its own sequence's position.

use burn::tensor::Tensor;

use super::cache::{PagedCacheError, PagedKvCache, SequenceId, SequenceRows, SequenceStep};
use crate::cache::{CacheStorage, beyond_half_range};
use crate::module::MultiHeadAttention;
use crate::shape::check_shape;

/// A step's projected heads: queries `[1, n_heads, rows, head_dim]`, the new keys and values
/// `[1, n_kv_heads, rows, head_dim]`.
#[derive(Clone)]
pub(crate) struct StepHeads {
    pub query: Tensor<4>,
    pub key: Tensor<4>,
    pub value: Tensor<4>,
}

impl MultiHeadAttention {
    /// One causal self-attention step for many sequences of `cache` at once (continuous
    /// batching): row `i` of `input` is a new token of sequence `sequences[i]`, and each
    /// sequence's rows are consecutive (FlashAttention's varlen layout: a prompt being prefilled
    /// and the single tokens of sequences being decoded, side by side, not padded). Each
    /// sequence's new keys and values are appended to its blocks; each new query attends to
    /// its own sequence only — its stored positions and its new tokens up to itself — with
    /// RoPE and ALiBi at the sequence's own positions.
    ///
    /// Every sequence gets the outputs [`forward_cached`](Self::forward_cached) gives it alone
    /// with a [`KvCache`](crate::KvCache) of the same storage and `.causal()`. Under a sliding
    /// `window` each query sees its window only, and after the step each sequence gives back
    /// to the pool its blocks wholly behind the window of its next query (as a `KvCache` with
    /// [`CacheLimit::SlidingWindow`](crate::CacheLimit) keeps only the window): between steps
    /// a sequence holds at most `window.div_ceil(block_size) + 1` blocks, whatever its length
    /// ([`PagedKvCache::first_held`]; a fork of a prefix whose window was given back is
    /// refused). A step takes blocks for all its rows before it gives any back: a long prompt
    /// fed in chunks of a few windows needs a few windows' blocks, fed whole all of its own.
    ///
    /// On flex and ndarray (an f32 module, float, f16 (flex) or int8 storage, no
    /// `add_bias_kv`/`add_zero_attn`, outside autodiff) a native kernel reads the keys and
    /// values of each sequence with at most 32 rows in the step (a decoding step, a short
    /// continuation) through its block table in place, and the pool takes the step's new keys
    /// and values in place (converted to f16 or quantized to int8 as it stores them).
    /// Elsewhere the sequences' blocks are gathered into contiguous tensors with tensor ops
    /// and attended to by the kernel [`AttentionPath::Auto`](crate::AttentionPath::Auto)
    /// picks, the same results from a copy of their caches each step: the sequences with at
    /// most 32 rows in as few calls as keep each call's keys, padded to its longest sequence
    /// and widened to every query head, within 32 MiB (under ALiBi with each sequence's
    /// penalty in a float mask); longer runs
    /// of rows (a prompt, whose many queries the matrix products of the flash kernel serve
    /// better) one sequence at a time, there and on flex and ndarray.
    ///
    /// # Shapes
    ///
    /// - input: `[rows, d_model]`, the step's new tokens (query, key and value)
    /// - sequences: `rows` ids
    /// - output: `[rows, d_model]`
    ///
    /// # Errors
    ///
    /// [`PagedCacheError`] when the pool has too few free blocks for the step, a sequence is
    /// not in the cache, its storage cannot live on the device, the cache was filled by
    /// another module, or a new key or value is beyond the range of
    /// [`CacheStorage::Half`](crate::CacheStorage); the cache is then unchanged.
    ///
    /// # Panics
    ///
    /// If `input` is not `[rows, d_model]` with `rows > 0`, `sequences` does not name one
    /// sequence per row or names a sequence in two separate runs of rows, or the module's key
    /// or value inputs are not `d_model` wide (self-attention only).
    pub fn forward_paged(
        &self,
        input: Tensor<2>,
        cache: &mut PagedKvCache,
        sequences: &[SequenceId],
    ) -> Result<Tensor<2>, PagedCacheError> {
        let [rows, d_model] = input.dims();
        check_shape(
            "input",
            input.dims(),
            [("rows", None), ("d_model", Some(self.d_model))],
        );
        assert!(
            rows > 0,
            "MultiHeadAttention::forward_paged: `input` has no rows"
        );
        assert!(
            self.d_key_input == d_model && self.d_value_input == d_model,
            "MultiHeadAttention::forward_paged: self-attention only, but the module's key and \
             value inputs are {} and {} wide, not d_model {d_model}",
            self.d_key_input,
            self.d_value_input
        );
        assert!(
            sequences.len() == rows,
            "MultiHeadAttention::forward_paged: `sequences` names {} sequences for {rows} rows \
             of `input`; give one per row",
            sequences.len()
        );
        let runs = sequence_rows("MultiHeadAttention::forward_paged", sequences);
        let device = input.device();
        let step = cache.begin(self.cache_owner(), self.window, &runs, &device)?;
        let positions: Vec<usize> = step
            .sequences
            .iter()
            .flat_map(|sequence| sequence.past..sequence.past + sequence.rows.len())
            .collect();
        let (query, key, value) = self.project_at(input.reshape([1, rows, d_model]), &positions);
        if cache.config().storage == CacheStorage::Half
            && let Some(largest) = beyond_half_range([&key, &value])
        {
            return Err(PagedCacheError::BeyondHalfRange { largest });
        }
        cache.store(&step, &key, &value);
        let heads = StepHeads { query, key, value };
        let in_place: Vec<&SequenceStep> = step
            .sequences
            .iter()
            .filter(|sequence| sequence.rows.len() <= IN_PLACE_ROWS)
            .collect();
        let native = if in_place.is_empty() {
            None
        } else {
            super::cpu::native_paged_attention(self, &heads, &in_place, cache)
        };
        if let Some(native) = &native
            && in_place.len() == step.sequences.len()
        {
            let context = native.clone();
            return Ok(self.output_projection(context).reshape([rows, d_model]));
        }
        // The sequences the native kernel read, or else those of at most 32 rows in batched
        // gathered calls; the others (prompts, a sequence alone in its kind) gathered one at a
        // time.
        let mut contexts = match &native {
            Some(native) => step
                .sequences
                .iter()
                .map(|sequence| {
                    let rows = &sequence.rows;
                    (rows.len() <= IN_PLACE_ROWS)
                        .then(|| native.clone().narrow(2, rows.start, rows.len()))
                })
                .collect(),
            None => self.batched_contexts(&heads, &step.sequences, cache),
        };
        let contexts = step
            .sequences
            .iter()
            .zip(&mut contexts)
            .map(|(sequence, context)| {
                context
                    .take()
                    .unwrap_or_else(|| self.gathered_attention(&heads, sequence, cache))
            })
            .collect();
        let context = Tensor::cat(contexts, 2);
        Ok(self.output_projection(context).reshape([rows, d_model]))
    }
}

/// Sequences with at most this many rows in a step (decoding steps, short continuations) are
/// read through their block tables in place where the native kernel runs, and elsewhere share
/// gathered calls; longer ones (a prompt being prefilled) are gathered one at a time and go to
/// the GEMM-based kernels.
///
/// Why: a decoding row is bound by reading its cache, which the in-place kernel reads once;
/// a prompt's rows each read every key again, which the flash kernel's matrix products do
/// faster than the in-place kernel's dot products once there are many rows. Measured with
/// the in-place kernel reading each tile for all of a task's rows (flex, AMD EPYC (Zen 5),
/// one sequence, d_model 512, 8 query / 2 key/value heads): 32 rows over 64-4096 stored
/// positions took 0.6-1.0x the gathered path's time, 64 rows 0.8-1.35x, 128 rows 1.1-1.2x and
/// 512 rows 1.7x.
pub(crate) const IN_PLACE_ROWS: usize = 32;

/// `sequences` (one id per row) as runs of consecutive rows, one per sequence.
///
/// # Panics
///
/// If a sequence's rows are not consecutive.
pub(crate) fn sequence_rows(caller: &str, sequences: &[SequenceId]) -> Vec<SequenceRows> {
    let mut runs: Vec<SequenceRows> = Vec::new();
    for (row, &id) in sequences.iter().enumerate() {
        match runs.last_mut() {
            Some(run) if run.id == id => run.rows.end = row + 1,
            _ => {
                assert!(
                    runs.iter().all(|run| run.id != id),
                    "{caller}: the rows of {id} in `sequences` are not \
                     consecutive (row {row} follows another sequence's); give each sequence's \
                     new tokens side by side"
                );
                runs.push(SequenceRows {
                    id,
                    rows: row..row + 1,
                });
            }
        }
    }
    runs
}
