//! Random schedules of continuous batching: sequences join, fork, leave and step together
//! through a paged cache (one module's, `paged_harness.rs`, or a stack's, `paged_stack.rs`)
//! whose harness checks every row against its sequence decoded alone.

use std::collections::BTreeMap;

use burn::tensor::{Device, Int, Tensor, TensorData};
use mha::{PagedCacheError, SequenceId, Token};

use super::{Rng, randn};

/// Tokens of the schedules' vocabulary.
pub const VOCAB: usize = 64;

/// A paged cache beside a reference per sequence, as a [`Schedule`] drives it: each method
/// does what the cache's method of that name does, to the reference as well; a step is checked
/// row by row.
pub trait Served {
    fn add(&mut self) -> SequenceId;
    /// A sequence added with its `prompt` (`rows` what its tokens give): gives the sequence and
    /// the positions shared from the pool; the next step feeds the prompt from there.
    fn add_with_prompt(&mut self, prompt: &[Token], rows: Tensor<2>) -> (SequenceId, usize);
    fn fork(&mut self, parent: SequenceId) -> SequenceId;
    /// `None` where the parent gave back positions in the fork's window (the harness checks
    /// that it had to).
    fn fork_prefix(&mut self, parent: SequenceId, prefix: usize) -> Option<SequenceId>;
    /// `id` cut back to its first `len` positions; false where it gave back positions in
    /// their window (the harness checks that it had to, and that nothing changed).
    fn truncate(&mut self, id: SequenceId, len: usize) -> bool;
    fn remove(&mut self, id: SequenceId);
    /// A step of `rows` (`x`, `[rows, d_model]`): refused, it must have changed nothing.
    fn try_step(
        &mut self,
        rows: &[(SequenceId, usize)],
        x: Tensor<2>,
    ) -> Result<(), PagedCacheError>;
    fn extend_tokens(&mut self, id: SequenceId, tokens: &[Token]);
    /// The tokens the cache says `id` was told.
    fn tokens(&self, id: SequenceId) -> Vec<Token>;
    /// Panics unless every block of the pool (of every layer) is free.
    fn check_all_blocks_free(&self);
    /// Whether the harness holds a model that a later layer's range refuses
    /// ([`try_step_refused_by_a_later_layer`](Self::try_step_refused_by_a_later_layer)).
    fn refuses_in_a_later_layer(&self) -> bool {
        false
    }
    /// The step of `rows` through the harness's model whose later layer's keys exceed f16's
    /// range: it must be refused (by that layer, or by a full pool first), the layers before
    /// it taking the step back, and leave every sequence's length and the pools' blocks in use
    /// and free as they were. Gives the refusal.
    ///
    /// # Panics
    ///
    /// Where [`refuses_in_a_later_layer`](Self::refuses_in_a_later_layer) is false.
    fn try_step_refused_by_a_later_layer(
        &mut self,
        _rows: &[(SequenceId, usize)],
        _x: Tensor<2>,
    ) -> PagedCacheError {
        panic!("this harness has no model that a later layer refuses")
    }
}

/// A vocabulary's embeddings: what a model feeds the attention for each token.
pub struct Embeddings {
    table: Tensor<2>,
}

impl Embeddings {
    /// `VOCAB` tokens of `d_model` features.
    pub fn new(d_model: usize, device: &Device) -> Self {
        Self {
            table: randn([VOCAB, d_model], device),
        }
    }

    /// `[tokens, d_model]`.
    pub fn rows(&self, tokens: &[Token]) -> Tensor<2> {
        let ids: Vec<i64> = tokens.iter().map(|&token| i64::from(token)).collect();
        let ids =
            Tensor::<1, Int>::from_data(TensorData::new(ids, [tokens.len()]), &self.table.device());
        self.table.clone().select(0, ids)
    }
}

/// The first `n` tokens of a fixed prompt.
pub fn system(n: usize) -> Vec<Token> {
    (0..n as Token)
        .map(|token| (token * 7 + 3) % VOCAB as Token)
        .collect()
}

/// The seeds of a test's schedule drawn from `seed`: `seed` alone, or with
/// `MHA_RANDOM_SCHEDULES=<n>` `n` seeds, `seed` first (more schedules, for a search for
/// failures beyond the ones CI runs; a failure names its seed, which the schedule replays
/// from).
pub fn schedule_seeds(seed: u64) -> Vec<u64> {
    let count = std::env::var("MHA_RANDOM_SCHEDULES")
        .ok()
        .map(|count| {
            count
                .parse::<u64>()
                .ok()
                .filter(|&count| count > 0)
                .expect("MHA_RANDOM_SCHEDULES=<n>, n at least 1")
        })
        .unwrap_or(1);
    (0..count).map(|index| seed + 1_000_003 * index).collect()
}

/// A schedule's choices, from a seed of its own ([`Rng`]): the rows' values come from the
/// backend's generator, which the test seeds.
struct Choices(Rng);

