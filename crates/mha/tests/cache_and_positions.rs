//! KV cache, RoPE, ALiBi and the chunked and flash paths, on every test device.

mod common;

use burn::tensor::{Bool, Device, Tensor, TensorData};
use common::{assert_close, randn, test_devices, tolerance};
use mha::{
    AttentionPath, BlockSizes, CacheError, CacheLimit, CacheStorage, KvCache, MhaInput,
    MultiHeadAttention, MultiHeadAttentionConfig, NeedWeights, RopeConfig, RopeLayout,
    flash_attention_supported,
};

fn configs() -> Vec<(&'static str, MultiHeadAttentionConfig)> {
    let base = MultiHeadAttentionConfig::new(16, 4);
    vec![
        ("mha", base.clone()),
        ("gqa", base.clone().with_n_kv_heads(Some(2))),
        ("mqa", base.clone().with_n_kv_heads(Some(1))),
        ("mha+rope", base.clone().with_rope(Some(RopeConfig::new()))),
        (
            "gqa+rope-half",
            base.clone()
                .with_n_kv_heads(Some(2))
                .with_rope(Some(RopeConfig::new().with_layout(RopeLayout::HalfSplit))),
        ),
        (
            "mqa+alibi",
            base.clone().with_n_kv_heads(Some(1)).with_alibi(true),
        ),
        (
            "gqa+window+softcap+sinks",
            base.clone()
                .with_n_kv_heads(Some(2))
                .with_window(Some(3))
                .with_softcap(Some(2.0))
                .with_attention_sinks(true),
        ),
        (
            "bias_kv+zero_attn",
            base.with_add_bias_kv(true).with_add_zero_attn(true),
        ),
    ]
}

/// Feeds `x` in steps of `chunks` tokens and concatenates the outputs.
fn decode(
    module: &MultiHeadAttention,
    x: &Tensor<3>,
    chunks: &[usize],
    cache: &mut KvCache,
) -> Tensor<3> {
    let mut outputs = Vec::new();
    let mut start = 0;
    for &length in chunks {
        let step = x.clone().narrow(1, start, length);
        let output = module
            .forward_cached(MhaInput::self_attn(step).causal(), cache)
            .expect("within limits");
        outputs.push(output.context);
        start += length;
    }
    Tensor::cat(outputs, 1)
}

#[test]
fn cached_decoding_in_any_steps_equals_one_causal_forward() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 11);
        for (label, config) in configs() {
            let module = config.init(&device);
            let x = randn([2, 9, 16], &device);
            let full = module
                .forward(MhaInput::self_attn(x.clone()).causal())
                .context;
            for chunks in [vec![1; 9], vec![3, 1, 5], vec![9]] {
                let mut cache = KvCache::new();
                let decoded = decode(&module, &x, &chunks, &mut cache);
                assert_eq!(cache.len(), 9);
                assert_close(
                    &format!("{name} {label} chunks {chunks:?}"),
                    decoded,
                    full.clone(),
                    tolerance(name),
                );
            }
        }
    }
}

#[test]
fn cached_padding_covers_cached_and_new_keys() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 12);
        let module = MultiHeadAttentionConfig::new(8, 2).init(&device);
        let x = randn([2, 5, 8], &device);
        let padding = Tensor::<2, Bool>::from_data(
            [
                [false, true, false, false, false],
                [false, false, false, true, false],
            ],
            &device,
        );
        let full = module
            .forward(
                MhaInput::self_attn(x.clone())
                    .causal()
                    .key_padding_mask(padding.clone()),
            )
            .context;
        // Masks of the new keys only, remembered by the cache...
        let mut cache = KvCache::new();
        let mut outputs = Vec::new();
        for (start, length) in [(0, 2), (2, 3)] {
            let step = MhaInput::self_attn(x.clone().narrow(1, start, length))
                .causal()
                .key_padding_mask(padding.clone().narrow(1, start, length));
            outputs.push(module.forward_cached(step, &mut cache).unwrap().context);
        }
        assert_close(
            &format!("{name}: new-key masks"),
            Tensor::cat(outputs, 1),
            full.clone(),
            tolerance(name),
        );
        // ...or of cached plus new keys.
        let mut cache = KvCache::new();
        let first = module
            .forward_cached(
                MhaInput::self_attn(x.clone().narrow(1, 0, 2))
                    .causal()
                    .key_padding_mask(padding.clone().narrow(1, 0, 2)),
                &mut cache,
            )
            .unwrap()
            .context;
        let second = module
            .forward_cached(
                MhaInput::self_attn(x.clone().narrow(1, 2, 3))
                    .causal()
                    .key_padding_mask(padding.clone()),
                &mut cache,
            )
            .unwrap()
            .context;
        assert_close(
            &format!("{name}: full-width masks"),
            Tensor::cat(vec![first, second], 1),
            full,
            tolerance(name),
        );
    }
}

/// `true` where key `k` is outside query `q`'s causal window of `window` positions.
fn band_mask(seq: usize, window: usize, device: &Device) -> Tensor<2, Bool> {
    let values: Vec<bool> = (0..seq)
        .flat_map(|q| (0..seq).map(move |k| k > q || k + window <= q))
        .collect();
    Tensor::from_data(TensorData::new(values, [seq, seq]), device)
}

