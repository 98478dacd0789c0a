//! A compressed `KvCache` (f16 or int8) read in place by a decoding step on flex and ndarray:
//! every step gives what the same cache widened to f32 gives it (`AttentionPath::Flash`, which
//! attends to the widened copy), through windows, sinks, soft caps, ALiBi, RoPE, grouped heads,
//! batches, several new rows at once and steps the in-place kernel leaves to the widened path.

mod common;

use burn::tensor::{Bool, DType, Device, Tensor, TensorData};
use common::{assert_close, device_by_name, randn, window_softcap_sinks, with_random_sinks};
use mha::{
    AttentionPath, BlockSizes, CacheLimit, CacheStorage, KvCache, MhaInput, MultiHeadAttention,
    MultiHeadAttentionConfig, RopeConfig,
};

const D_MODEL: usize = 32;

fn configs() -> Vec<(&'static str, MultiHeadAttentionConfig)> {
    let base = MultiHeadAttentionConfig::new(D_MODEL, 4);
    vec![
        (
            "gqa+rope",
            base.clone()
                .with_n_kv_heads(Some(2))
                .with_rope(Some(RopeConfig::new())),
        ),
        ("mha", base.clone()),
        (
            "mqa+alibi",
            base.clone().with_n_kv_heads(Some(1)).with_alibi(true),
        ),
        ("gqa+window+softcap+sinks", window_softcap_sinks(D_MODEL, 5)),
        ("quiet", base.clone().with_quiet_softmax(true)),
        // Heads 16 wide: the kernel's AVX-512 path (whole 16-position parts).
        (
            "gqa, head_dim 16",
            MultiHeadAttentionConfig::new(64, 4).with_n_kv_heads(Some(2)),
        ),
    ]
}

/// The storages a device holds besides f32: f16 on flex, int8 on both.
fn compressed_storages(device: &Device) -> Vec<CacheStorage> {
    let mut storages = vec![CacheStorage::Int8];
    if device.supports_dtype(DType::F16) {
        storages.push(CacheStorage::Half);
    }
    storages
}

/// One cache read in place and one widened, fed the same steps; each step's outputs equal.
struct Pair<'a> {
    module: &'a MultiHeadAttention,
    in_place: KvCache,
    widened: KvCache,
    label: String,
}

impl<'a> Pair<'a> {
    fn new(module: &'a MultiHeadAttention, cache: KvCache, label: String) -> Self {
        Self {
            module,
            in_place: cache.clone(),
            widened: cache,
            label,
        }
    }

    /// A step of `x` (`[batch, new, d_model]`), `shape` making the input (causal, masks).
    fn step(&mut self, x: Tensor<3>, shape: impl Fn(MhaInput) -> MhaInput) {
        let new = x.dims()[1];
        let in_place = self
            .module
            .forward_cached(shape(MhaInput::self_attn(x.clone())), &mut self.in_place)
            .unwrap()
            .context;
        let widened = self
            .module
            .forward_cached(
                shape(MhaInput::self_attn(x)).path(AttentionPath::Flash(BlockSizes::default())),
                &mut self.widened,
            )
            .unwrap()
            .context;
        assert_close(
            &format!(
                "{}: a step of {new} after {}",
                self.label,
                self.in_place.len()
            ),
            in_place,
            widened,
            1e-5,
        );
        assert_eq!(self.in_place.len(), self.widened.len(), "{}", self.label);
        assert_eq!(
            self.in_place.bytes(),
            self.widened.bytes(),
            "{}",
            self.label
        );
    }
}

#[test]
fn a_compressed_cache_read_in_place_equals_it_widened() {
    for name in ["flex", "ndarray"] {
        let device = device_by_name(name).unwrap();
        let _seed = common::seed(&device, 61);
        for (label, config) in configs() {
            let module = config.init(&device);
            let d_model = module.d_model();
            for storage in compressed_storages(&device) {
                let cache = match module.window() {
                    Some(window) => KvCache::with_limit(CacheLimit::SlidingWindow(window)),
                    None => KvCache::new(),
                }
                .with_storage(storage);
                let mut pair = Pair::new(&module, cache, format!("{name} {label} {storage:?}"));
                let causal = |input: MhaInput| input.causal();
                // A prompt (the widened path: nothing stored yet), then decoding steps, a
                // causal step of 3 new rows, a step of 40 (left to the widened path) and more
                // decoding, across 88 positions: past a window of 5, over tiles of 64.
                for new in [7, 1, 1, 3, 1, 40, 1, 2, 1, 30, 1] {
                    pair.step(randn([2, new, d_model], &device), causal);
                }
                // One new row attends to everything without `causal` too.
                pair.step(randn([2, 1, d_model], &device), |input| input);
            }
        }
    }
}

/// Left-padded prompts of `prompt` positions, the first `hidden[element]` of each element
/// padding, then causal steps of `steps` new rows, each read in place as the widened cache
/// gives it, on both CPU backends, in every configuration and compressed storage.
fn left_padded_prompts_then_steps(
    configs: &[(&str, MultiHeadAttentionConfig)],
    seed: u64,
    hidden: &[usize],
    prompt: usize,
    steps: &[usize],
) {
    let batch = hidden.len();
    for name in ["flex", "ndarray"] {
        let device = device_by_name(name).unwrap();
        let _seed = common::seed(&device, seed);
        for (label, config) in configs {
            let module = with_random_sinks(config.init(&device), &device);
            let d_model = module.d_model();
            for storage in compressed_storages(&device) {
                let cache = KvCache::new().with_storage(storage);
                let mut pair = Pair::new(&module, cache, format!("{name} {label} {storage:?}"));
                let flags = hidden
                    .iter()
                    .flat_map(|&hidden| (0..prompt).map(move |position| position < hidden))
                    .collect();
                let padding =
                    Tensor::<2, Bool>::from_data(TensorData::new(flags, [batch, prompt]), &device);
                pair.step(randn([batch, prompt, d_model], &device), |input| {
                    input.causal().key_padding_mask(padding.clone())
                });
                for &new in steps {
                    pair.step(randn([batch, new, d_model], &device), |input| {
                        input.causal()
                    });
                }
            }
        }
    }
}

