//! Prefix caching: a sequence added with its prompt shares the whole blocks of the longest
//! prefix the paged cache holds (in use, or freed and not yet overwritten), and gets what
//! computing its whole prompt alone gives it; a block overwritten is never matched again. Random
//! schedules mix prompts that share blocks with forks, departures and refused steps.

mod common;

use burn::tensor::{DType, Device};
use common::paged_harness::Harness;
use common::paged_schedule::{Embeddings, Exercised, Schedule, schedule_seeds, system};
use common::{
    assert_close, device_by_name, randn, storages, test_devices, tolerance, window_softcap_sinks,
    with_random_sinks,
};
use mha::{
    CacheStorage, KvCache, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig, PagedKvCache,
    PagedKvCacheConfig, RopeConfig, RopeLayout, SequenceId, Token,
};

const D_MODEL: usize = 16;

/// Four heads with RoPE: keys that depend on their positions, so that a block shared at
/// another position would show.
fn rope_module(device: &Device) -> MultiHeadAttention {
    MultiHeadAttentionConfig::new(D_MODEL, 4)
        .with_rope(Some(RopeConfig::new()))
        .init(device)
}

/// Feeds `prompt[cached..]` to `id` and checks every output row against decoding the prompt
/// alone with a `KvCache` of the same storage, in the same two steps: its first `cached`
/// tokens, then the rest (in int8 a step's own keys are used unquantized, the cached ones as
/// stored).
fn prefill_and_check(
    module: &MultiHeadAttention,
    embeddings: &Embeddings,
    cache: &mut PagedKvCache,
    (id, cached): (SequenceId, usize),
    prompt: &[Token],
    (label, bound): (&str, f32),
) {
    let new = prompt.len() - cached;
    let output = module
        .forward_paged(embeddings.rows(&prompt[cached..]), cache, &vec![id; new])
        .unwrap();
    let mut alone = KvCache::new().with_storage(cache.config().storage);
    let mut decode = |tokens: &[Token]| {
        let rows = embeddings.rows(tokens).reshape([1, tokens.len(), D_MODEL]);
        module
            .forward_cached(MhaInput::self_attn(rows).causal(), &mut alone)
            .unwrap()
            .context
            .reshape([tokens.len(), D_MODEL])
    };
    if cached > 0 {
        decode(&prompt[..cached]);
    }
    let expected = decode(&prompt[cached..]);
    assert_close(&format!("{label}: {id}"), output, expected, bound);
    assert_eq!(cache.len(id), Some(prompt.len()), "{label}");
}

#[test]
fn prompts_share_the_blocks_of_their_longest_held_prefix_and_equal_computing_them_alone() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 41);
        let module = MultiHeadAttentionConfig::new(D_MODEL, 4)
            .with_n_kv_heads(Some(2))
            .with_rope(Some(RopeConfig::new()))
            .init(&device);
        let embeddings = Embeddings::new(D_MODEL, &device);
        let storages = if device.supports_dtype(DType::I8) {
            vec![CacheStorage::Float, CacheStorage::Int8]
        } else {
            vec![CacheStorage::Float]
        };
        for storage in storages {
            let label = format!("{name} {storage:?}");
            let check = (label.as_str(), tolerance(name));
            let mut cache = PagedKvCacheConfig::new(32)
                .with_block_size(4)
                .with_storage(storage)
                .init();
            let first_prompt = system(10);
            let first = cache.add_sequence_with_prompt(&first_prompt);
            assert_eq!(first.cached, 0, "{label}: an empty cache holds nothing");
            let first = (first.id, first.cached);
            prefill_and_check(
                &module,
                &embeddings,
                &mut cache,
                first,
                &first_prompt,
                check,
            );
            assert_eq!(cache.blocks_in_use(), 3);

            // The first 9 tokens and 3 of its own: two whole blocks shared, its own rows from
            // position 8 on.
            let second_prompt = [&first_prompt[..9], &[60, 61, 62]].concat();
            let second = cache.add_sequence_with_prompt(&second_prompt);
            assert_eq!(second.cached, 8, "{label}");
            assert_eq!(cache.blocks_in_use(), 3, "{label}: shared, not copied");
            let second = (second.id, second.cached);
            prefill_and_check(
                &module,
                &embeddings,
                &mut cache,
                second,
                &second_prompt,
                check,
            );
            // One more block for its positions 8-11 and none for the shared two.
            assert_eq!(cache.blocks_in_use(), 4, "{label}");

            // A prompt differing in its second block shares the first only.
            let mut third_prompt = system(12);
            third_prompt[5] = 63;
            let third = cache.add_sequence_with_prompt(&third_prompt);
            assert_eq!(third.cached, 4, "{label}");
            let third = (third.id, third.cached);
            prefill_and_check(
                &module,
                &embeddings,
                &mut cache,
                third,
                &third_prompt,
                check,
            );

            // Every sequence gone: their filed blocks are free and still shared by a prompt.
            for id in [first.0, second.0, third.0] {
                cache.remove_sequence(id).unwrap();
            }
            assert_eq!(cache.blocks_in_use(), 0, "{label}");
            let again_prompt = system(11);
            let again = cache.add_sequence_with_prompt(&again_prompt);
            assert_eq!(again.cached, 8, "{label}: freed blocks not yet overwritten");
            let again = (again.id, again.cached);
            prefill_and_check(
                &module,
                &embeddings,
                &mut cache,
                again,
                &again_prompt,
                check,
            );
        }
    }
}