#[test]
fn sliding_window_cache_equals_banded_attention_and_evicts() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 13);
        let module = MultiHeadAttentionConfig::new(8, 2)
            .with_rope(Some(RopeConfig::new()))
            .init(&device);
        let x = randn([1, 72, 8], &device);
        // A window of 1 keeps nothing between steps (it panicked concatenating no positions).
        for window in [4, 1] {
            let full = module
                .forward(MhaInput::self_attn(x.clone()).attn_mask(band_mask(72, window, &device)))
                .context;
            // The evicted positions left in the buffer pass 64 (when the cache moves what it
            // keeps to the front) in one step, and over several.
            for chunks in [
                [vec![1; 10], vec![62]].concat(),
                vec![3, 1, 4, 2, 30, 20, 10, 1, 1],
            ] {
                let mut cache = KvCache::with_limit(CacheLimit::SlidingWindow(window));
                let decoded = decode(&module, &x, &chunks, &mut cache);
                assert!(
                    cache.stored() < window,
                    "{name}: evicted down to window - 1"
                );
                assert_eq!(cache.len(), 72);
                assert_close(
                    &format!("{name}: sliding window {window} {chunks:?}"),
                    decoded,
                    full.clone(),
                    tolerance(name),
                );
            }
        }
    }
}

/// A window of 1 keeps no position between steps, and still refuses a batch size change (it
/// read the batch from the stored keys, and had none to read).
#[test]
fn a_window_of_one_stores_nothing_and_still_refuses_a_batch_change() {
    let device = Device::flex();
    let module = MultiHeadAttentionConfig::new(8, 2).init(&device);
    for limit in [
        CacheLimit::SlidingWindow(1),
        CacheLimit::StreamingWindow {
            sinks: 0,
            window: 1,
        },
    ] {
        let mut cache = KvCache::with_limit(limit);
        module
            .forward_cached(
                MhaInput::self_attn(randn([2, 3, 8], &device)).causal(),
                &mut cache,
            )
            .unwrap();
        assert_eq!((cache.len(), cache.stored(), cache.bytes()), (3, 0, 0));
        let other_batch =
            module.forward_cached(MhaInput::self_attn(randn([3, 1, 8], &device)), &mut cache);
        assert_eq!(
            other_batch.unwrap_err(),
            CacheError::BatchChanged { cached: 2, new: 3 },
            "{limit:?}"
        );
    }
}

/// A cache's clone goes its own way: appending in place into one never writes into the
/// other's buffers (flex copies a shared buffer before writing), in f32 and int8.
#[test]
fn a_cloned_cache_and_its_original_append_independently() {
    let device = Device::flex();
    let _seed = common::seed(&device, 27);
    let module = MultiHeadAttentionConfig::new(16, 4)
        .with_n_kv_heads(Some(2))
        .init(&device);
    let step = |x: &Tensor<3>, cache: &mut KvCache| {
        module
            .forward_cached(MhaInput::self_attn(x.clone()).causal(), cache)
            .unwrap()
            .context
    };
    let (prompt, first, other, next) = (
        randn([1, 4, 16], &device),
        randn([1, 1, 16], &device),
        randn([1, 1, 16], &device),
        randn([1, 1, 16], &device),
    );
    for storage in [CacheStorage::Float, CacheStorage::Int8] {
        let mut original = KvCache::new().with_storage(storage);
        step(&prompt, &mut original);
        let mut clone = original.clone();
        // The clone appends `first`, then the original appends `other` at the same position.
        step(&first, &mut clone);
        step(&other, &mut original);
        let mut reference = KvCache::new().with_storage(storage);
        step(&prompt, &mut reference);
        step(&first, &mut reference);
        assert_close(
            &format!("{storage:?}: the clone after the original appended"),
            step(&next, &mut clone),
            step(&next, &mut reference),
            1e-6,
        );
    }
}

#[test]
fn capacity_and_batch_changes_are_refused_and_leave_the_cache_unchanged() {
    let device = Device::flex();
    let module = MultiHeadAttentionConfig::new(8, 2).init(&device);
    let mut cache = KvCache::with_limit(CacheLimit::Fixed(4));
    module
        .forward_cached(
            MhaInput::self_attn(randn([2, 3, 8], &device)).causal(),
            &mut cache,
        )
        .unwrap();
    let too_many =
        module.forward_cached(MhaInput::self_attn(randn([2, 2, 8], &device)), &mut cache);
    assert_eq!(
        too_many.unwrap_err(),
        CacheError::CapacityExceeded {
            capacity: 4,
            cached: 3,
            new: 2
        }
    );
    let other_batch =
        module.forward_cached(MhaInput::self_attn(randn([3, 1, 8], &device)), &mut cache);
    let error = other_batch.unwrap_err();
    assert_eq!(error, CacheError::BatchChanged { cached: 2, new: 3 });
    assert!(
        error
            .to_string()
            .contains("batch size changed mid-sequence")
    );
    let bad_padding = module.forward_cached(
        MhaInput::self_attn(randn([2, 1, 8], &device))
            .key_padding_mask(Tensor::zeros([2, 2], &device)),
        &mut cache,
    );
    assert_eq!(
        bad_padding.unwrap_err(),
        CacheError::PaddingWidth {
            width: 2,
            cached: 3,
            fed: 3,
            new: 1
        }
    );
    assert_eq!(
        (cache.len(), cache.stored()),
        (3, 3),
        "refused steps change nothing"
    );
    module
        .forward_cached(MhaInput::self_attn(randn([2, 1, 8], &device)), &mut cache)
        .unwrap();
    assert_eq!(cache.len(), 4);
    cache.reset();
    assert!(cache.is_empty());
}

