//! The paged KV cache: every sequence of a ragged step gets what decoding it alone with a
//! `KvCache` gives it, whatever joins, leaves, forks or shares a prefix around it; a full pool
//! refuses a step and loses nothing; memory stays within one block per sequence.

mod common;

use burn::tensor::{Device, Tensor};
use common::paged_harness::Harness;
use common::{
    assert_close, device_by_name, panic_message, randn, row_ids, storages, test_devices, tolerance,
    window_softcap_sinks, with_random_sinks,
};
use mha::{
    AttentionPath, BlockSizes, CacheStorage, MhaInput, MultiHeadAttention,
    MultiHeadAttentionConfig, PagedCacheError, PagedKvCacheConfig, RopeConfig, RopeLayout,
    SequenceId,
};

const D_MODEL: usize = 16;

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
            "mqa+rope-half",
            base.clone()
                .with_n_kv_heads(Some(1))
                .with_rope(Some(RopeConfig::new().with_layout(RopeLayout::HalfSplit))),
        ),
        (
            "gqa+alibi",
            base.clone().with_n_kv_heads(Some(2)).with_alibi(true),
        ),
        (
            "mha+alibi+softcap",
            base.clone().with_alibi(true).with_softcap(Some(1.5)),
        ),
        ("gqa+window+softcap+sinks", window_softcap_sinks(D_MODEL, 3)),
        ("quiet", base.clone().with_quiet_softmax(true)),
        (
            "bias_kv+zero_attn",
            base.with_add_bias_kv(true).with_add_zero_attn(true),
        ),
    ]
}

/// Sequences join, leave and fork around each other, prompts are prefilled beside decoding
/// steps, and blocks of 4 positions make every sequence span several of them.
fn continuous_batching(harness: &mut Harness) {
    let (a, b) = (harness.add(), harness.add());
    harness.step(&[(a, 5), (b, 1)]);
    let c = harness.add();
    harness.step(&[(a, 1), (b, 1), (c, 3)]);
    harness.step(&[(c, 2), (a, 1)]);
    harness.remove(b);
    // `a` holds 7 positions: its second block is shared and partly filled, copied on write.
    let fork = harness.fork(a);
    let d = harness.add();
    harness.step(&[(a, 1), (fork, 1), (d, 6), (c, 1)]);
    harness.step(&[(fork, 2), (a, 1), (d, 1)]);
    // A prompt read in place by two tasks (16 rows each at most) beside decoding steps.
    let e = harness.add();
    harness.step(&[(a, 1), (e, 20), (fork, 1)]);
    harness.step(&[(e, 1), (d, 17)]);
    // Runs of more than 32 rows go to the gathered path beside the others.
    let f = harness.add();
    harness.step(&[(f, 40), (a, 1), (e, 33)]);
}

#[test]
fn every_sequence_of_a_ragged_step_equals_decoding_it_alone() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 31);
        // lavapipe compiles shaders for every new shape: three configurations there (ALiBi's
        // batched calls under a float mask among them).
        let configs = match name {
            "wgpu" => configs()
                .into_iter()
                .filter(|(label, _)| ["gqa+rope", "mha", "gqa+alibi"].contains(label))
                .collect(),
            _ => configs(),
        };
        for (label, config) in configs {
            let module = config.init(&device);
            for storage in [CacheStorage::Half, CacheStorage::Int8] {
                if !storages(&device).contains(&storage) {
                    storage_is_refused_where_the_device_lacks_it(&module, &device, storage);
                }
            }
            for storage in storages(&device) {
                let paged = PagedKvCacheConfig::new(64)
                    .with_block_size(4)
                    .with_storage(storage);
                let label = format!("{name} {label} {storage:?}");
                let mut harness = Harness::new(&module, &device, paged, label, tolerance(name));
                continuous_batching(&mut harness);
            }
        }
    }
}