#[test]
fn blocks_overwritten_by_other_sequences_are_never_matched_again() {
    let device = Device::flex();
    let _seed = common::seed(&device, 42);
    let module = rope_module(&device);
    let embeddings = Embeddings::new(D_MODEL, &device);
    // Six blocks of 4: the prompt's two whole blocks and its partial one, then other
    // sequences that need every block the pool has.
    let mut cache = PagedKvCacheConfig::new(6).with_block_size(4).init();
    let prompt = system(10);
    let first = cache.add_sequence_with_prompt(&prompt);
    prefill_and_check(
        &module,
        &embeddings,
        &mut cache,
        (first.id, first.cached),
        &prompt,
        ("first", 1e-5),
    );
    cache.remove_sequence(first.id).unwrap();
    // Three free blocks nothing can share, and the pool may grow: the filed ones stay.
    let other = cache.add_sequence();
    module
        .forward_paged(randn([12, D_MODEL], &device), &mut cache, &[other; 12])
        .unwrap();
    assert_eq!(cache.add_sequence_with_prompt(&prompt).cached, 8);
    // The matched sequence just made is removed again; now only filed blocks are free, and a
    // sequence taking all of them overwrites them.
    let matched = cache.sequences().last().unwrap();
    cache.remove_sequence(matched).unwrap();
    let last = cache.add_sequence();
    module
        .forward_paged(randn([12, D_MODEL], &device), &mut cache, &[last; 12])
        .unwrap();
    assert_eq!(cache.free_blocks(), 0);
    cache.remove_sequence(last).unwrap();
    let after = cache.add_sequence_with_prompt(&prompt);
    assert_eq!(after.cached, 0, "overwritten blocks matched");
    prefill_and_check(
        &module,
        &embeddings,
        &mut cache,
        (after.id, after.cached),
        &prompt,
        ("after", 1e-5),
    );
}

#[test]
fn a_causal_stack_shares_a_prompt_prefix_in_every_layer_with_the_same_outputs() {
    use mha::transformer::TransformerEncoderInput;
    let device = Device::flex();
    let _seed = common::seed(&device, 43);
    let stack = common::causal_stack(D_MODEL, &device);
    let embeddings = Embeddings::new(D_MODEL, &device);
    let mut cache = stack.new_paged_cache(PagedKvCacheConfig::new(32).with_block_size(4));
    let prompts = [system(9), [&system(8)[..], &[50, 51, 52]].concat()];
    for (index, prompt) in prompts.iter().enumerate() {
        let matched = cache.add_sequence_with_prompt(prompt);
        assert_eq!(matched.cached, 8 * index, "prompt {index}");
        let new = prompt.len() - matched.cached;
        let output = stack
            .forward_paged(
                embeddings.rows(&prompt[matched.cached..]),
                &mut cache,
                &vec![matched.id; new],
            )
            .unwrap();
        let alone = stack
            .forward_cached(
                TransformerEncoderInput::new(embeddings.rows(prompt).reshape([
                    1,
                    prompt.len(),
                    D_MODEL,
                ])),
                &mut stack.new_cache(),
            )
            .unwrap()
            .reshape([prompt.len(), D_MODEL])
            .narrow(0, matched.cached, new);
        assert_close(&format!("stack prompt {index}"), output, alone, 1e-5);
    }
    // The two whole blocks are stored once in each layer: 3 + 1 blocks, not 3 + 3.
    let block_bytes = cache.layers()[0].block_bytes();
    assert_eq!(cache.bytes_in_use(), 2 * 4 * block_bytes);
    // Tokens sampled later are told, and their whole blocks shared too.
    let first = cache.layers()[0].sequences().next().unwrap();
    stack
        .forward_paged(embeddings.rows(&[5, 6, 7]), &mut cache, &[first; 3])
        .unwrap();
    cache.extend_tokens(first, &[5, 6, 7]).unwrap();
    let continued = [&system(9)[..], &[5, 6, 7, 1]].concat();
    assert_eq!(cache.add_sequence_with_prompt(&continued).cached, 12);
}