#[test]
fn cross_attention_cache_projects_the_memory_once_and_matches_forward() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 14);
        let module = MultiHeadAttentionConfig::new(12, 3)
            .with_n_kv_heads(Some(1))
            .with_d_key_input(Some(5))
            .with_d_value_input(Some(7))
            .with_add_zero_attn(true)
            .init(&device);
        let memory_keys = randn([2, 6, 5], &device);
        let memory_values = randn([2, 6, 7], &device);
        let padding = Tensor::<2, Bool>::from_data(
            [[false; 6], [false, false, false, false, true, true]],
            &device,
        );
        let cache = module
            .cross_attention_cache(memory_keys.clone(), memory_values.clone())
            .with_key_padding_mask(padding.clone());
        let queries = randn([2, 4, 12], &device);
        for step in 0..4 {
            let query = queries.clone().narrow(1, step, 1);
            let cached = module.forward_cross_cached(query.clone(), &cache, NeedWeights::PerHead);
            let direct = module.forward(
                MhaInput::new(query, memory_keys.clone(), memory_values.clone())
                    .key_padding_mask(padding.clone())
                    .need_weights(NeedWeights::PerHead),
            );
            assert_close(
                &format!("{name} step {step}"),
                cached.context,
                direct.context,
                tolerance(name),
            );
            assert_close(
                &format!("{name} step {step} weights"),
                cached.weights.unwrap().per_head().unwrap(),
                direct.weights.unwrap().per_head().unwrap(),
                tolerance(name),
            );
        }
    }
}

#[test]
fn rope_scores_depend_only_on_the_distance() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 15);
        for layout in [RopeLayout::Interleaved, RopeLayout::HalfSplit] {
            let rope = RopeConfig::new().with_layout(layout);
            let q = randn([1, 1, 1, 8], &device);
            let k = randn([1, 1, 1, 8], &device);
            let score = |m: usize, n: usize| {
                (rope.apply(q.clone(), m) * rope.apply(k.clone(), n))
                    .sum()
                    .into_scalar::<f32>()
            };
            for (m, n, shift) in [(5, 2, 7), (0, 3, 11), (9, 9, 4)] {
                let (a, b) = (score(m, n), score(m + shift, n + shift));
                assert!((a - b).abs() < 1e-4, "{name} {layout:?}: {a} vs {b}");
            }
            assert!(
                (score(5, 2) - score(2, 5)).abs() > 1e-3,
                "{name} {layout:?}: sign of m - n matters"
            );
        }
    }
}

#[test]
fn chunked_path_equals_explicit_path() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 16);
        let module = MultiHeadAttentionConfig::new(16, 4)
            .with_n_kv_heads(Some(2))
            .with_add_bias_kv(true)
            .with_alibi(true)
            .init(&device);
        let query = randn([2, 11, 16], &device);
        let memory = randn([2, 13, 16], &device);
        let padding = Tensor::<2, Bool>::from_data(
            [
                [false; 13],
                [
                    false, false, true, false, false, false, false, false, false, true, true, true,
                    true,
                ],
            ],
            &device,
        );
        let bias = randn([2, 4, 11, 13], &device);
        let inputs = [
            (
                "plain",
                MhaInput::new(query.clone(), memory.clone(), memory.clone()),
            ),
            (
                "padding+causal",
                MhaInput::new(query.clone(), memory.clone(), memory.clone())
                    .key_padding_mask(padding.clone())
                    .causal(),
            ),
            (
                "float mask",
                MhaInput::new(query.clone(), memory.clone(), memory.clone()).attn_mask(bias),
            ),
            ("self causal", MhaInput::self_attn(query.clone()).causal()),
        ];
        for (label, input) in inputs {
            let explicit = module
                .forward(input.clone().path(AttentionPath::Explicit))
                .context;
            for sizes in [
                BlockSizes { query: 4, key: 5 },
                BlockSizes { query: 1, key: 3 },
                BlockSizes::default(),
            ] {
                let chunked = module
                    .forward(input.clone().path(AttentionPath::Chunked(sizes)))
                    .context;
                assert_close(
                    &format!("{name} {label} {sizes:?}"),
                    chunked,
                    explicit.clone(),
                    tolerance(name),
                );
            }
        }
    }
}

