//! Prefix caching: a sequence added with its prompt shares the whole blocks of the longest
//! prefix the paged cache holds (in use, or freed and not yet overwritten), and gets what
//! computing its whole prompt alone gives it; a block overwritten is never matched again. Random
//! schedules mix prompts that share blocks with forks, departures and refused steps.

mod common;

use std::collections::BTreeMap;

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use common::paged_harness::Harness;
use common::{
    assert_close, device_by_name, randn, storages, test_devices, tolerance, window_softcap_sinks,
    with_random_sinks,
};
use mha::{
    CacheStorage, KvCache, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig, PagedCacheError,
    PagedKvCache, PagedKvCacheConfig, RopeConfig, SequenceId, Token,
};

const D_MODEL: usize = 16;
const VOCAB: usize = 64;

/// A vocabulary's embeddings: what a model feeds the attention for each token.
struct Embeddings {
    table: Tensor<2>,
}

impl Embeddings {
    fn new(device: &Device) -> Self {
        Self {
            table: randn([VOCAB, D_MODEL], device),
        }
    }

    /// `[tokens, d_model]`.
    fn rows(&self, tokens: &[Token]) -> Tensor<2> {
        let ids: Vec<i64> = tokens.iter().map(|&token| i64::from(token)).collect();
        let ids =
            Tensor::<1, Int>::from_data(TensorData::new(ids, [tokens.len()]), &self.table.device());
        self.table.clone().select(0, ids)
    }
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

/// The first `n` tokens of a fixed prompt.
fn system(n: usize) -> Vec<Token> {
    (0..n as Token)
        .map(|token| (token * 7 + 3) % VOCAB as Token)
        .collect()
}

#[test]
fn prompts_share_the_blocks_of_their_longest_held_prefix_and_equal_computing_them_alone() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 41);
        let module = MultiHeadAttentionConfig::new(D_MODEL, 4)
            .with_n_kv_heads(Some(2))
            .with_rope(Some(RopeConfig::new()))
            .init(&device);
        let embeddings = Embeddings::new(&device);
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
    let module = MultiHeadAttentionConfig::new(D_MODEL, 4)
        .with_rope(Some(RopeConfig::new()))
        .init(&device);
    let embeddings = Embeddings::new(&device);
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
    let embeddings = Embeddings::new(&device);
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

/// A schedule's choices, from a seed of its own (SplitMix64): the rows' values come from the
/// backend's generator, which the test seeds.
struct Choices(u64);

impl Choices {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `range`.
    fn within(&mut self, range: std::ops::RangeInclusive<usize>) -> usize {
        range.start() + (self.next() % (range.end() - range.start() + 1) as u64) as usize
    }

    fn chance(&mut self, percent: usize) -> bool {
        self.within(0..=99) < percent
    }

    fn tokens(&mut self, count: usize) -> Vec<Token> {
        (0..count)
            .map(|_| self.within(0..=VOCAB - 1) as Token)
            .collect()
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.within(0..=items.len() - 1)]
    }
}

/// A sequence of a schedule as the test knows it: the tokens its positions hold, the rest of
/// its prompt that its next step feeds, and how many of its tokens the cache was told.
#[derive(Clone, Default)]
struct Scheduled {
    held: Vec<Token>,
    pending: Vec<Token>,
    told: usize,
}

/// What the schedules of a test did, summed: so that the test can check that they did what it
/// is about.
#[derive(Default)]
struct Exercised {
    refused_steps: usize,
    shared_prompt_positions: usize,
    forks: usize,
    steps_past_32_rows: usize,
}

/// One random schedule through a [`Harness`]: sequences join (empty, or with a prompt that
/// starts with one of a few system prompts or with a conversation held or left before, sharing
/// what the pool holds of it), fork (whole, or a prefix), leave, and take steps together (one
/// row, a continuation, a whole prompt or a chunk of one, past 32 rows too); a step the pool
/// refuses is checked to change nothing, and a sequence of it leaves, as a server would preempt
/// it. Every sequence is told its tokens, so that later prompts share its whole blocks.
struct Schedule<'s, 'a> {
    harness: &'s mut Harness<'a>,
    embeddings: &'s Embeddings,
    choices: Choices,
    live: BTreeMap<SequenceId, Scheduled>,
    /// The tokens of the sequences that left.
    departed: Vec<Vec<Token>>,
    exercised: &'s mut Exercised,
}