/// Random schedules of continuous batching over small pools, on the CPU devices (and flex under
/// autodiff), in every storage, blocks of 4 and 16, in five configurations (grouped heads with
/// RoPE; ALiBi; a window, a soft cap and sinks; one key/value head, half-split RoPE and the
/// quiet softmax; `add_bias_kv` and `add_zero_attn`): each sequence gets, row by row, what decoding it alone with a `KvCache` gives it, whatever
/// joins, forks, leaves, shares its prompt's blocks or is refused around it; a refused step
/// changes nothing; the pool's blocks add up after every step and all come back at the end.
#[test]
fn random_schedules_of_joins_forks_leaves_and_refusals_equal_decoding_each_sequence_alone() {
    let mut exercised = Exercised::default();
    // flex and ndarray read the blocks in place (runs of up to 32 rows); under autodiff every
    // step gathers them.
    let devices = [
        ("flex", Device::flex()),
        ("ndarray", device_by_name("ndarray").unwrap()),
        ("flex autodiff", Device::flex().autodiff()),
    ];
    for (name, device) in devices {
        let _seed = common::seed(&device, 44);
        let embeddings = Embeddings::new(D_MODEL, &device);
        let configs = [
            (
                "gqa+rope",
                MultiHeadAttentionConfig::new(D_MODEL, 4)
                    .with_n_kv_heads(Some(2))
                    .with_rope(Some(RopeConfig::new())),
            ),
            (
                "mha+alibi",
                MultiHeadAttentionConfig::new(D_MODEL, 4).with_alibi(true),
            ),
            ("gqa+window+softcap+sinks", window_softcap_sinks(D_MODEL, 7)),
            (
                "mqa+rope-half+quiet",
                MultiHeadAttentionConfig::new(D_MODEL, 4)
                    .with_n_kv_heads(Some(1))
                    .with_rope(Some(RopeConfig::new().with_layout(RopeLayout::HalfSplit)))
                    .with_quiet_softmax(true),
            ),
            (
                "bias_kv+zero_attn",
                MultiHeadAttentionConfig::new(D_MODEL, 4)
                    .with_add_bias_kv(true)
                    .with_add_zero_attn(true),
            ),
        ];
        for (case, (label, config)) in configs.into_iter().enumerate() {
            let module = with_random_sinks(config.init(&device), &device);
            for storage in storages(&device) {
                // The last pool allocated whole on its first step.
                for (block_size, max_blocks, initial_blocks, seed) in
                    [(4, 24, 0, 1), (4, 24, 0, 2), (16, 8, 8, 3)]
                {
                    let label = format!("{name} {label} {storage:?} blocks of {block_size}");
                    let pool = PagedKvCacheConfig::new(max_blocks)
                        .with_block_size(block_size)
                        .with_initial_blocks(initial_blocks)
                        .with_storage(storage);
                    let seed = 1000 * case as u64 + seed;
                    // More schedules on flex and ndarray only: Burn 0.22 frees a forward's
                    // autodiff graph only when a backward runs (tracel-ai/burn#4970), so each
                    // schedule under autodiff holds about 0.7 GB until the test ends.
                    let seeds = if device.is_autodiff() {
                        vec![seed]
                    } else {
                        schedule_seeds(seed)
                    };
                    for seed in seeds {
                        let label = format!("{label}, schedule seed {seed}");
                        let mut harness = Harness::new(&module, &device, pool, label, 1e-5);
                        Schedule::run(&mut harness, &embeddings, seed, (150, &mut exercised));
                    }
                }
            }
        }
    }
    exercised.check_everything_happened();
    println!("{exercised:?}");
}