/// The flash kernel's custom backward, and autodiff through the chunked path, against autodiff
/// through the explicit path: the context and the gradients of the inputs and of every
/// parameter. Once with keys appended (`add_bias_kv`, which moves the causal mask into the
/// bool mask) and once without (the kernels' own causal handling).
#[test]
fn flash_and_chunked_paths_equal_the_explicit_path_in_outputs_and_gradients() {
    for (name, device) in test_devices() {
        let device = device.autodiff();
        let _seed = common::seed(&device, 18);
        let appended = MultiHeadAttentionConfig::new(16, 4)
            .with_n_kv_heads(Some(2))
            .with_add_bias_kv(true)
            .with_alibi(true)
            .with_rope(Some(RopeConfig::new()))
            .init(&device);
        let plain = MultiHeadAttentionConfig::new(16, 4)
            .with_n_kv_heads(Some(2))
            .with_scale(Some(0.4))
            .init(&device);
        let inputs = GradientInputs::new(&device);
        for (module_label, module) in [("appended keys", &appended), ("no appended keys", &plain)] {
            // lavapipe compiles a kernel per new shape: one block size there.
            let block_sizes = match name {
                "wgpu" => vec![BlockSizes { query: 4, key: 5 }],
                _ => vec![
                    BlockSizes { query: 4, key: 5 },
                    BlockSizes { query: 1, key: 3 },
                    BlockSizes::default(),
                ],
            };
            for blocks in block_sizes {
                let mut paths = vec![AttentionPath::Chunked(blocks)];
                if flash_attention_supported(&device) {
                    paths.push(AttentionPath::Flash(blocks));
                }
                for (case, _) in GradientInputs::CASES {
                    let explicit = inputs.run(module, case, AttentionPath::Explicit);
                    for &path in &paths {
                        let actual = inputs.run(module, case, path);
                        for ((what, expected), (_, actual)) in explicit.iter().zip(actual) {
                            // Outputs as tight as every other path; gradients sum over more
                            // terms.
                            let bound = if *what == "context" {
                                tolerance(name)
                            } else {
                                1e-4
                            };
                            assert_close(
                                &format!("{name} {module_label} {case} {path:?}: {what}"),
                                actual,
                                expected.clone(),
                                bound,
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The inputs of the gradient comparisons: query, memory, masks.
struct GradientInputs {
    query: Tensor<3>,
    memory: Tensor<3>,
    short: Tensor<3>,
    padding: Tensor<2, Bool>,
    all_padded: Tensor<2, Bool>,
    bias: Tensor<4>,
}

impl GradientInputs {
    /// Each case and what it exercises.
    const CASES: [(&'static str, &'static str); 5] = [
        ("float mask", "a float attention mask, cross-attention"),
        (
            "padding+causal",
            "key padding with fully padded keys at the end, causal",
        ),
        ("self causal", "causal self-attention"),
        (
            "causal, seq_q > seq_k",
            "more queries than keys: the first see no key",
        ),
        (
            "causal, seq_q < seq_k",
            "fewer queries than keys: bottom-right alignment",
        ),
    ];

    fn new(device: &Device) -> Self {
        let mut padding = vec![false; 2 * 13];
        for key in [2, 9, 10, 11, 12] {
            padding[13 + key] = true;
        }
        Self {
            query: randn([2, 11, 16], device),
            memory: randn([2, 13, 16], device),
            short: randn([2, 5, 16], device),
            padding: Tensor::from_data(TensorData::new(padding, [2, 13]), device),
            all_padded: Tensor::from_data(
                TensorData::new([vec![false; 13], vec![true; 13]].concat(), [2, 13]),
                device,
            ),
            bias: randn([2, 4, 11, 13], device),
        }
    }

    /// The context and every gradient, flattened and named.
    fn run(
        &self,
        module: &MultiHeadAttention,
        case: &str,
        path: AttentionPath,
    ) -> Vec<(&'static str, Tensor<1>)> {
        let query = self.query.clone().detach().require_grad();
        let memory = match case {
            "self causal" => None,
            "causal, seq_q > seq_k" => Some(self.short.clone()),
            "causal, seq_q < seq_k" => Some(self.memory.clone()),
            _ => Some(self.memory.clone()),
        }
        .map(|memory| memory.detach().require_grad());
        let query_input = match case {
            "causal, seq_q < seq_k" => query.clone().narrow(1, 0, 6),
            _ => query.clone(),
        };
        let mut input = match &memory {
            Some(memory) => MhaInput::new(query_input, memory.clone(), memory.clone()),
            None => MhaInput::self_attn(query_input),
        };
        input = match case {
            "float mask" => input.attn_mask(self.bias.clone()),
            "padding+causal" => input.key_padding_mask(self.padding.clone()).causal(),
            "fully padded" => input.key_padding_mask(self.all_padded.clone()),
            _ => input.causal(),
        };
        let context = module.forward(input.path(path)).context;
        // A loss whose gradient differs from element to element.
        let grads = (context.clone() * context.clone().sin()).sum().backward();
        let flat = |tensor: Tensor<2>| tensor.reshape([-1]);
        let mut named = vec![
            ("context", context.inner().reshape([-1])),
            ("d query", query.grad(&grads).unwrap().reshape([-1])),
            ("d W_q", flat(module.query.weight.grad(&grads).unwrap())),
            ("d W_k", flat(module.key.weight.grad(&grads).unwrap())),
            ("d W_v", flat(module.value.weight.grad(&grads).unwrap())),
            ("d W_o", flat(module.output.weight.grad(&grads).unwrap())),
        ];
        if let Some(bias_k) = &module.bias_k {
            named.push(("d bias_k", bias_k.grad(&grads).unwrap()));
        }
        if let Some(memory) = &memory {
            named.push(("d memory", memory.grad(&grads).unwrap().reshape([-1])));
        }
        named
    }
}

/// Large enough that the native flash kernel spreads heads over threads (small calls, such as
/// decoding steps, run on the calling thread).
#[test]
fn flash_path_equals_explicit_path_on_threads() {
    for (name, device) in test_devices() {
        let device = device.autodiff();
        if !flash_attention_supported(&device) {
            continue;
        }
        let _seed = common::seed(&device, 19);
        let module = MultiHeadAttentionConfig::new(64, 4)
            .with_n_kv_heads(Some(2))
            .init(&device);
        let x = randn([2, 160, 64], &device);
        let mut padding = vec![false; 2 * 160];
        padding[160 + 150..].fill(true);
        let padding = Tensor::<2, Bool>::from_data(TensorData::new(padding, [2, 160]), &device);
        let run = |path: AttentionPath| {
            let x = x.clone().detach().require_grad();
            let context = module
                .forward(
                    MhaInput::self_attn(x.clone())
                        .causal()
                        .key_padding_mask(padding.clone())
                        .path(path),
                )
                .context;
            let grads = (context.clone() * context.clone().sin()).sum().backward();
            [
                context.inner().reshape([-1]),
                x.grad(&grads).unwrap().reshape([-1]),
                module.key.weight.grad(&grads).unwrap().reshape([-1]),
                module.value.weight.grad(&grads).unwrap().reshape([-1]),
            ]
        };
        let explicit = run(AttentionPath::Explicit);
        let flash = run(AttentionPath::Flash(BlockSizes::default()));
        for (what, (expected, actual)) in ["context", "d x", "d W_k", "d W_v"]
            .into_iter()
            .zip(explicit.into_iter().zip(flash))
        {
            let bound = if what == "context" {
                tolerance(name)
            } else {
                1e-4
            };
            assert_close(&format!("{name}: {what}"), actual, expected, bound);
        }
    }
}

/// Where a forced kernel cannot run, forcing it says so; `Auto` trains on another path.
#[test]
fn forced_paths_are_refused_clearly_where_they_cannot_run() {
    let device = Device::flex();
    for config in [
        MultiHeadAttentionConfig::new(8, 2).with_quiet_softmax(true),
        MultiHeadAttentionConfig::new(8, 2).with_attention_sinks(true),
    ] {
        let module = config.init(&device);
        let x = randn([1, 3, 8], &device);
        let message = common::panic_message(|| {
            module.forward(MhaInput::self_attn(x.clone()).path(AttentionPath::Fused))
        });
        assert!(
            message.contains("`AttentionPath::Fused` was forced but the softmax has a sink"),
            "{message}"
        );
    }
    for (name, device) in test_devices() {
        if flash_attention_supported(&device) {
            continue;
        }
        let device = device.autodiff();
        let module = MultiHeadAttentionConfig::new(8, 2).init(&device);
        let x = randn([1, 3, 8], &device);
        let message = common::panic_message(|| {
            module.forward(
                MhaInput::self_attn(x.clone()).path(AttentionPath::Flash(BlockSizes::default())),
            )
        });
        assert!(message.contains("has no flash kernel"), "{name}: {message}");
        let context = module.forward(MhaInput::self_attn(x).causal()).context;
        assert_eq!(context.dims(), [1, 3, 8], "{name}: `Auto` still trains");
    }
}

#[test]
fn alibi_and_rope_positions_follow_the_cache() {
    // The same module, fed a prefix then one token, equals the full forward's last row.
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 17);
        let module = MultiHeadAttentionConfig::new(8, 2)
            .with_alibi(true)
            .with_rope(Some(RopeConfig::new()))
            .init(&device);
        let x = randn([1, 6, 8], &device);
        let full = module
            .forward(MhaInput::self_attn(x.clone()).causal())
            .context;
        let mut cache = KvCache::new();
        decode(&module, &x, &[5], &mut cache);
        let last = module
            .forward_cached(MhaInput::self_attn(x.narrow(1, 5, 1)).causal(), &mut cache)
            .unwrap()
            .context;
        assert_close(
            &format!("{name}: last token"),
            last,
            full.narrow(1, 5, 1),
            tolerance(name),
        );
    }
}

/// A cache belongs to the module that filled it: another module (other head widths or counts,
/// or the same sizes with other weights) is refused with a message, never handed keys of
/// another shape.
#[test]
fn a_cache_filled_by_one_module_is_refused_by_another() {
    let device = Device::flex();
    let owner = MultiHeadAttentionConfig::new(16, 4).init(&device);
    let others = [
        (
            "wider heads",
            MultiHeadAttentionConfig::new(16, 2).init(&device),
        ),
        (
            "fewer query heads than the cache's key/value heads",
            MultiHeadAttentionConfig::new(16, 2)
                .with_n_kv_heads(Some(1))
                .init(&device),
        ),
        (
            "same sizes, other weights",
            MultiHeadAttentionConfig::new(16, 4).init(&device),
        ),
    ];
    let memory = randn([1, 5, 16], &device);
    let cross = owner.cross_attention_cache(memory.clone(), memory.clone());
    let mut cache = KvCache::new();
    owner
        .forward_cached(
            MhaInput::self_attn(randn([1, 2, 16], &device)).causal(),
            &mut cache,
        )
        .unwrap();
    for (label, other) in others {
        let message = common::panic_message(|| {
            other.forward_cross_cached(randn([1, 1, 16], &device), &cross, NeedWeights::No)
        });
        assert!(
            message.contains("projected by another module"),
            "{label}: {message}"
        );
        let step =
            other.forward_cached(MhaInput::self_attn(randn([1, 1, 16], &device)), &mut cache);
        let error = step.expect_err(label);
        assert!(
            matches!(error, CacheError::OtherModule { .. }),
            "{label}: {error}"
        );
        assert!(
            error.to_string().contains("each layer needs its own cache"),
            "{error}"
        );
        assert_eq!(cache.len(), 2, "{label}: the refused step changed nothing");
    }
    // A clone is the same module (same parameters), and may go on.
    owner
        .clone()
        .forward_cached(MhaInput::self_attn(randn([1, 1, 16], &device)), &mut cache)
        .unwrap();
    assert_eq!(cache.len(), 3);
}

/// `true` where key `k` is hidden from query `q` by a causal window of `window` positions that
/// keeps the first `sinks` positions visible (StreamingLLM).
fn streaming_mask(seq: usize, sinks: usize, window: usize, device: &Device) -> Tensor<2, Bool> {
    let values: Vec<bool> = (0..seq)
        .flat_map(|q| (0..seq).map(move |k| k > q || (k >= sinks && k + window <= q)))
        .collect();
    Tensor::from_data(TensorData::new(values, [seq, seq]), device)
}

/// A streaming cache keeps its sink positions for good and a window behind each query, at the
/// positions they were first seen (RoPE, ALiBi): decoding in any steps equals one forward with
/// the matching mask, and the cache never holds more than `sinks + window - 1` positions.
#[test]
fn streaming_window_cache_keeps_its_sinks_and_equals_the_masked_forward() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 19);
        let (sinks, window, seq) = (2, 3, 80);
        for (label, config) in [
            (
                "gqa+rope",
                MultiHeadAttentionConfig::new(16, 4)
                    .with_n_kv_heads(Some(2))
                    .with_rope(Some(RopeConfig::new())),
            ),
            (
                "alibi",
                MultiHeadAttentionConfig::new(16, 4).with_alibi(true),
            ),
        ] {
            let module = config.init(&device);
            let x = randn([2, seq, 16], &device);
            let full = module
                .forward(
                    MhaInput::self_attn(x.clone())
                        .attn_mask(streaming_mask(seq, sinks, window, &device)),
                )
                .context;
            // The positions evicted between the sinks and the window pass 64 (when the cache
            // moves what it keeps together) in one step, and over several.
            for chunks in [
                [vec![1; 12], vec![68]].concat(),
                vec![3, 1, 4, 2, 2, 30, 30, 8],
                vec![1, 5, 6, 68],
            ] {
                let mut cache = KvCache::with_limit(CacheLimit::StreamingWindow { sinks, window });
                let decoded = decode(&module, &x, &chunks, &mut cache);
                assert!(
                    cache.stored() < sinks + window,
                    "{name} {label}: {} stored",
                    cache.stored()
                );
                assert_eq!(cache.len(), seq);
                assert_close(
                    &format!("{name} {label}: streaming {chunks:?}"),
                    decoded,
                    full.clone(),
                    tolerance(name),
                );
            }
        }
    }
}

/// The config's `window` holds in plain forwards and under any cache, with padding: the same
/// answers as the banded mask on a module without it.
#[test]
fn config_window_equals_the_banded_mask_plain_and_cached() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 21);
        let windowed = MultiHeadAttentionConfig::new(16, 4)
            .with_n_kv_heads(Some(2))
            .with_rope(Some(RopeConfig::new()))
            .with_window(Some(3))
            .init(&device);
        let plain = common::with_projections_of(
            MultiHeadAttentionConfig::new(16, 4)
                .with_n_kv_heads(Some(2))
                .with_rope(Some(RopeConfig::new()))
                .init(&device),
            &windowed,
        );
        let x = randn([2, 9, 16], &device);
        let padding = Tensor::<2, Bool>::from_data(
            TensorData::new(
                (0..18).map(|i| i == 4 || i == 17).collect::<Vec<_>>(),
                [2, 9],
            ),
            &device,
        );
        let expected = plain
            .forward(
                MhaInput::self_attn(x.clone())
                    .key_padding_mask(padding.clone())
                    .attn_mask(band_mask(9, 3, &device)),
            )
            .context;
        for path in common::paths(&device) {
            let actual = windowed
                .forward(
                    MhaInput::self_attn(x.clone())
                        .key_padding_mask(padding.clone())
                        .causal()
                        .path(path),
                )
                .context;
            assert_close(
                &format!("{name} {path:?}: window 3"),
                actual,
                expected.clone(),
                tolerance(name),
            );
        }
        let mut cache = KvCache::new();
        let mut outputs = Vec::new();
        for (start, length) in [(0, 4), (4, 1), (5, 4)] {
            let step = MhaInput::self_attn(x.clone().narrow(1, start, length))
                .key_padding_mask(padding.clone().narrow(1, start, length))
                .causal();
            outputs.push(windowed.forward_cached(step, &mut cache).unwrap().context);
        }
        assert_close(
            &format!("{name}: window 3 under an unbounded cache"),
            Tensor::cat(outputs, 1),
            expected,
            tolerance(name),
        );
    }
}