/// Heads 32 and 64 wide, blocks of 16 and 64: the shapes the CPU kernel's AVX-512 and AVX2
/// paths take (whole 16-position parts, blocks of 64 and runs of four blocks of 16 as one part
/// of 64; values a multiple of 16 wide), beside a last partial block per sequence, with and
/// without ALiBi and a soft cap.
#[test]
fn wide_heads_and_whole_blocks_equal_decoding_alone_in_every_storage() {
    let device = Device::flex();
    let _seed = common::seed(&device, 36);
    for (label, config) in [
        (
            "gqa, head_dim 32",
            MultiHeadAttentionConfig::new(128, 4)
                .with_n_kv_heads(Some(2))
                .with_rope(Some(RopeConfig::new())),
        ),
        ("mha, head_dim 64", MultiHeadAttentionConfig::new(128, 2)),
        (
            "mha+alibi+softcap, head_dim 64",
            MultiHeadAttentionConfig::new(128, 2)
                .with_alibi(true)
                .with_softcap(Some(1.5)),
        ),
        // Rows that see part of a run of blocks (a window's first) and, in the prompt of 20
        // rows below, each a different part.
        (
            "gqa+window 100+softcap+sinks, head_dim 32",
            window_softcap_sinks(128, 100),
        ),
    ] {
        let module = config.init(&device);
        // Two whole blocks and a partial one, one whole block; runs of four blocks of 16 read
        // as one part of 64 (two and a block, one and a partial block).
        for (block_size, lengths) in [(16, [40, 16]), (16, [150, 70]), (64, [140, 64])] {
            for storage in [CacheStorage::Float, CacheStorage::Half, CacheStorage::Int8] {
                let paged = PagedKvCacheConfig::new(32)
                    .with_block_size(block_size)
                    .with_storage(storage);
                let label = format!("{label} blocks of {block_size} {storage:?}");
                let mut harness = Harness::new(&module, &device, paged, label, 1e-5);
                let (a, b) = (harness.add(), harness.add());
                harness.step(&[(a, lengths[0]), (b, lengths[1])]);
                for _ in 0..3 {
                    harness.step(&[(a, 1), (b, 1)]);
                }
                harness.step(&[(a, 20), (b, 1)]);
            }
        }
    }
}

#[test]
fn blocks_of_one_position_equal_decoding_alone() {
    // A first step that needs one block leaves the keys' pool a transposed view of one
    // position, whose last stride is not 1: the in-place reads and writes take it all the same.
    for device in ["flex", "ndarray"].map(|name| common::device_by_name(name).unwrap()) {
        let _seed = common::seed(&device, 37);
        let module = MultiHeadAttentionConfig::new(32, 4)
            .with_n_kv_heads(Some(2))
            .init(&device);
        for storage in storages(&device) {
            let paged = PagedKvCacheConfig::new(16)
                .with_block_size(1)
                .with_storage(storage);
            let label = format!("{device:?} {storage:?}");
            let mut harness = Harness::new(&module, &device, paged, label, 1e-5);
            let (a, b) = (harness.add(), harness.add());
            harness.step(&[(a, 1)]);
            harness.step(&[(a, 1), (b, 3)]);
            harness.step(&[(a, 1), (b, 1)]);
        }
    }
}

#[test]
fn autodiff_devices_take_the_gathered_path_with_the_same_results() {
    let device = Device::flex().autodiff();
    let _seed = common::seed(&device, 32);
    // The step's short runs in batched calls, under ALiBi too; a window releasing blocks, and
    // with ALiBi, whose float mask hides what the window hides.
    let mut configs: Vec<_> = configs().into_iter().take(6).collect();
    configs.push((
        "gqa+alibi+window",
        MultiHeadAttentionConfig::new(D_MODEL, 4)
            .with_n_kv_heads(Some(2))
            .with_alibi(true)
            .with_window(Some(3)),
    ));
    for (label, config) in configs {
        let module = config.init(&device);
        for storage in storages(&device) {
            let paged = PagedKvCacheConfig::new(64)
                .with_block_size(4)
                .with_storage(storage);
            let label = format!("flex autodiff {label} {storage:?}");
            let mut harness = Harness::new(&module, &device, paged, label, 1e-5);
            continuous_batching(&mut harness);
        }
    }
}

