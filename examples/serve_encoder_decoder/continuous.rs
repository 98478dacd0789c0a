//! Continuous batching through a `PagedTransformerDecoderCache`.

use std::time::{Duration, Instant};

use burn::tensor::Device;
use burn_mha::serving::{CacheBytes, Decision, Served};
use mha::transformer::PagedTransformerDecoderCache;
use mha::{PagedKvCacheConfig, SequenceId};

use crate::Settings;
use crate::model::{BLOCK_SIZE, D_MODEL, LAYERS, Model, POSITION_BYTES, Request, VOCAB};
use crate::search::Search;

/// A request in the batch: its search, and the sequence of each of its beams in the cache (one
/// until its forced start is fed).
struct Running {
    request: usize,
    search: Search,
    ids: Vec<SequenceId>,
    forced_fed: bool,
}

/// What admission did: the most requests in flight at once, the most blocks they reserved, how
/// many steps ran while an arrived request waited for blocks, the most requests that joined in
/// one step, and the time the encoder took over their sources.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Admission {
    pub(crate) encoding: Duration,
    pub(crate) most_in_flight: usize,
    pub(crate) most_reserved: usize,
    pub(crate) steps_with_a_request_waiting: usize,
    pub(crate) most_joined_in_a_step: usize,
}

/// The pool at its fullest: the blocks per layer its sequences took, and the blocks they would
/// have taken if beams shared none (each sequence its own blocks for all its positions).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FullestPool {
    pub(crate) blocks_in_use: usize,
    pub(crate) unshared: usize,
}

/// What continuous batching's scheduler did: its admissions, and the pool at its fullest.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Schedule {
    pub(crate) admission: Admission,
    pub(crate) fullest_pool: FullestPool,
}

/// Continuous batching over a pool of `pool_blocks` blocks per layer: at every step the
/// requests that arrived join, in order, while the blocks not reserved by the others hold
/// theirs (every beam's whole target), at most `joins_per_step` of them (each joining
/// request's source is encoded before the step, which the running requests then wait for);
/// every running request's beams feed their last tokens and every joining request its forced
/// start; a beam kept twice is forked (its blocks and source shared), a beam not kept leaves,
/// and a finished request leaves.
pub(crate) struct ContinuousBatching<'a> {
    model: &'a Model,
    requests: &'a [Request],
    device: &'a Device,
    cache: PagedTransformerDecoderCache,
    settings: Settings,
    /// Arrived or not, in arrival order; the front joins first.
    next_to_join: usize,
    running: Vec<Running>,
    tokens: Vec<Vec<i64>>,
    decisions: Vec<Vec<Decision>>,
    token_times: Vec<Vec<Duration>>,
    started: Instant,
    peak_cache: CacheBytes,
    admission: Admission,
    fullest_pool: FullestPool,
}

impl<'a> ContinuousBatching<'a> {
    /// Nothing served yet, the clock started.
    pub(crate) fn new(
        model: &'a Model,
        requests: &'a [Request],
        settings: Settings,
        device: &'a Device,
    ) -> Self {
        let config = PagedKvCacheConfig::new(settings.pool_blocks).with_block_size(BLOCK_SIZE);
        Self {
            model,
            requests,
            device,
            cache: model.decoder.new_paged_cache(config),
            settings,
            next_to_join: 0,
            running: Vec::new(),
            tokens: vec![Vec::new(); requests.len()],
            decisions: vec![Vec::new(); requests.len()],
            token_times: vec![Vec::new(); requests.len()],
            started: Instant::now(),
            peak_cache: CacheBytes::default(),
            admission: Admission::default(),
            fullest_pool: FullestPool::default(),
        }
    }

    /// Serves every request; returns what each got and when, and what the scheduler did.
    pub(crate) fn serve(mut self) -> (Served, Schedule) {
        while self.next_to_join < self.requests.len() || !self.running.is_empty() {
            self.admit();
            if self.running.is_empty() {
                let arrival = self.requests[self.next_to_join].arrival;
                std::thread::sleep(arrival.saturating_sub(self.started.elapsed()));
                continue;
            }
            self.step();
        }
        let served = Served {
            tokens: self.tokens,
            decisions: self.decisions,
            wall: self.started.elapsed(),
            token_times: self.token_times,
            arrivals: self.requests.iter().map(|r| r.arrival).collect(),
            peak_cache: self.peak_cache,
        };
        let schedule = Schedule {
            admission: self.admission,
            fullest_pool: self.fullest_pool,
        };
        (served, schedule)
    }

    /// The blocks a request reserves: each of its beams' whole target.
    fn reservation(&self, request: &Request) -> usize {
        request.blocks() * self.settings.beams
    }

    /// The blocks the running requests reserved.
    fn reserved(&self) -> usize {
        self.running
            .iter()
            .map(|run| self.reservation(&self.requests[run.request]))
            .sum()
    }