/// An int8 cache holds 3.7 times the positions of an f32 one in the same bytes at a head width
/// of 64, and decoding through it stays within 2% of the float cache's output scale (int8
/// rounds each element by at most `max |x| / 254` of its position's head).
#[test]
fn int8_cache_is_smaller_and_close_to_the_float_cache() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 23);
        let module = MultiHeadAttentionConfig::new(256, 4)
            .with_n_kv_heads(Some(2))
            .with_rope(Some(RopeConfig::new()))
            .init(&device);
        let x = randn([2, 48, 256], &device);
        // Both caches hold 64 positions after these steps: the f32 one doubles 32 to 64, the
        // int8 one on the CPU backends holds a whole tile of 64 from the first step.
        let chunks = [32, 1, 1, 6, 1, 7];
        let mut float = KvCache::new();
        let expected = decode(&module, &x, &chunks, &mut float);
        let mut int8 = KvCache::new().with_storage(CacheStorage::Int8);
        let first = module.forward_cached(
            MhaInput::self_attn(x.clone().narrow(1, 0, 8)).causal(),
            &mut int8,
        );
        if let Err(CacheError::Storage { reason }) = &first {
            eprintln!("{name}: no int8 cache here ({reason})");
            continue;
        }
        int8.reset();
        let actual = decode(&module, &x, &chunks, &mut int8);
        let ratio = float.bytes() as f64 / int8.bytes() as f64;
        assert!(ratio >= 3.7, "{name}: int8 cache {ratio:.2}x smaller");
        let scale = expected.clone().abs().max().into_scalar::<f32>();
        let error = common::max_abs_diff(actual, expected);
        assert!(
            error <= 0.02 * scale && error > 0.0,
            "{name}: int8 decoding differs by {error} at output scale {scale}"
        );
    }
}