/// A batch of prompts of different lengths, left-padded: the decoding steps after it read
/// the cache in place with each element's padding hidden, as the widened cache gives them.
#[test]
fn a_left_padded_batch_is_read_in_place_as_it_is_widened() {
    // The second prompt is 3 tokens shorter; a third, 6 shorter still.
    left_padded_prompts_then_steps(&configs(), 63, &[0, 3, 9], 12, &[1, 1, 2, 1]);
}

/// A cache of more than 2048 positions is read by several tasks per batch element, a part of
/// its positions each, whose softmaxes are merged: as the widened cache gives them.
#[test]
fn a_long_compressed_cache_read_in_parts_equals_it_widened() {
    // The first element's 2300 positions are read in two parts, the second's 1600 in one; a
    // window of 2100 has the first element's rows see positions of both parts.
    let mut configs = configs();
    configs.push((
        "gqa+window 2100+softcap+sinks",
        window_softcap_sinks(D_MODEL, 2100),
    ));
    left_padded_prompts_then_steps(&configs, 62, &[0, 700], 2300, &[1, 3, 1]);
}

/// Steps the in-place kernel does not take (padding of new keys, an attention mask) go to
/// the widened cache and still give its results, and the steps after them are right too.
#[test]
fn masked_steps_are_widened_and_the_steps_after_them_stay_right() {
    let device = Device::flex();
    let _seed = common::seed(&device, 62);
    let module = MultiHeadAttentionConfig::new(D_MODEL, 4)
        .with_n_kv_heads(Some(2))
        .init(&device);
    for storage in compressed_storages(&device) {
        let cache = KvCache::new().with_storage(storage);
        let mut pair = Pair::new(&module, cache, format!("{storage:?}"));
        pair.step(randn([2, 6, D_MODEL], &device), |input| input.causal());
        pair.step(randn([2, 1, D_MODEL], &device), |input| input.causal());
        // A new key hidden: not left padding.
        let padding = Tensor::<2, Bool>::from_data(
            TensorData::new(vec![false, true, false, false], [2, 2]),
            &device,
        );
        pair.step(randn([2, 2, D_MODEL], &device), |input| {
            input.causal().key_padding_mask(padding.clone())
        });
        // The padding is remembered: it hides a position after unhidden ones.
        pair.step(randn([2, 1, D_MODEL], &device), |input| input.causal());
        let mut fresh = Pair::new(&module, KvCache::new().with_storage(storage), "mask".into());
        fresh.step(randn([1, 4, D_MODEL], &device), |input| input.causal());
        let mask = Tensor::<2, Bool>::from_data(
            TensorData::new(vec![false, true, false, false, false], [1, 5]),
            &device,
        );
        fresh.step(randn([1, 1, D_MODEL], &device), |input| {
            input.attn_mask(mask.clone())
        });
        fresh.step(randn([1, 1, D_MODEL], &device), |input| input.causal());
    }
}

/// A streaming window's compressed cache evicts in place, moving its sinks next to its
/// window, and reads what it keeps out of its tiles: every step gives what a cache that keeps
/// every position gives under the window's mask (over every position fed), past 64 evicted
/// positions and over a batch.
#[test]
fn a_streaming_window_evicting_in_tiles_equals_the_masked_full_cache() {
    let device = Device::flex();
    let _seed = common::seed(&device, 67);
    let (sinks, window) = (3, 6);
    // Row `q` (of the positions fed) may not see key `k`: after it, or between the sinks and
    // the window.
    let hidden = |q: usize, k: usize| k > q || (k >= sinks && k + window <= q);
    let gqa_rope = MultiHeadAttentionConfig::new(D_MODEL, 4)
        .with_n_kv_heads(Some(2))
        .with_rope(Some(RopeConfig::new()));
    // ALiBi measures from the sinks' first positions, wherever the cache keeps them.
    let alibi = MultiHeadAttentionConfig::new(D_MODEL, 4).with_alibi(true);
    for (config, storage) in [gqa_rope, alibi].into_iter().flat_map(|config| {
        compressed_storages(&device)
            .into_iter()
            .map(move |s| (config.clone(), s))
    }) {
        let module = config.init(&device);
        let mut streaming = KvCache::with_limit(CacheLimit::StreamingWindow { sinks, window })
            .with_storage(storage);
        let mut every = KvCache::new().with_storage(storage);
        let mut fed = 0;
        for (step, new) in [5, 1, 1, 2, 30, 1, 40, 1, 1].into_iter().enumerate() {
            let x = randn([2, new, D_MODEL], &device);
            let flags: Vec<bool> = (fed..fed + new)
                .flat_map(|q| (0..fed + new).map(move |k| hidden(q, k)))
                .collect();
            let mask =
                Tensor::<2, Bool>::from_data(TensorData::new(flags, [new, fed + new]), &device);
            let expected = module
                .forward_cached(MhaInput::self_attn(x.clone()).attn_mask(mask), &mut every)
                .unwrap()
                .context;
            let actual = module
                .forward_cached(MhaInput::self_attn(x).causal(), &mut streaming)
                .unwrap()
                .context;
            fed += new;
            assert_close(
                &format!("{storage:?}: step {step} of {new}"),
                actual,
                expected,
                1e-5,
            );
        }
        assert_eq!(streaming.stored(), sinks + window - 1);
    }
}