    /// Adds the requests that had arrived when it is called, in order, while the unreserved
    /// blocks hold theirs, at most `joins_per_step`; each one's source is encoded and projected
    /// as it joins.
    fn admit(&mut self) {
        let mut joined = 0;
        let joins_per_step = self.settings.joins_per_step.unwrap_or(usize::MAX);
        // Those that arrived by now: the ones arriving while these are encoded join at the
        // next step, so that the running requests (and these) get their tokens first.
        let now = self.started.elapsed();
        while let Some(request) = self.requests.get(self.next_to_join) {
            if request.arrival > now || joined == joins_per_step {
                break;
            }
            if self.reserved() + self.reservation(request) > self.settings.pool_blocks {
                self.admission.steps_with_a_request_waiting += 1;
                break;
            }
            let encoding = Instant::now();
            let memory = self.model.encode(&request.source, self.device);
            self.admission.encoding += encoding.elapsed();
            let memory = memory.reshape([request.source.len(), D_MODEL]);
            let id = self
                .model
                .decoder
                .add_paged_sequence(&mut self.cache, memory);
            self.running.push(Running {
                request: self.next_to_join,
                search: Search::new(
                    self.next_to_join,
                    self.settings.beams,
                    self.settings.decoding,
                ),
                ids: vec![id],
                forced_fed: false,
            });
            self.next_to_join += 1;
            joined += 1;
        }
        let (in_flight, reserved) = (self.running.len(), self.reserved());
        let admission = &mut self.admission;
        admission.most_in_flight = admission.most_in_flight.max(in_flight);
        admission.most_reserved = admission.most_reserved.max(reserved);
        admission.most_joined_in_a_step = admission.most_joined_in_a_step.max(joined);
    }

    /// One step: a joining request's forced start, every other's beams' last tokens; a token
    /// for each beam, and a finished request leaves.
    fn step(&mut self) {
        let (mut tokens, mut sequences) = (Vec::new(), Vec::new());
        for run in &self.running {
            if run.forced_fed {
                for (beam, &id) in run.search.beams.iter().zip(&run.ids) {
                    tokens.push(*beam.tokens.last().expect("a first token"));
                    sequences.push(id);
                }
            } else {
                let forced = &self.requests[run.request].forced;
                tokens.extend(forced);
                sequences.extend(std::iter::repeat_n(run.ids[0], forced.len()));
            }
        }
        let log_probs = self
            .model
            .step_paged(&tokens, &sequences, &mut self.cache, self.device);
        let now = self.started.elapsed();
        self.peak_cache = self.peak_cache.peak(self.cache_bytes());
        self.note_the_pools_fill();
        let mut rows = log_probs.chunks_exact(VOCAB);
        for run in &mut self.running {
            let beams = run.ids.len();
            let own: Vec<f32> = rows.by_ref().take(beams).flatten().copied().collect();
            let parents = run.search.step(&own);
            run.ids = continue_beams(&mut self.cache, &run.ids, &parents);
            run.forced_fed = true;
            self.token_times[run.request].push(now);
        }
        let (cache, requests) = (&mut self.cache, self.requests);
        let (tokens, decisions) = (&mut self.tokens, &mut self.decisions);
        self.running.retain_mut(|run| {
            let done = run.search.generated() == requests[run.request].max_tokens;
            if done {
                for &id in &run.ids {
                    cache.remove_sequence(id).expect("a running sequence");
                }
                (tokens[run.request], decisions[run.request]) = run.search.result();
            }
            !done
        });
    }

    /// Keeps the pool's fill and what it would be without shared blocks, if it is the fullest
    /// so far.
    fn note_the_pools_fill(&mut self) {
        let blocks_in_use = self.cache.self_attention().blocks_in_use();
        if blocks_in_use > self.fullest_pool.blocks_in_use {
            let unshared = self
                .running
                .iter()
                .flat_map(|run| &run.ids)
                .map(|&id| {
                    let len = self.cache.len(id).expect("a running sequence");
                    len.div_ceil(BLOCK_SIZE)
                })
                .sum();
            self.fullest_pool = FullestPool {
                blocks_in_use,
                unshared,
            };
        }
    }

    /// The cache's bytes now: the pools' blocks in use and allocated (a block that beams share
    /// counted once), and the projected sources (each request's once, shared by its beams;
    /// allocated as stored).
    fn cache_bytes(&self) -> CacheBytes {
        let sources: usize = self
            .running
            .iter()
            .map(|run| {
                self.cache
                    .memory_len(run.ids[0])
                    .expect("a running sequence")
            })
            .sum();
        let projected = sources * LAYERS * POSITION_BYTES;
        let pools = self.cache.self_attention();
        CacheBytes {
            stored: pools.bytes_in_use() + projected,
            allocated: pools.reserved_bytes() + projected,
        }
    }
}

/// The sequences of a step's survivors, `parents[i]` the index in `ids` of the beam survivor
/// `i` continues: a parent's first survivor takes its sequence, each other is a fork of it (its
/// blocks and source shared until it writes), and a beam no survivor continues leaves.
fn continue_beams(
    cache: &mut PagedTransformerDecoderCache,
    ids: &[SequenceId],
    parents: &[usize],
) -> Vec<SequenceId> {
    let mut taken = vec![false; ids.len()];
    let survivors = parents
        .iter()
        .map(|&parent| {
            if std::mem::replace(&mut taken[parent], true) {
                cache.fork(ids[parent]).expect("a running sequence")
            } else {
                ids[parent]
            }
        })
        .collect();
    for (&id, _) in ids.iter().zip(&taken).filter(|(_, taken)| !**taken) {
        cache.remove_sequence(id).expect("a running sequence");
    }
    survivors
}