/// A cached forward refuses packed segments with a message naming the argument.
#[test]
fn segment_ids_under_a_cache_are_refused_clearly() {
    let device = Device::flex();
    let module = MultiHeadAttentionConfig::new(8, 2).init(&device);
    let x = randn([1, 3, 8], &device);
    let ids = Tensor::<2, burn::tensor::Int>::zeros([1, 3], &device);
    let message = common::panic_message(|| {
        let mut cache = KvCache::new();
        module.forward_cached(MhaInput::self_attn(x).segment_ids(ids).causal(), &mut cache)
    });
    assert!(message.contains("`segment_ids`"), "{message}");
}

/// A float or int8 cache keeps room to append in place: it never holds more than twice the
/// positions it stores (once past its first step), nor more than a fixed capacity allows, and
/// it does hold spare positions (appending copies only the step's rows until they run out); its
/// outputs stay those of the full forward (see the decoding tests above). An int8 cache on flex
/// holds whole tiles of 64 positions (as the in-place kernel reads them): those bounds rounded
/// up to a tile.
#[test]
fn caches_reserve_at_most_their_size_again_and_never_past_a_fixed_capacity() {
    let device = Device::flex();
    let module = MultiHeadAttentionConfig::new(16, 4)
        .with_n_kv_heads(Some(2))
        .init(&device);
    // Keys and values of one position: batch 1, 2 heads of 4 features, in f32, or in i8 with
    // an f32 scale per head.
    for (storage, per_position, tile) in [
        (CacheStorage::Float, 2 * 2 * 4 * 4, 1),
        (CacheStorage::Int8, 2 * 2 * (4 + 4), 64),
    ] {
        for limit in [CacheLimit::Unbounded, CacheLimit::Fixed(40)] {
            let mut cache = KvCache::with_limit(limit).with_storage(storage);
            let mut spare_seen = false;
            for step in 0..40 {
                let new = if step == 0 { 3 } else { 1 };
                if cache.len() + new > 40 {
                    break;
                }
                module
                    .forward_cached(
                        MhaInput::self_attn(randn([1, new, 16], &device)).causal(),
                        &mut cache,
                    )
                    .expect("room in the cache");
                let (held, stored) = (cache.bytes() / per_position, cache.stored());
                assert!(
                    held >= stored && held <= (2 * stored).next_multiple_of(tile),
                    "{storage:?} {limit:?}: {held} positions held for {stored} stored"
                );
                spare_seen |= held > stored;
                if let CacheLimit::Fixed(capacity) = limit {
                    assert!(
                        held <= capacity.next_multiple_of(tile),
                        "{held} positions held past the capacity"
                    );
                }
            }
            assert!(
                spare_seen,
                "{storage:?} {limit:?}: no room kept to append in place"
            );
        }
    }
}