impl Schedule<'_, '_> {
    /// `ops` random operations, then every sequence leaves and every block must be free.
    fn run(mut self, ops: usize) {
        for _ in 0..ops {
            let ids: Vec<SequenceId> = self.live.keys().copied().collect();
            if ids.is_empty() || (ids.len() < 6 && self.choices.chance(25)) {
                self.join();
                continue;
            }
            if self.choices.chance(12) && self.fork() {
                continue;
            }
            if ids.len() > 1 && self.choices.chance(12) {
                let id = self.choices.pick(&ids);
                self.leave(id);
                continue;
            }
            self.step(&ids);
        }
        let ids: Vec<SequenceId> = self.live.keys().copied().collect();
        for id in ids {
            self.leave(id);
        }
        let paged = &self.harness.paged;
        assert_eq!(
            (paged.blocks_in_use(), paged.free_blocks()),
            (0, paged.config().max_blocks),
            "every block back in the pool"
        );
    }

    /// A new sequence, empty or with a prompt.
    fn join(&mut self) {
        if !self.choices.chance(60) {
            self.live.insert(self.harness.add(), Scheduled::default());
            return;
        }
        // A new request, or one that continues a conversation held or left before (whose
        // generated tokens the cache was told too).
        let conversations: Vec<&Vec<Token>> = self
            .live
            .values()
            .map(|sequence| &sequence.held)
            .chain(&self.departed)
            .filter(|held| !held.is_empty())
            .collect();
        let start = if conversations.is_empty() || self.choices.chance(50) {
            system(self.choices.pick(&[9, 13, 20, 35]))
        } else {
            let held = self.choices.pick(&conversations);
            held[..self.choices.within(1..=held.len())].to_vec()
        };
        let suffix = self.choices.within(1..=6);
        let prompt = [start, self.choices.tokens(suffix)].concat();
        let (id, cached) = self
            .harness
            .add_with_prompt(&prompt, self.embeddings.rows(&prompt));
        self.exercised.shared_prompt_positions += cached;
        let sequence = Scheduled {
            held: prompt[..cached].to_vec(),
            pending: prompt[cached..].to_vec(),
            told: prompt.len(),
        };
        self.live.insert(id, sequence);
    }

    /// A fork of a sequence that holds positions, whole or a prefix; false if none does.
    fn fork(&mut self) -> bool {
        let with_positions: Vec<SequenceId> = self
            .live
            .iter()
            .filter(|(_, sequence)| !sequence.held.is_empty())
            .map(|(&id, _)| id)
            .collect();
        if with_positions.is_empty() {
            return false;
        }
        // Often one whose prompt is still to feed: the cache was told tokens past its
        // positions, which its forks must not inherit.
        let prompting: Vec<SequenceId> = with_positions
            .iter()
            .copied()
            .filter(|id| !self.live[id].pending.is_empty())
            .collect();
        let parent = if !prompting.is_empty() && self.choices.chance(50) {
            self.choices.pick(&prompting)
        } else {
            self.choices.pick(&with_positions)
        };
        let len = self.live[&parent].held.len();
        let (id, kept) = if self.choices.chance(50) {
            (self.harness.fork(parent), len)
        } else {
            let prefix = self.choices.within(1..=len);
            (self.harness.fork_prefix(parent, prefix), prefix)
        };
        self.exercised.forks += 1;
        // A fork's record keeps the tokens told of its positions; it feeds its own next.
        let sequence = Scheduled {
            held: self.live[&parent].held[..kept].to_vec(),
            pending: Vec::new(),
            told: self.live[&parent].told.min(kept),
        };
        self.live.insert(id, sequence);
        true
    }

    fn leave(&mut self, id: SequenceId) {
        self.harness.remove(id);
        let sequence = self.live.remove(&id).expect("a live sequence");
        self.departed.push(sequence.held);
    }

    /// A step of some of `ids` (at least one): refused by a full pool, one of them leaves.
    fn step(&mut self, ids: &[SequenceId]) {
        let mut stepping: Vec<SequenceId> = ids
            .iter()
            .copied()
            .filter(|_| self.choices.chance(60))
            .collect();
        if stepping.is_empty() {
            stepping.push(self.choices.pick(ids));
        }
        let fed: Vec<(SequenceId, Vec<Token>)> = stepping
            .iter()
            .map(|&id| (id, self.next_tokens(id)))
            .collect();
        let rows: Vec<(SequenceId, usize)> =
            fed.iter().map(|(id, tokens)| (*id, tokens.len())).collect();
        let all: Vec<Token> = fed.iter().flat_map(|(_, tokens)| tokens.clone()).collect();
        match self.harness.try_step(&rows, self.embeddings.rows(&all)) {
            Ok(()) => {
                self.exercised.steps_past_32_rows += rows.iter().filter(|(_, n)| *n > 32).count();
                for (id, tokens) in fed {
                    self.fed(id, tokens);
                }
            }
            Err(PagedCacheError::PoolFull { .. }) => {
                self.exercised.refused_steps += 1;
                let id = self.choices.pick(&stepping);
                self.leave(id);
            }
            Err(error) => panic!("a step refused for another reason: {error}"),
        }
    }

