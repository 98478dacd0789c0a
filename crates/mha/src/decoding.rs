//! Decoding entry points of [`MultiHeadAttention`]: self-attention over a [`KvCache`] that
//! feeds only the new tokens, and cross-attention over a memory projected once
//! ([`CrossAttentionCache`]). They share every stage with `forward`.

use burn::tensor::{Bool, Device, Tensor};

use crate::cache::{
    CacheError, CacheLimit, CacheStep, CacheStorage, CrossAttentionCache, KvCache,
    beyond_half_range,
};
use crate::cpu::{map_in_parallel, native_storage};
use crate::input::{AttentionPath, MhaInput, MhaOutput, NeedWeights};
use crate::mask::Visibility;
use crate::module::{MultiHeadAttention, Plan, RopeStarts, Sequences};
use crate::paged::{IN_PLACE_ROWS, StepHeads, native_cached_attention, native_kernel_runs};
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
    /// An f16 or int8 cache is read where it lies by a decoding step on flex and ndarray (see
    /// [`CacheStorage::Int8`] for which steps); other steps attend to it widened to f32.
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
        let window = self.step_window(step.window);
        // A streaming window's one new row sees every position the cache holds (its sinks,
        // then the latest ones, which it keeps next to each other): the in-place kernel reads
        // them all, without a window. More rows would each see fewer of the latest ones, ALiBi
        // measures from the sinks' first positions (the cache moved them), and a module's own
        // window would hide some: those steps attend through the pinned keys' masks.
        let whole_cache_seen =
            step.pinned_keys > 0 && geometry.seq_q == 1 && !self.alibi && self.window.is_none();
        // What the in-place kernel computes: each new row over the cache and the new rows up
        // to itself, nothing else hidden, nothing but the context asked for.
        let in_place = InPlaceStep {
            plain: path == AttentionPath::Auto
                && need_weights == NeedWeights::No
                && attn_mask.is_none()
                && (step.pinned_keys == 0 || whole_cache_seen)
                && (causal || geometry.seq_q == 1)
                && geometry.seq_q <= IN_PLACE_ROWS,
            window: if whole_cache_seen { None } else { window },
        };
        let visibility = Visibility {
            key_padding: step.padding.clone(),
            attn_mask,
            causal,
            window,
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
        let heads = StepHeads { query, key, value };
        Ok(self.attend_step(heads, cache, step, in_place, &plan))
    }

    /// The window a step's queries see: the cache's (a sliding window's) or the module's,
    /// the shorter.
    fn step_window(&self, cache_window: Option<usize>) -> Option<usize> {
        match (cache_window, self.window) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The step's output: attending to `cache` in place where it can
    /// ([`attend_in_place`](Self::attend_in_place)), then storing the step's keys and values;
    /// else storing them and attending to the cache's positions as `plan` says.
    fn attend_step(
        &self,
        heads: StepHeads,
        cache: &mut KvCache,
        step: CacheStep,
        in_place: InPlaceStep,
        plan: &Plan,
    ) -> MhaOutput {
        let padding = step.padding.as_ref();
        if let Some(context) = self.attend_in_place(&heads, cache, in_place, padding) {
            cache.store(step, heads.key, heads.value);
            return MhaOutput {
                context: self.output_projection(context),
                weights: None,
            };
        }
        let StepHeads { query, key, value } = heads;
        let (key, value) = cache.append(step, key, value);
        let (key, value) = self.append_extra_positions(key, value);
        self.attend(query, key, value, plan)
    }

    /// The context heads of a step over a compressed (f16 or int8) `cache` read where it
    /// lies, before the step's keys and values are stored: on flex and ndarray (f32, outside
    /// autodiff, no appended key positions) for a [plain](InPlaceStep::plain) step whose
    /// `padding` (`[batch, stored + new]`), if any, hides a run of stored positions at the
    /// front of each batch element (left padding), where widening the cache to f32 would
    /// write and read it again in 4 bytes an element. `None` elsewhere: the step then attends
    /// to the widened cache.
    fn attend_in_place(
        &self,
        heads: &StepHeads,
        cache: &KvCache,
        step: InPlaceStep,
        padding: Option<&Tensor<2, Bool>>,
    ) -> Option<Tensor<4>> {
        if !(step.plain && native_kernel_runs(self, &heads.query)) {
            return None;
        }
        let buffers = cache.in_place_buffers()?;
        let hidden = match padding {
            Some(padding) => Some(left_padding(padding, buffers.stored)?),
            None => None,
        };
        native_cached_attention(self, heads.clone(), buffers, step.window, hidden.as_deref())
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
        self.check_cross_cache(cache);
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
        let plan = self.cross_plan(cache, batch, seq_q, need_weights, &query.device());
        let query = self.project_query(query, 0);
        self.attend(query, cache.key.clone(), cache.value.clone(), &plan)
    }

    /// [`forward_cross_cached`](Self::forward_cross_cached) for a ragged batch: the rows of
    /// `query` in runs, run `i` of `runs[i].0` rows over its own memory `runs[i].1` (a batch of
    /// one), every run's rows projected in and out together and each run's heads attended to
    /// its memory in place; on flex and ndarray outside autodiff the runs share rayon's
    /// threads.
    ///
    /// # Shapes
    ///
    /// - query: `[rows, d_model]`, `rows` the sum of the runs' rows
    /// - output: `[rows, d_model]`
    ///
    /// # Panics
    ///
    /// If `query` is not `[rows, d_model]` with the runs' rows, a run is empty, or a memory
    /// was projected by another module or holds a batch of more than one.
    pub(crate) fn forward_cross_runs(
        &self,
        query: Tensor<2>,
        runs: &[(usize, &CrossAttentionCache)],
    ) -> Tensor<2> {
        let rows: usize = runs.iter().map(|&(len, _)| len).sum();
        check_shape(
            "query",
            query.dims(),
            [("rows", Some(rows)), ("d_model", Some(self.d_model))],
        );
        let device = query.device();
        // One projection for every run: a cross-attention has no positions to rotate (a
        // module with RoPE or ALiBi projects no memory), so a run's place among the rows
        // changes nothing.
        let heads = self.project_query(query.reshape([1, rows, self.d_model]), 0);
        let mut start = 0;
        let pieces: Vec<_> = runs
            .iter()
            .map(|&(len, memory)| {
                self.check_cross_cache(memory);
                assert!(
                    len > 0 && memory.batch() == 1,
                    "MultiHeadAttention: a run of {len} rows over a memory of batch {}: each run \
                     needs rows, and a memory of its own",
                    memory.batch()
                );
                let run = heads.clone().narrow(2, start, len);
                start += len;
                (run, memory)
            })
            .collect();
        // On the CPU the runs share rayon's threads: each is small (a decoding row over one
        // memory), and run in turn most of them would leave a thread idle. Elsewhere (a GPU's
        // queue, autodiff's graph) one after the other.
        let parallel = native_storage(&device) && !device.is_autodiff();
        let contexts = map_in_parallel(pieces, parallel, |(run, memory)| {
            let [_, _, len, _] = run.dims();
            let plan = self.cross_plan(memory, 1, len, NeedWeights::No, &device);
            let (key, value) = (memory.key.clone(), memory.value.clone());
            self.attention_heads(run, key, value, &plan).0
        });
        self.output_projection(Tensor::cat(contexts, 2))
            .reshape([rows, self.d_model])
    }

    /// Panics unless this module projected `cache`.
    fn check_cross_cache(&self, cache: &CrossAttentionCache) {
        assert!(
            cache.owner == self.cache_owner(),
            "MultiHeadAttention: this cross-attention cache was projected by another module ({}), \
             not this one ({})",
            cache.owner,
            self.cache_owner()
        );
    }

    /// The plan of `seq_q` queries per batch element over the memory of `cache`.
    fn cross_plan(
        &self,
        cache: &CrossAttentionCache,
        batch: usize,
        seq_q: usize,
        need_weights: NeedWeights,
        device: &Device,
    ) -> Plan {
        let visibility = Visibility {
            key_padding: cache.key_padding_mask.clone(),
            extra_keys: self.extra_keys(),
            ..Visibility::nothing_hidden()
        };
        let geometry = self.geometry(batch, seq_q, cache.seq_k);
        self.plan(
            visibility,
            geometry,
            AttentionPath::Auto,
            need_weights,
            device,
        )
    }
}