/// A window's cache leaves the positions it evicts in its buffer until there are 64, then
/// moves what it keeps together: however long the sequence, its buffers hold the window (and
/// its sinks), 64 evicted positions and room for 64 more (in tiles of 64 for int8 on flex).
#[test]
fn a_window_cache_holds_a_bounded_buffer_however_long_the_sequence() {
    let device = Device::flex();
    let module = MultiHeadAttentionConfig::new(16, 4)
        .with_n_kv_heads(Some(2))
        .init(&device);
    let window = 8;
    for ((storage, per_position), sinks) in [
        (CacheStorage::Float, 2 * 2 * 4 * 4),
        (CacheStorage::Int8, 2 * 2 * (4 + 4)),
    ]
    .into_iter()
    .flat_map(|storage| [(storage, 0), (storage, 2)])
    {
        let limit = match sinks {
            0 => CacheLimit::SlidingWindow(window),
            _ => CacheLimit::StreamingWindow { sinks, window },
        };
        let mut cache = KvCache::with_limit(limit).with_storage(storage);
        let mut most = 0;
        for _ in 0..300 {
            module
                .forward_cached(
                    MhaInput::self_attn(randn([1, 1, 16], &device)).causal(),
                    &mut cache,
                )
                .expect("a window evicts");
            most = most.max(cache.bytes() / per_position);
        }
        assert_eq!((cache.len(), cache.stored()), (300, sinks + window - 1));
        assert!(
            most <= (sinks + window + 2 * 64).next_multiple_of(64),
            "{storage:?}: {most} positions held for a window of {window} and {sinks} sinks"
        );
    }
}

