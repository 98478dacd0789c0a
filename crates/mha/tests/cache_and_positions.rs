//! The KV cache against one full forward, RoPE and ALiBi positions through it, its refusals and
//! its size, on every test device. Windows are in `windows.rs`, the chunked and flash paths
//! against the explicit one in `paths.rs`.

mod common;

use burn::tensor::{Bool, Device, Tensor, TensorData};
use common::{assert_close, decode, randn, test_devices, tolerance};
use mha::{
    CacheError, CacheLimit, CacheStorage, KvCache, MhaInput, MultiHeadAttentionConfig, NeedWeights,
    RopeConfig, RopeLayout,
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

/// `module`'s causal step of `x` through `cache`, with a padding mask if any.
fn causal_step(
    module: &mha::MultiHeadAttention,
    x: Tensor<3>,
    padding: Option<Tensor<2, Bool>>,
    cache: &mut KvCache,
) -> Tensor<3> {
    let mut input = MhaInput::self_attn(x).causal();
    if let Some(padding) = padding {
        input = input.key_padding_mask(padding);
    }
    module.forward_cached(input, cache).unwrap().context
}

/// Speculative decoding's shape: a prompt (left-padded in one row), then the accepted draft
/// tokens and rejected ones in one step, then a cut back to the accepted ones and the next
/// tokens: the same as a cache that was only ever fed the accepted ones, in every storage and
/// configuration, on every test device. Past its length a cut changes nothing; to 0 it empties
/// the cache.
#[test]
fn a_cut_cache_decodes_as_if_only_its_first_positions_had_been_fed() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 29);
        for (label, config) in configs() {
            let module = config.init(&device);
            let step = |x, padding, cache: &mut KvCache| causal_step(&module, x, padding, cache);
            let (prompt, accepted) = (randn([2, 6, 16], &device), randn([2, 2, 16], &device));
            let (rejected, next) = (randn([2, 3, 16], &device), randn([2, 2, 16], &device));
            let padding = Tensor::<2, Bool>::from_data(
                TensorData::from([[false; 6], [true, false, false, false, false, false]]),
                &device,
            );
            for storage in common::storages(&device) {
                let case = format!("{name} {label} {storage:?}");
                let mut reference = KvCache::new().with_storage(storage);
                step(prompt.clone(), Some(padding.clone()), &mut reference);
                step(accepted.clone(), None, &mut reference);
                let mut cut = KvCache::new().with_storage(storage);
                step(prompt.clone(), Some(padding.clone()), &mut cut);
                let drafted = Tensor::cat(vec![accepted.clone(), rejected.clone()], 1);
                step(drafted, None, &mut cut);
                assert_eq!(cut.len(), 11, "{case}");
                cut.truncate(8).unwrap();
                assert_eq!((cut.len(), cut.stored()), (8, 8), "{case}");
                cut.truncate(20).unwrap();
                assert_eq!(cut.len(), 8, "{case}: a cut past the length");
                assert_close(
                    &case,
                    step(next.clone(), None, &mut cut),
                    step(next.clone(), None, &mut reference),
                    tolerance(name),
                );
                cut.truncate(0).unwrap();
                assert!(cut.is_empty() && cut.stored() == 0, "{case}");
                assert_eq!(cut.bytes(), 0, "{case}: an empty cache holds no buffers");
            }
        }
    }
}

/// Beam search's shape: a batch of three prompts (one left-padded) and a step, then the
/// elements kept reordered and repeated (`select_batch(&[2, 0, 0, 1])`): each element of the
/// next steps equals decoding the sequence it continues, here a cache fed the chosen rows from
/// the start; in every configuration and storage, unbounded and under a window that has
/// evicted, on every test device. An empty or out-of-range choice panics naming `elements`.
#[test]
fn a_cache_of_chosen_batch_elements_continues_each_chosen_sequence() {
    let chosen = [2usize, 0, 0, 1];
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 33);
        let rows = Tensor::<1, burn::tensor::Int>::from_data(
            TensorData::new(chosen.map(|row| row as i64).to_vec(), [chosen.len()]),
            &device,
        );
        for (label, config) in configs() {
            let module = config.init(&device);
            let step = |x, padding, cache: &mut KvCache| causal_step(&module, x, padding, cache);
            // 66 positions: two of a compressed cache's tiles of 64 on flex and ndarray.
            let (prompt, second) = (randn([3, 66, 16], &device), randn([3, 2, 16], &device));
            let next = randn([4, 2, 16], &device);
            // The second prompt left-padded by two positions.
            let padded: Vec<bool> = (0..3 * 66).map(|i| i / 66 == 1 && i % 66 < 2).collect();
            let padding = Tensor::<2, Bool>::from_data(TensorData::new(padded, [3, 66]), &device);
            for storage in common::storages(&device) {
                // A window of 8 has evicted 61 positions in place, its 7 spread over two tiles.
                for limit in [CacheLimit::Unbounded, CacheLimit::SlidingWindow(8)] {
                    let case = format!("{name} {label} {storage:?} {limit:?}");
                    let new_cache = || KvCache::with_limit(limit).with_storage(storage);
                    let mut selected = new_cache();
                    step(prompt.clone(), Some(padding.clone()), &mut selected);
                    step(second.clone(), None, &mut selected);
                    selected.select_batch(&chosen);
                    let mut reference = new_cache();
                    let chosen_rows = |x: &Tensor<3>| x.clone().select(0, rows.clone());
                    let chosen_padding = Tensor::cat(
                        chosen
                            .iter()
                            .map(|&row| padding.clone().narrow(0, row, 1))
                            .collect(),
                        0,
                    );
                    step(chosen_rows(&prompt), Some(chosen_padding), &mut reference);
                    step(chosen_rows(&second), None, &mut reference);
                    assert_eq!(
                        (selected.len(), selected.stored()),
                        (reference.len(), reference.stored()),
                        "{case}"
                    );
                    assert_close(
                        &case,
                        step(next.clone(), None, &mut selected),
                        step(next.clone(), None, &mut reference),
                        tolerance(name),
                    );
                }
            }
        }
        let mut cache = KvCache::new();
        let module = MultiHeadAttentionConfig::new(16, 4).init(&device);
        decode(&module, &randn([3, 2, 16], &device), &[2], &mut cache);
        for (elements, expected) in [
            (vec![], "`elements` is empty"),
            (vec![0, 3], "`elements` names element 3 of a batch of 3"),
        ] {
            let message = common::panic_message(|| cache.clone().select_batch(&elements));
            assert!(message.contains(expected), "{name}: {message}");
        }
    }
}

#[test]
fn capacity_and_batch_changes_are_refused_and_leave_the_cache_unchanged() {
    let device = Device::flex();
    // Held while this test draws, so that its draws do not interleave with a seeded test's.
    let _seed = common::seed(&device, 71);
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
    // Held while this test draws, so that its draws do not interleave with a seeded test's.
    let _seed = common::seed(&device, 72);
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
        // Asked first, so that a device without int8 (lavapipe) runs none of the steps.
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
        let mut float = KvCache::new();
        let expected = decode(&module, &x, &chunks, &mut float);
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
    // Held while this test draws, so that its draws do not interleave with a seeded test's.
    let _seed = common::seed(&device, 73);
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
    // Held while this test draws, so that its draws do not interleave with a seeded test's.
    let _seed = common::seed(&device, 74);
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