/// How many positions `padding` (`[batch, keys]`, true where hidden) hides at the front of
/// each batch element, where that is all it hides and only stored ones (the first `stored`):
/// left padding. `None` for any other padding.
fn left_padding(padding: &Tensor<2, Bool>, stored: usize) -> Option<Vec<usize>> {
    let [batch, keys] = padding.dims();
    let flags = padding.clone().into_data().try_to_vec::<bool>().ok()?;
    (0..batch)
        .map(|element| {
            let row = &flags[element * keys..(element + 1) * keys];
            let hidden = row.iter().take_while(|&&hidden| hidden).count();
            (hidden <= stored && row[hidden..].iter().all(|&hidden| !hidden)).then_some(hidden)
        })
        .collect()
}

/// Whether a [`KvCache`] step may be computed by the in-place kernel, and its window.
#[derive(Debug, Clone, Copy)]
struct InPlaceStep {
    /// `Auto` path, no weights, no attention mask, no pinned keys (but a streaming window's
    /// one new row), causal (or one new row), at most [`IN_PLACE_ROWS`] new rows (more go to
    /// the flash kernel's matrix products, as a paged step's prompts do).
    plain: bool,
    /// The cache's and the module's window, the shorter (none for a streaming window's one
    /// new row, which sees every position the cache holds).
    window: Option<usize>,
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Tensor, TensorData};

    use super::*;
    use crate::config::MultiHeadAttentionConfig;

    /// The heads of a step of `new` tokens per batch element after `past` (RoPE at their
    /// positions).
    fn step_heads(
        module: &MultiHeadAttention,
        [batch, past, new]: [usize; 3],
        device: &Device,
    ) -> StepHeads {
        let x = Tensor::<3>::random([batch, new, 16], Distribution::Normal(0.0, 1.0), device);
        let sequences = Sequences {
            query: x.clone(),
            key: x.clone(),
            value: x,
        };
        let starts = RopeStarts {
            query: past,
            key: past,
        };
        let (query, key, value) = module.project(sequences, true, starts);
        StepHeads { query, key, value }
    }

    /// What `forward_cached` asks of a plain step over a compressed cache is computed in place
    /// for every option the kernel takes, a left-padded batch too (the integration tests hold
    /// its results to the widened cache's); float caches, empty caches, steps that are not
    /// plain, padding that is not at the front and f16 modules are left to the widened path.
    #[test]
    fn plain_steps_over_a_stored_compressed_cache_are_read_in_place() {
        let device = Device::flex();
        let base = MultiHeadAttentionConfig::new(16, 4).with_n_kv_heads(Some(2));
        let configs = [
            base.clone(),
            base.clone().with_alibi(true).with_softcap(Some(2.0)),
            base.clone()
                .with_window(Some(3))
                .with_attention_sinks(true)
                .with_rope(Some(crate::RopeConfig::new())),
            base.with_quiet_softmax(true),
        ];
        let plain = InPlaceStep {
            plain: true,
            window: None,
        };
        let (t, f) = (true, false);
        let mask = |flags: Vec<bool>| {
            Tensor::<2, Bool>::from_data(TensorData::new(flags, [2, 4]), &device)
        };
        let left = mask(vec![t, t, f, f, f, f, f, f]);
        let inside = mask(vec![f, t, f, f, f, f, f, f]);
        for config in configs {
            let module = config.init(&device);
            for storage in [CacheStorage::Int8, CacheStorage::Half, CacheStorage::Float] {
                let mut cache = KvCache::new().with_storage(storage);
                let heads = step_heads(&module, [2, 0, 3], &device);
                let read = |heads: &StepHeads, cache: &KvCache, step, padding| {
                    module.attend_in_place(heads, cache, step, padding)
                };
                assert!(
                    read(&heads, &cache, plain, None).is_none(),
                    "an empty cache"
                );
                let prompt =
                    Tensor::<3>::random([2, 3, 16], Distribution::Normal(0.0, 1.0), &device);
                module
                    .forward_cached(MhaInput::self_attn(prompt).causal(), &mut cache)
                    .unwrap();
                let heads = step_heads(&module, [2, 3, 1], &device);
                let compressed = storage != CacheStorage::Float;
                let context = read(&heads, &cache, plain, None);
                assert_eq!(context.is_some(), compressed, "{storage:?}: a plain step");
                if let Some(context) = context {
                    assert_eq!(context.dims(), [2, 4, 1, 4]);
                }
                let left_padded = read(&heads, &cache, plain, Some(&left));
                assert_eq!(
                    left_padded.is_some(),
                    compressed,
                    "{storage:?}: left padding"
                );
                let masked = InPlaceStep {
                    plain: false,
                    ..plain
                };
                assert!(read(&heads, &cache, masked, None).is_none(), "not plain");
                assert!(
                    read(&heads, &cache, plain, Some(&inside)).is_none(),
                    "inner padding"
                );
                let half_heads = StepHeads {
                    query: heads.query.clone().cast(burn::tensor::DType::F16),
                    ..heads
                };
                assert!(
                    read(&half_heads, &cache, plain, None).is_none(),
                    "an f16 module"
                );
            }
        }
    }

    /// Left padding of stored positions is counted per batch element; padding after an
    /// unhidden position, or of a new one, is not left padding.
    #[test]
    fn left_padding_counts_the_hidden_stored_positions_at_the_front() {
        let device = Device::flex();
        let mask = |flags: Vec<bool>, batch: usize| {
            let keys = flags.len() / batch;
            Tensor::<2, Bool>::from_data(
                burn::tensor::TensorData::new(flags, [batch, keys]),
                &device,
            )
        };
        let (t, f) = (true, false);
        let padding = mask(vec![t, t, f, f, f, f, f, f, t, f, f, f], 3);
        assert_eq!(left_padding(&padding, 3), Some(vec![2, 0, 1]));
        assert_eq!(
            left_padding(&padding, 1),
            None,
            "a hidden position not stored"
        );
        assert_eq!(left_padding(&mask(vec![f, t, f, f], 1), 3), None);
        assert_eq!(left_padding(&mask(vec![f, f, f, t], 1), 3), None);
    }
}