#[test]
fn a_shared_prompt_is_stored_once_and_each_continuation_equals_decoding_it_alone() {
    let device = Device::flex();
    let _seed = common::seed(&device, 33);
    let module = MultiHeadAttentionConfig::new(D_MODEL, 4)
        .with_n_kv_heads(Some(2))
        .with_rope(Some(RopeConfig::new()))
        .init(&device);
    for storage in [CacheStorage::Float, CacheStorage::Half, CacheStorage::Int8] {
        let mut harness = Harness::new(
            &module,
            &device,
            PagedKvCacheConfig::new(64)
                .with_block_size(4)
                .with_storage(storage),
            format!("shared prompt {storage:?}"),
            1e-5,
        );
        let prompt = harness.add();
        harness.step(&[(prompt, 10)]);
        assert_eq!(harness.paged.blocks_in_use(), 3);
        // Four requests continue the prompt's first 8 positions (two whole blocks), two
        // continue all 10 (sharing the partly filled third block until each writes into it).
        let prefixed: Vec<SequenceId> = (0..4)
            .map(|_| harness.fork_prefix(prompt, 8).unwrap())
            .collect();
        let forks: Vec<SequenceId> = (0..2).map(|_| harness.fork(prompt)).collect();
        assert_eq!(harness.paged.blocks_in_use(), 3, "forks share every block");
        let mut rows: Vec<(SequenceId, usize)> = prefixed.iter().map(|&id| (id, 1)).collect();
        rows.extend([(forks[0], 1), (forks[1], 2)]);
        harness.step(&rows);
        // A new block per prefixed request (its prefix ends on a block boundary), a copy of
        // the third block per fork; the prompt's own blocks are as they were.
        assert_eq!(harness.paged.blocks_in_use(), 3 + 4 + 2);
        harness.step(&[(prompt, 1), (forks[0], 3), (prefixed[2], 2)]);
    }
}

#[test]
fn a_prefix_fork_equals_decoding_the_prefix_then_its_own_tokens() {
    let device = Device::flex();
    let _seed = common::seed(&device, 34);
    let module = MultiHeadAttentionConfig::new(D_MODEL, 4)
        .with_rope(Some(RopeConfig::new()))
        .with_alibi(false)
        .init(&device);
    let mut paged = PagedKvCacheConfig::new(32).with_block_size(4).init();
    let prompt = paged.add_sequence();
    let tokens = randn([10, D_MODEL], &device);
    module
        .forward_paged(tokens.clone(), &mut paged, &[prompt; 10])
        .unwrap();
    for prefix in [8, 6] {
        let fork = paged.fork_prefix(prompt, prefix).unwrap();
        let own = randn([3, D_MODEL], &device);
        let output = module
            .forward_paged(own.clone(), &mut paged, &[fork; 3])
            .unwrap();
        let alone = module
            .forward(
                MhaInput::self_attn(
                    Tensor::cat(vec![tokens.clone().narrow(0, 0, prefix), own], 0).reshape([
                        1,
                        prefix + 3,
                        D_MODEL,
                    ]),
                )
                .causal(),
            )
            .context
            .reshape([prefix + 3, D_MODEL])
            .narrow(0, prefix, 3);
        assert_close(&format!("prefix {prefix}"), output, alone, 1e-5);
    }
    // The prompt's own positions are untouched by its forks' writes.
    let next = randn([1, D_MODEL], &device);
    let output = module
        .forward_paged(next.clone(), &mut paged, &[prompt])
        .unwrap();
    let alone = module
        .forward(
            MhaInput::self_attn(Tensor::cat(vec![tokens, next], 0).reshape([1, 11, D_MODEL]))
                .causal(),
        )
        .context
        .reshape([11, D_MODEL])
        .narrow(0, 10, 1);
    assert_close("prompt after its forks", output, alone, 1e-5);
}