    /// The tokens `id` feeds in a step: the rest of its prompt or a chunk of it (chunked
    /// prefill); else a prompt of its own if it holds nothing, a continuation, or one token.
    fn next_tokens(&mut self, id: SequenceId) -> Vec<Token> {
        let sequence = &self.live[&id];
        let (pending, holds_nothing) = (sequence.pending.len(), sequence.held.is_empty());
        if pending > 0 {
            let len = if self.choices.chance(30) {
                self.choices.within(1..=pending)
            } else {
                pending
            };
            return self.live[&id].pending[..len].to_vec();
        }
        let len = if holds_nothing {
            self.choices.within(1..=40)
        } else if self.choices.chance(15) {
            self.choices.within(2..=36)
        } else {
            1
        };
        self.choices.tokens(len)
    }

    /// `id` took `tokens` in a step: they are held, and the cache is told those it was not.
    fn fed(&mut self, id: SequenceId, tokens: Vec<Token>) {
        let sequence = self.live.get_mut(&id).expect("a live sequence");
        let prompted = tokens.len().min(sequence.pending.len());
        sequence.pending.drain(..prompted);
        sequence.held.extend(tokens);
        if sequence.held.len() > sequence.told {
            let untold = &sequence.held[sequence.told..];
            self.harness.paged.extend_tokens(id, untold).unwrap();
            sequence.told = sequence.held.len();
        }
    }
}

/// Random schedules of continuous batching over small pools, on the CPU devices (and flex under
/// autodiff), in every
/// storage, blocks of 4 and 16, with RoPE, with ALiBi, and with a window, a soft cap and sinks:
/// each sequence gets, row by row, what decoding it alone with a `KvCache` gives it, whatever
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
        let embeddings = Embeddings::new(&device);
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
        ];
        for (case, (label, config)) in configs.into_iter().enumerate() {
            let module = with_random_sinks(config.init(&device), &device);
            for storage in storages(&device) {
                for (block_size, max_blocks, seed) in [(4, 24, 1), (4, 24, 2), (16, 8, 3)] {
                    let label = format!("{name} {label} {storage:?} blocks of {block_size}");
                    let pool = PagedKvCacheConfig::new(max_blocks)
                        .with_block_size(block_size)
                        .with_storage(storage);
                    let mut harness = Harness::new(&module, &device, pool, label, 1e-5);
                    Schedule {
                        harness: &mut harness,
                        embeddings: &embeddings,
                        choices: Choices(1000 * case as u64 + seed),
                        live: BTreeMap::new(),
                        departed: Vec::new(),
                        exercised: &mut exercised,
                    }
                    .run(150);
                }
            }
        }
    }
    let Exercised {
        refused_steps,
        shared_prompt_positions,
        forks,
        steps_past_32_rows,
    } = exercised;
    assert!(
        refused_steps > 0 && shared_prompt_positions > 0 && forks > 0 && steps_past_32_rows > 0,
        "the schedules did not do what this test is about: {refused_steps} refused steps, \
         {shared_prompt_positions} positions shared by prompts, {forks} forks, \
         {steps_past_32_rows} runs of more than 32 rows"
    );
    println!(
        "{refused_steps} refused steps, {shared_prompt_positions} positions shared by prompts, \
         {forks} forks, {steps_past_32_rows} runs of more than 32 rows"
    );
}

/// A fork holds its parent's positions and the tokens told of them, not the tokens its parent
/// was told past them (a prompt it has not fed yet): the fork's own tokens are filed where its
/// positions hold them, and a later prompt never shares a block of the fork's as one of the
/// parent's prompt.
#[test]
fn a_fork_does_not_inherit_the_tokens_its_parent_was_told_past_its_positions() {
    let device = Device::flex();
    let _seed = common::seed(&device, 45);
    let module = MultiHeadAttentionConfig::new(D_MODEL, 4)
        .with_rope(Some(RopeConfig::new()))
        .init(&device);
    let embeddings = Embeddings::new(&device);
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
    let module = MultiHeadAttentionConfig::new(D_MODEL, 4)
        .with_rope(Some(RopeConfig::new()))
        .init(&device);
    let embeddings = Embeddings::new(&device);
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