/// Masks over every position fed (`[batch, len + new]` padding, `[new, len + new]` attention
/// masks), as Hugging Face's models pass them, hold under windows that evicted positions: the
/// same answers as one forward with the window's mask, the padding and the attention mask.
#[test]
fn masks_over_every_position_fed_hold_after_a_window_evicts() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 23);
        let module = MultiHeadAttentionConfig::new(16, 4)
            .with_n_kv_heads(Some(2))
            .with_rope(Some(RopeConfig::new()))
            .init(&device);
        let seq = 12;
        let x = randn([2, seq, 16], &device);
        // Sequence 0 pads position 1 (a sink) and 6, sequence 1 position 8.
        let padded = |b: usize, k: usize| (b == 0 && (k == 1 || k == 6)) || (b == 1 && k == 8);
        let padding_values: Vec<bool> = (0..2)
            .flat_map(|b| (0..seq).map(move |k| padded(b, k)))
            .collect();
        let padding =
            Tensor::<2, Bool>::from_data(TensorData::new(padding_values, [2, seq]), &device);
        // Every third query may not see the key just before it.
        let hidden = |q: usize, k: usize| q.is_multiple_of(3) && k + 1 == q;
        for (sinks, window) in [(0, 4), (2, 3)] {
            let limit = if sinks == 0 {
                CacheLimit::SlidingWindow(window)
            } else {
                CacheLimit::StreamingWindow { sinks, window }
            };
            let mask_values: Vec<bool> = (0..seq)
                .flat_map(|q| {
                    (0..seq).map(move |k| k > q || (k >= sinks && k + window <= q) || hidden(q, k))
                })
                .collect();
            let full = module
                .forward(
                    MhaInput::self_attn(x.clone())
                        .attn_mask(Tensor::<2, Bool>::from_data(
                            TensorData::new(mask_values, [seq, seq]),
                            &device,
                        ))
                        .key_padding_mask(padding.clone()),
                )
                .context;
            let attn_values: Vec<bool> = (0..seq)
                .flat_map(|q| (0..seq).map(move |k| hidden(q, k)))
                .collect();
            let attn =
                Tensor::<2, Bool>::from_data(TensorData::new(attn_values, [seq, seq]), &device);
            let mut cache = KvCache::with_limit(limit);
            let mut outputs = Vec::new();
            let mut start = 0;
            for len in [3, 1, 2, 1, 1, 4] {
                let fed = start + len;
                let step = MhaInput::self_attn(x.clone().narrow(1, start, len))
                    .causal()
                    .key_padding_mask(padding.clone().narrow(1, 0, fed))
                    .attn_mask(attn.clone().narrow(0, start, len).narrow(1, 0, fed));
                outputs.push(module.forward_cached(step, &mut cache).unwrap().context);
                start = fed;
            }
            assert!(cache.stored() < cache.len());
            assert_close(
                &format!("{name}: {limit:?}"),
                Tensor::cat(outputs, 1),
                full,
                tolerance(name),
            );
        }
    }
}