#[test]
fn a_full_pool_refuses_the_step_naming_the_sequence_and_loses_no_state() {
    let device = Device::flex();
    let _seed = common::seed(&device, 35);
    let module = MultiHeadAttentionConfig::new(D_MODEL, 4).init(&device);
    let mut harness = Harness::new(
        &module,
        &device,
        PagedKvCacheConfig::new(4).with_block_size(4),
        "full pool".into(),
        1e-5,
    );
    let (a, b) = (harness.add(), harness.add());
    harness.step(&[(a, 6), (b, 2)]);
    let x = randn([8, D_MODEL], &device);
    let mut ids = vec![a];
    ids.extend([b; 7]);
    let error = module
        .forward_paged(x, &mut harness.paged, &ids)
        .unwrap_err();
    assert_eq!(
        error,
        PagedCacheError::PoolFull {
            sequence: b,
            needed: 2,
            free: 1
        }
    );
    let message = error.to_string();
    assert!(
        message.contains("sequence 1") && message.contains("1 are free"),
        "{message}"
    );
    assert_eq!(
        (harness.paged.len(a), harness.paged.len(b)),
        (Some(6), Some(2))
    );
    // Both sequences go on as if the refused step had never been tried.
    harness.step(&[(a, 1), (b, 3)]);
    harness.remove(a);
    harness.step(&[(b, 8)]);
}

#[test]
fn a_refused_step_leaves_bystanders_forks_and_shared_blocks_as_they_were() {
    for name in ["flex", "ndarray"] {
        let device = common::device_by_name(name).unwrap();
        let _seed = common::seed(&device, 39);
        let module = MultiHeadAttentionConfig::new(D_MODEL, 4)
            .with_n_kv_heads(Some(2))
            .with_rope(Some(RopeConfig::new()))
            .init(&device);
        for storage in storages(&device) {
            let config = PagedKvCacheConfig::new(8)
                .with_block_size(4)
                .with_storage(storage);
            let label = format!("{name} refused {storage:?}");
            let mut harness = Harness::new(&module, &device, config, label.clone(), 1e-5);
            let (a, bystander, b) = (harness.add(), harness.add(), harness.add());
            harness.step(&[(a, 6), (bystander, 5), (b, 3)]);
            // `fork` shares both of `a`'s blocks, the second partly filled.
            let fork = harness.fork(a);
            assert_eq!(
                (harness.paged.blocks_in_use(), harness.paged.free_blocks()),
                (5, 3),
                "{label}"
            );
            // `a` copies the shared block (1), `fork` then writes into it alone and takes a
            // block (1), `b` needs two of the one left.
            let ids = row_ids(&[(a, 1), (fork, 3), (b, 6)]);
            let error = module
                .forward_paged(randn([10, D_MODEL], &device), &mut harness.paged, &ids)
                .unwrap_err();
            assert_eq!(
                error,
                PagedCacheError::PoolFull {
                    sequence: b,
                    needed: 4,
                    free: 3
                },
                "{label}"
            );
            assert_eq!(
                (harness.paged.blocks_in_use(), harness.paged.free_blocks()),
                (5, 3),
                "{label}"
            );
            let lens = [a, fork, bystander, b].map(|id| harness.paged.len(id));
            assert_eq!(lens, [6, 6, 5, 3].map(Some), "{label}");
            // Every sequence goes on as if the refused step had never been tried: the fork and
            // `a` still share the partly filled block until they write into it.
            harness.step(&[(bystander, 1), (a, 1), (fork, 2), (b, 1)]);
            harness.step(&[(fork, 1), (a, 1), (bystander, 2)]);
        }
    }
}