impl Choices {
    /// A number in `range`.
    fn within(&mut self, range: std::ops::RangeInclusive<usize>) -> usize {
        range.start() + self.0.below(range.end() - range.start() + 1)
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
        self.0.pick(items)
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
#[derive(Debug, Default)]
pub struct Exercised {
    pub refused_steps: usize,
    pub shared_prompt_positions: usize,
    pub forks: usize,
    /// Forks of a prefix refused because the parent gave back positions in their window.
    pub forks_refused: usize,
    /// Sequences cut back to fewer positions (draft tokens rejected), and cuts refused as
    /// forks are.
    pub truncations: usize,
    pub truncations_refused: usize,
    pub steps_past_32_rows: usize,
    /// Steps a later layer refused, which the layers before it took back.
    pub steps_taken_back: usize,
}

impl Exercised {
    /// Panics unless the schedules refused steps, shared prompts' positions, forked, cut
    /// sequences back and ran more than 32 rows of a sequence in a step: what a test of them
    /// is about.
    pub fn check_everything_happened(&self) {
        let Exercised {
            refused_steps,
            shared_prompt_positions,
            forks,
            truncations,
            steps_past_32_rows,
            ..
        } = *self;
        assert!(
            refused_steps > 0
                && shared_prompt_positions > 0
                && forks > 0
                && truncations > 0
                && steps_past_32_rows > 0,
            "the schedules did not do what the test is about: {self:?}"
        );
    }
}

/// One random schedule through a [`Served`] cache: sequences join (empty, or with a prompt that
/// starts with one of a few system prompts or with a conversation held or left before, sharing
/// what the pool holds of it), fork (whole, or a prefix), leave, and take steps together (one
/// row, a continuation, a whole prompt or a chunk of one, past 32 rows too); a step the pool
/// refuses is checked to change nothing, and a sequence of it leaves, as a server would preempt
/// it; where the harness holds a model a later layer refuses, a step is sometimes first tried
/// through it and taken back. Every sequence is told its tokens, so that later prompts share
/// its whole blocks.
pub struct Schedule<'s, S> {
    harness: &'s mut S,
    embeddings: &'s Embeddings,
    choices: Choices,
    live: BTreeMap<SequenceId, Scheduled>,
    /// The tokens of the sequences that left.
    departed: Vec<Vec<Token>>,
    exercised: &'s mut Exercised,
}

impl<'s, S: Served> Schedule<'s, S> {
    /// `ops` random operations through `harness`, chosen from `seed`, counted in `exercised`;
    /// then every sequence leaves and every block must be free.
    pub fn run(
        harness: &'s mut S,
        embeddings: &'s Embeddings,
        seed: u64,
        (ops, exercised): (usize, &'s mut Exercised),
    ) {
        Schedule {
            harness,
            embeddings,
            choices: Choices(Rng(seed)),
            live: BTreeMap::new(),
            departed: Vec::new(),
            exercised,
        }
        .operations(ops);
    }

    fn operations(mut self, ops: usize) {
        for _ in 0..ops {
            let ids: Vec<SequenceId> = self.live.keys().copied().collect();
            if ids.is_empty() || (ids.len() < 6 && self.choices.chance(25)) {
                self.join();
                continue;
            }
            if self.choices.chance(12) && self.fork() {
                continue;
            }
            if self.choices.chance(8) && self.truncate() {
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
        self.harness.check_all_blocks_free();
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

    /// The live sequences that hold positions.
    fn with_positions(&self) -> Vec<SequenceId> {
        self.live
            .iter()
            .filter(|(_, sequence)| !sequence.held.is_empty())
            .map(|(&id, _)| id)
            .collect()
    }

    /// A fork of a sequence that holds positions, whole or a prefix; false if none does.
    fn fork(&mut self) -> bool {
        let with_positions = self.with_positions();
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
        let prefix = self.choices.within(1..=len);
        let (id, kept) = match self.choices.chance(50) {
            false => match self.harness.fork_prefix(parent, prefix) {
                Some(id) => (id, prefix),
                None => {
                    self.exercised.forks_refused += 1;
                    (self.harness.fork(parent), len)
                }
            },
            true => (self.harness.fork(parent), len),
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

    /// A sequence that holds positions cut back to fewer (draft tokens a speculative step
    /// rejected): the rest of its prompt, if any, is dropped; false if none holds positions.
    fn truncate(&mut self) -> bool {
        let with_positions = self.with_positions();
        if with_positions.is_empty() {
            return false;
        }
        let id = self.choices.pick(&with_positions);
        let len = self.choices.within(0..=self.live[&id].held.len() - 1);
        if !self.harness.truncate(id, len) {
            self.exercised.truncations_refused += 1;
            return true;
        }
        self.exercised.truncations += 1;
        let sequence = self.live.get_mut(&id).expect("a live sequence");
        sequence.held.truncate(len);
        sequence.pending.clear();
        sequence.told = sequence.told.min(len);
        self.check_tokens(id);
        true
    }

    /// Panics unless the cache holds the tokens `id` was told, as far as it was told them.
    fn check_tokens(&self, id: SequenceId) {
        let sequence = &self.live[&id];
        let known = [&sequence.held[..], &sequence.pending[..]].concat();
        assert_eq!(
            self.harness.tokens(id),
            known[..sequence.told],
            "the tokens {id} was told"
        );
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
        let x = self.embeddings.rows(&all);
        // Now and then the step is first refused by a later layer (where the harness can): the
        // layers before it take it back, and the step is then taken as if never tried.
        if self.harness.refuses_in_a_later_layer() && self.choices.chance(20) {
            let refusal = self
                .harness
                .try_step_refused_by_a_later_layer(&rows, x.clone());
            if let PagedCacheError::BeyondHalfRange { .. } = refusal {
                self.exercised.steps_taken_back += 1;
            }
        }
        match self.harness.try_step(&rows, x) {
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
            self.harness.extend_tokens(id, untold);
            sequence.told = sequence.held.len();
        }
        self.check_tokens(id);
    }
}