/// A fork holds its parent's positions and the tokens told of them, not the tokens its parent
/// was told past them (a prompt it has not fed yet): the fork's own tokens are filed where its
/// positions hold them, and a later prompt never shares a block of the fork's as one of the
/// parent's prompt.
#[test]
fn a_fork_does_not_inherit_the_tokens_its_parent_was_told_past_its_positions() {
    let device = Device::flex();
    let _seed = common::seed(&device, 45);
    let module = rope_module(&device);
    let embeddings = Embeddings::new(D_MODEL, &device);
    let mut cache = PagedKvCacheConfig::new(32).with_block_size(4).init();
    let prompt = system(14);
    let parent = cache.add_sequence_with_prompt(&prompt).id;
    // The parent feeds the first two blocks of its prompt only, then a fork of it feeds its
    // own four tokens into a third block.
    module
        .forward_paged(embeddings.rows(&prompt[..8]), &mut cache, &[parent; 8])
        .unwrap();
    let fork = cache.fork(parent).unwrap();
    let own = [60, 61, 62, 63];
    module
        .forward_paged(embeddings.rows(&own), &mut cache, &[fork; 4])
        .unwrap();
    cache.extend_tokens(fork, &own).unwrap();
    // The prompt shares the parent's two blocks, not the fork's third, which holds other tokens.
    let again = cache.add_sequence_with_prompt(&prompt);
    assert_eq!(again.cached, 8, "the fork's block shared as the prompt's");
    prefill_and_check(
        &module,
        &embeddings,
        &mut cache,
        (again.id, again.cached),
        &prompt,
        ("the prompt again", 1e-5),
    );
    // The fork's own tokens are filed where they lie: a prompt continuing it shares its third block.
    let continued = [&prompt[..8], &own[..], &[1]].concat();
    assert_eq!(cache.add_sequence_with_prompt(&continued).cached, 12);
}

/// A fork of a prefix that ends inside a filed block, left its only holder when the parent
/// goes, copies the block before it writes its own tokens there: the block stays what its
/// tokens say, and a later prompt shares it.
#[test]
fn a_fork_alone_in_a_filed_block_copies_it_before_writing_its_own_tokens() {
    let device = Device::flex();
    let _seed = common::seed(&device, 46);
    let module = rope_module(&device);
    let embeddings = Embeddings::new(D_MODEL, &device);
    let mut cache = PagedKvCacheConfig::new(32).with_block_size(4).init();
    let prompt = system(13);
    let parent = cache.add_sequence_with_prompt(&prompt);
    prefill_and_check(
        &module,
        &embeddings,
        &mut cache,
        (parent.id, parent.cached),
        &prompt,
        ("parent", 1e-5),
    );
    // The fork holds positions 8 and 9 of the parent's third block, filed whole.
    let fork = cache.fork_prefix(parent.id, 10).unwrap();
    cache.remove_sequence(parent.id).unwrap();
    let own = [60, 61];
    let output = module
        .forward_paged(embeddings.rows(&own), &mut cache, &[fork; 2])
        .unwrap();
    let mut alone = KvCache::new();
    let forked = [&prompt[..10], &own[..]].concat();
    let expected = module
        .forward_cached(
            MhaInput::self_attn(embeddings.rows(&forked).reshape([1, 12, D_MODEL])).causal(),
            &mut alone,
        )
        .unwrap()
        .context
        .reshape([12, D_MODEL])
        .narrow(0, 10, 2);
    assert_close("the fork's own tokens", output, expected, 1e-5);
    let again = cache.add_sequence_with_prompt(&prompt);
    assert_eq!(again.cached, 12, "the filed block kept");
    prefill_and_check(
        &module,
        &embeddings,
        &mut cache,
        (again.id, again.cached),
        &prompt,
        ("the prompt again", 1e-5),
    );
}