#[test]
fn cache_memory_stays_within_one_block_per_sequence_of_what_is_stored() {
    let device = Device::flex();
    let _seed = common::seed(&device, 36);
    let module = MultiHeadAttentionConfig::new(D_MODEL, 4)
        .with_n_kv_heads(Some(2))
        .init(&device);
    for storage in [CacheStorage::Float, CacheStorage::Half, CacheStorage::Int8] {
        let block_size = 16;
        let mut cache = PagedKvCacheConfig::new(256)
            .with_block_size(block_size)
            .with_storage(storage)
            .init();
        let lengths = [1, 15, 16, 17, 40, 100];
        let ids: Vec<SequenceId> = lengths.iter().map(|_| cache.add_sequence()).collect();
        let rows: Vec<SequenceId> = ids
            .iter()
            .zip(lengths)
            .flat_map(|(&id, n)| std::iter::repeat_n(id, n))
            .collect();
        module
            .forward_paged(randn([rows.len(), D_MODEL], &device), &mut cache, &rows)
            .unwrap();
        let blocks: usize = lengths.iter().map(|n| n.div_ceil(block_size)).sum();
        assert_eq!(cache.blocks_in_use(), blocks, "{storage:?}");
        // Per block, keys and values: 2 heads × 16 positions × 4 features of 4 bytes, of 2,
        // or of 1 byte and a 4-byte scale per position and head.
        let element_bytes = match storage {
            CacheStorage::Float => 2 * (2 * block_size * 4 * 4),
            CacheStorage::Half => 2 * (2 * block_size * 4 * 2),
            CacheStorage::Int8 => 2 * (2 * block_size * 4 + 2 * block_size * 4),
        };
        assert_eq!(cache.block_bytes(), element_bytes, "{storage:?}");
        let stored: usize = lengths.iter().sum();
        let slack = lengths.len() * cache.block_bytes();
        assert!(cache.bytes_in_use() < stored / block_size * cache.block_bytes() + slack);
        for id in ids {
            cache.remove_sequence(id).unwrap();
        }
        assert_eq!(cache.blocks_in_use(), 0);
        assert_eq!(cache.free_blocks(), 256);
    }
}

#[test]
fn bad_steps_are_refused_clearly_and_leave_the_cache_unchanged() {
    let device = Device::flex();
    // Held while this test draws, so that its draws do not interleave with a seeded test's.
    let _seed = common::seed(&device, 77);
    let module = MultiHeadAttentionConfig::new(D_MODEL, 4).init(&device);
    let other = MultiHeadAttentionConfig::new(D_MODEL, 4).init(&device);
    let mut cache = PagedKvCacheConfig::new(8).init();
    let a = cache.add_sequence();
    module
        .forward_paged(randn([2, D_MODEL], &device), &mut cache, &[a, a])
        .unwrap();
    let error = other
        .forward_paged(randn([1, D_MODEL], &device), &mut cache, &[a])
        .unwrap_err();
    assert!(
        matches!(error, PagedCacheError::OtherModule { .. }),
        "{error}"
    );
    let gone = cache.add_sequence();
    cache.remove_sequence(gone).unwrap();
    let error = module
        .forward_paged(randn([2, D_MODEL], &device), &mut cache, &[a, gone])
        .unwrap_err();
    assert_eq!(error, PagedCacheError::UnknownSequence(gone));
    assert_eq!(cache.len(a), Some(2));
    let b = cache.add_sequence();
    let interleaved = panic_message(|| {
        let mut cache = cache.clone();
        module.forward_paged(randn([3, D_MODEL], &device), &mut cache, &[a, b, a])
    });
    assert!(interleaved.contains("not consecutive"), "{interleaved}");
    let miscounted = panic_message(|| {
        let mut cache = cache.clone();
        module.forward_paged(randn([3, D_MODEL], &device), &mut cache, &[a, b])
    });
    assert!(miscounted.contains("`sequences`"), "{miscounted}");
    let narrow = panic_message(|| {
        let mut cache = cache.clone();
        module.forward_paged(randn([1, 8], &device), &mut cache, &[a])
    });
    assert!(narrow.contains("`input`"), "{narrow}");
}

/// On a device without i8 (f16) tensors an int8 (half) pool refuses the step, naming the
/// element type, and holds nothing.
fn storage_is_refused_where_the_device_lacks_it(
    module: &MultiHeadAttention,
    device: &Device,
    storage: CacheStorage,
) {
    let mut cache = PagedKvCacheConfig::new(8).with_storage(storage).init();
    let id = cache.add_sequence();
    let error = module
        .forward_paged(randn([2, D_MODEL], device), &mut cache, &[id, id])
        .unwrap_err();
    let element = if storage == CacheStorage::Half {
        "f16"
    } else {
        "i8"
    };
    assert!(
        matches!(&error, PagedCacheError::Storage { reason } if reason.contains(element)),
        "{error}"
    );
    assert_eq!((cache.len(id), cache.blocks_in_use()), (Some(0), 0));
}

#[test]
fn long_sequences_read_in_several_windows_of_blocks_equal_decoding_them_alone() {
    let device = Device::flex();
    let _seed = common::seed(&device, 38);
    for (label, config) in configs().into_iter().take(5) {
        let module = config.init(&device);
        let mut harness = Harness::new(
            &module,
            &device,
            PagedKvCacheConfig::new(128).with_block_size(16),
            format!("long {label}"),
            1e-5,
        );
        let (a, b) = (harness.add(), harness.add());
        harness.step(&[(a, 300), (b, 40)]);
        // Many windows of the in-place kernel's scores, across block boundaries.
        harness.step(&[(a, 1), (b, 1)]);
        harness.step(&[(b, 3), (a, 9)]);
        harness.step(&[(a, 1)]);
    }
}

/// Sequences of more than 2048 positions are read by several tasks, a part of their positions
/// each, whose softmaxes are merged: each step equals decoding the sequence alone through the
/// flash kernel (over the cache widened, for f16 and int8), prompts and decoding steps beside
/// one another, in every storage, on both CPU backends, with random learned sinks and a window
/// wider than a part.
#[test]
fn long_sequences_read_in_parts_by_several_tasks_equal_decoding_them_alone() {
    // The configurations the native kernel takes (no appended key positions), and a window
    // whose rows see positions of several parts.
    let mut configs: Vec<_> = configs().into_iter().take(7).collect();
    configs.push((
        "gqa+window 2500+softcap+sinks",
        window_softcap_sinks(D_MODEL, 2500),
    ));
    for name in ["flex", "ndarray"] {
        let device = device_by_name(name).unwrap();
        let _seed = common::seed(&device, 39);
        for (label, config) in configs.clone() {
            let module = with_random_sinks(config.init(&device), &device);
            for storage in storages(&device) {
                let paged = PagedKvCacheConfig::new(512)
                    .with_block_size(16)
                    .with_storage(storage);
                let label = format!("{name} {label} {storage:?}");
                let mut harness = Harness::new(&module, &device, paged, label, 1e-5)
                    .with_reference_path(AttentionPath::Flash(BlockSizes::default()));
                let (a, b, c) = (harness.add(), harness.add(), harness.add());
                harness.step(&[(a, 2100), (b, 3300)]);
                // Two parts for `a` and three for `b`, beside a short sequence's one.
                harness.step(&[(a, 1), (c, 5), (b, 1)]);
                harness.step(&[(b, 3), (a, 1), (c, 1)]);
                // A run of 17 rows: two tasks of rows, each in parts.
                harness.step(&[(a, 17), (b, 1)]);
            }
        }
    }
}
