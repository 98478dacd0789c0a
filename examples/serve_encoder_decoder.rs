//! Serving a stream of requests with a small (untrained) encoder-decoder model, as a
//! translation or speech-recognition server does, two ways: continuous batching through a
//! `PagedTransformerDecoderCache`, and one request at a time with a `TransformerDecoderCache`.
//!
//! Each request brings a source of its own length and a short forced start of its output (a
//! start token and up to seven tokens, as Whisper's task tokens), and wants some tokens back.
//! When it arrives the encoder reads its source alone; continuous batching then adds it to the
//! running batch with `add_paged_sequence` (every decoder layer's cross-attention projects the
//! encoder's output once) and feeds its forced start in the same step as the other requests'
//! next tokens, each request attending to its own source however long, none padded to another's.
//! A finished request's blocks and projected source go at once.
//!
//! A request joins while the pool's blocks not yet reserved hold its forced start and every
//! token it may want (its `max_tokens`): it never needs a block the pool lacks, and a pool too
//! small for the stream's peak (`--pool-blocks N`, 512 blocks of 16 per layer by default) makes
//! requests wait for others to finish instead. (`examples/serve.rs` shows the other way, vLLM's:
//! joining without a reservation, and preempting a request when the pool runs out.)
//!
//! Requests arrive one every 2 ms, or every `N` ms with `--arrival-ms N` (0: all at once, the
//! schedule then the same on every machine). Every request that has arrived joins at the next
//! step by default, its source encoded before the step: the running requests wait for those
//! encodings. `--joins-per-step N` lets at most `N` join a step, which shortens the longest
//! waits between the running requests' tokens and lengthens the joining requests' wait for
//! their first.
//!
//! With `--beams N` each request runs a beam search of `N` beams instead of greedy decoding
//! (Whisper's and translation's way): continuous batching feeds every beam's last token in the
//! step, a beam kept twice is forked (`PagedTransformerDecoderCache::fork`: its blocks and
//! projected source shared, a block copied when a beam first writes into a shared one) and a
//! beam not kept is removed; one at a time runs the beams as a batch, its caches keeping the
//! survivors (`select_batch`, which copies them). A request reserves blocks for each of its
//! beams, and returns its best beam.
//!
//! Both ways choose the same way, so each request must get the same tokens either way, unless
//! the first decision where the two ways part was a near tie, its candidates' scores within
//! rounding of each other (reported): greedy decoding's token (its two largest logits), a beam
//! step's set of beams kept (the last kept against the best left out), or which beam is best
//! (its lead over the next). The example exits with status 1, naming the requests, if one parts
//! anywhere else. It prints tokens per second, time
//! to first token (its source's encoding included), time between tokens and peak cache memory
//! for each way: the bytes the requests in flight store (their decoder positions, each
//! sequence's last block whole, and every layer's projection of their sources) and what the
//! caches had allocated.
//!
//! ```sh
//! cargo run --release --example serve_encoder_decoder -- --device flex   # or ndarray; wgpu with `--features wgpu`
//! cargo run --release --example serve_encoder_decoder -- --pool-blocks 64
//! cargo run --release --example serve_encoder_decoder -- --joins-per-step 1
//! cargo run --release --example serve_encoder_decoder -- --beams 4
//! cargo run --release --example serve_encoder_decoder -- --arrival-ms 0   # all at once
//! ```

use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::{Duration, Instant};

use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Tensor};
use burn_mha::serving::{
    Beam, CacheBytes, Decision, Numbers, Served, TABLE_HEADER, best_continuations,
    check_same_tokens, embed, last_rows, report, space_arrivals,
};
use burn_mha::{ProgramOptions, device_and_options};
use mha::transformer::{
    PagedTransformerDecoderCache, TransformerDecoder, TransformerDecoderCache,
    TransformerDecoderConfig, TransformerDecoderInput, TransformerEncoder,
    TransformerEncoderConfig, TransformerEncoderInput,
};
use mha::{PagedKvCacheConfig, RopeConfig, SequenceId};

const VOCAB: usize = 256;
const D_MODEL: usize = 256;
/// Layers of the encoder, and of the decoder.
const LAYERS: usize = 2;
const HEADS: usize = 8;
const KV_HEADS: usize = 2;
/// Bytes a layer stores per position, of the decoder's own or of a projected source: an f32
/// key and value per key/value head.
const POSITION_BYTES: usize = 2 * KV_HEADS * (D_MODEL / HEADS) * 4;
const REQUESTS: usize = 32;
/// A request arrives every this many milliseconds unless `--arrival-ms` says otherwise.
const ARRIVAL_INTERVAL_MS: u64 = 2;
const BLOCK_SIZE: usize = 16;
/// The pool's bound per layer unless `--pool-blocks` says otherwise: 8192 positions.
const POOL_BLOCKS: usize = 512;
/// The token every output starts with.
const START: i64 = 1;

/// One client's request: its source, the forced start of its output, and how many tokens it
/// wants after that.
struct Request {
    arrival: Duration,
    source: Vec<i64>,
    /// [`START`], then up to seven tokens.
    forced: Vec<i64>,
    max_tokens: usize,
}

impl Request {
    /// The decoder positions it takes: its forced start and every token it wants (the last one
    /// generated is not fed back).
    fn target_len(&self) -> usize {
        self.forced.len() + self.max_tokens - 1
    }

    /// The blocks of one layer's pool its decoder positions take.
    fn blocks(&self) -> usize {
        self.target_len().div_ceil(BLOCK_SIZE)
    }
}

/// A deterministic stream of requests: sources of 16–320 tokens, forced starts of 1–8 tokens,
/// 16–128 tokens wanted.
fn requests() -> Vec<Request> {
    let mut numbers = Numbers::new(0x9e37_79b9_7f4a_7c15);
    let mut next = |below: usize| numbers.below(below as u64) as usize;
    (0..REQUESTS)
        .map(|_| {
            let source_len = 16 + next(305);
            let source = (0..source_len).map(|_| next(VOCAB) as i64).collect();
            let forced_len = next(8);
            let forced = std::iter::once(START)
                .chain((0..forced_len).map(|_| next(VOCAB) as i64))
                .collect();
            Request {
                // Spaced by `main` (`--arrival-ms`).
                arrival: Duration::ZERO,
                source,
                forced,
                max_tokens: 16 + next(113),
            }
        })
        .collect()
}

/// A shared embedding, a (bidirectional) encoder, a causal decoder, and a head to the
/// vocabulary.
struct Model {
    embedding: Embedding,
    encoder: TransformerEncoder,
    decoder: TransformerDecoder,
    head: Linear,
}

impl Model {
    fn new(device: &Device) -> Self {
        Self {
            embedding: EmbeddingConfig::new(VOCAB, D_MODEL).init(device),
            encoder: TransformerEncoderConfig::new(D_MODEL, 4 * D_MODEL, HEADS, LAYERS)
                .with_n_kv_heads(Some(KV_HEADS))
                .with_rope(Some(RopeConfig::new()))
                .with_norm_first(true)
                .with_dropout(0.0)
                .init(device),
            decoder: TransformerDecoderConfig::new(D_MODEL, 4 * D_MODEL, HEADS, LAYERS)
                .with_n_kv_heads(Some(KV_HEADS))
                .with_rope(Some(RopeConfig::new()))
                .with_norm_first(true)
                .with_dropout(0.0)
                .init(device),
            head: LinearConfig::new(D_MODEL, VOCAB).init(device),
        }
    }

    /// `tokens` embedded, `[1, tokens, d_model]`.
    fn embed(&self, tokens: &[i64], device: &Device) -> Tensor<3> {
        embed(&self.embedding, tokens, device)
    }

    /// The encoder's output for `source` alone, `[1, source, d_model]`.
    fn encode(&self, source: &[i64], device: &Device) -> Tensor<3> {
        self.encoder
            .forward(TransformerEncoderInput::new(self.embed(source, device)))
    }

    /// Next-token log-probabilities of one paged step, `[runs, vocab]` row by row:
    /// `tokens[i]` belongs to `sequences[i]`; one row per run of rows (its last row's).
    fn step_paged(
        &self,
        tokens: &[i64],
        sequences: &[SequenceId],
        cache: &mut PagedTransformerDecoderCache,
        device: &Device,
    ) -> Vec<f32> {
        let x = self.embed(tokens, device).reshape([tokens.len(), D_MODEL]);
        let hidden = self
            .decoder
            .forward_paged(x, cache, sequences)
            .expect("admission reserves every block a request takes");
        log_probs(self.head.forward(last_rows(hidden, sequences)))
    }

    /// Next-token log-probabilities after `tokens` (`[batch, new]`, row by row) fed to
    /// `cache` over `memory`, `[batch, vocab]` row by row.
    fn step_cached(
        &self,
        tokens: &[i64],
        batch: usize,
        memory: &Tensor<3>,
        cache: &mut TransformerDecoderCache,
        device: &Device,
    ) -> Vec<f32> {
        let new = tokens.len() / batch;
        let x = self.embed(tokens, device).reshape([batch, new, D_MODEL]);
        let input = TransformerDecoderInput::new(x, memory.clone());
        let hidden = self
            .decoder
            .forward_cached(input, cache)
            .expect("the decoder's own caches take every step");
        let last = hidden.narrow(1, new - 1, 1).reshape([batch, D_MODEL]);
        log_probs(self.head.forward(last))
    }
}

/// `logits`' log-softmax over the vocabulary, row by row.
fn log_probs(logits: Tensor<2>) -> Vec<f32> {
    log_softmax(logits, 1)
        .into_data()
        .try_to_vec::<f32>()
        .expect("f32 logits")
}

/// A request's beam search as it goes: its beams, best first, and the decisions that kept them.
struct Search {
    width: usize,
    beams: Vec<Beam>,
    /// Each step's: the set of beams it kept, by the margin of its
    /// [`Survivors`](burn_mha::serving::Survivors).
    decisions: Vec<Decision>,
}

impl Search {
    fn new(width: usize) -> Self {
        Self {
            width,
            beams: vec![Beam::start()],
            decisions: Vec::new(),
        }
    }

    /// Every beam's next token from its row of `log_probs`; returns each survivor's parent.
    fn step(&mut self, log_probs: &[f32]) -> Vec<usize> {
        let survivors = best_continuations(&self.beams, log_probs, self.width);
        self.beams = survivors.beams;
        // The set kept, not its order: two ways may order beams of about equal scores apart
        // and still keep the same ones (which is best is the last decision's).
        let mut kept: Vec<&[i64]> = self.beams.iter().map(|b| b.tokens.as_slice()).collect();
        kept.sort_unstable();
        self.decisions.push(Decision {
            chosen: fingerprint(&kept),
            margin: survivors.margin,
        });
        survivors.parents
    }

    /// Tokens generated so far by each beam.
    fn generated(&self) -> usize {
        self.beams[0].tokens.len()
    }

    /// The best beam's tokens, and the search's decisions: each step's, then, with more than
    /// one beam, which beam is best, by its lead over the next.
    fn result(self) -> (Vec<i64>, Vec<Decision>) {
        let Self {
            width,
            mut beams,
            mut decisions,
        } = self;
        if width > 1 {
            let lead = beams
                .get(1)
                .map_or(f32::INFINITY, |next| beams[0].score - next.score);
            decisions.push(Decision {
                chosen: fingerprint(&beams[0].tokens),
                margin: lead,
            });
        }
        (beams.swap_remove(0).tokens, decisions)
    }
}

/// A fingerprint of `value`, equal for equal values: what a [`Decision`] chose.
fn fingerprint(value: &impl Hash) -> u64 {
    let mut hasher = DefaultHasher::new();
    value.hash(&mut hasher);
    hasher.finish()
}

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
struct Admission {
    encoding: Duration,
    most_in_flight: usize,
    most_reserved: usize,
    steps_with_a_request_waiting: usize,
    most_joined_in_a_step: usize,
}

/// The pool at its fullest: the blocks per layer its sequences took, and the blocks they would
/// have taken if beams shared none (each sequence its own blocks for all its positions).
#[derive(Debug, Clone, Copy, Default)]
struct FullestPool {
    blocks_in_use: usize,
    unshared: usize,
}

/// What continuous batching's scheduler did: its admissions, and the pool at its fullest.
#[derive(Debug, Clone, Copy, Default)]
struct Schedule {
    admission: Admission,
    fullest_pool: FullestPool,
}

/// Continuous batching over a pool of `pool_blocks` blocks per layer: at every step the
/// requests that arrived join, in order, while the blocks not reserved by the others hold
/// theirs (every beam's whole target), at most `joins_per_step` of them (each joining
/// request's source is encoded before the step, which the running requests then wait for);
/// every running request's beams feed their last tokens and every joining request its forced
/// start; a beam kept twice is forked (its blocks and source shared), a beam not kept leaves,
/// and a finished request leaves.
struct ContinuousBatching<'a> {
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
    fn new(
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
    fn serve(mut self) -> (Served, Schedule) {
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
                search: Search::new(self.settings.beams),
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
                let search = std::mem::replace(&mut run.search, Search::new(1));
                (tokens[run.request], decisions[run.request]) = search.result();
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

/// One request at a time, in arrival order, each with its own `TransformerDecoderCache` (its
/// beams a batch, the survivors kept after each step with `select_batch`); and the time the
/// encoder took over the sources.
fn serve_one_at_a_time(
    model: &Model,
    requests: &[Request],
    beams: usize,
    device: &Device,
) -> (Served, Duration) {
    let mut encoding = Duration::ZERO;
    let (mut tokens, mut decisions, mut token_times) = (Vec::new(), Vec::new(), Vec::new());
    let mut peak_cache = CacheBytes::default();
    let started = Instant::now();
    for request in requests {
        std::thread::sleep(request.arrival.saturating_sub(started.elapsed()));
        let encoding_started = Instant::now();
        let memory = model.encode(&request.source, device);
        encoding += encoding_started.elapsed();
        let mut cache = model.decoder.new_cache();
        let mut search = Search::new(beams);
        let mut times = Vec::new();
        let mut log_probs = model.step_cached(&request.forced, 1, &memory, &mut cache, device);
        loop {
            let parents = search.step(&log_probs);
            times.push(started.elapsed());
            if search.generated() == request.max_tokens {
                break;
            }
            // Each survivor continues its parent's caches (the forced start's, repeated, at
            // first); a step that kept every beam in place copies nothing.
            if !parents.iter().copied().eq(0..parents.len()) {
                cache.select_batch(&parents);
            }
            let last: Vec<i64> = search
                .beams
                .iter()
                .map(|beam| *beam.tokens.last().expect("a token"))
                .collect();
            log_probs = model.step_cached(&last, last.len(), &memory, &mut cache, device);
        }
        let summed_over_layers = |bytes: fn(&mha::KvCache) -> usize| -> usize {
            cache.self_attention.iter().map(bytes).sum()
        };
        // Every beam holds its own positions and its own copy of the projected source.
        let projected = request.source.len() * LAYERS * POSITION_BYTES * beams;
        peak_cache = peak_cache.peak(CacheBytes {
            stored: summed_over_layers(|layer| layer.stored()) * POSITION_BYTES * beams + projected,
            allocated: summed_over_layers(|layer| layer.bytes()) + projected,
        });
        let (generated, decided) = search.result();
        tokens.push(generated);
        decisions.push(decided);
        token_times.push(times);
    }
    let served = Served {
        tokens,
        decisions,
        wall: started.elapsed(),
        token_times,
        arrivals: requests.iter().map(|request| request.arrival).collect(),
        peak_cache,
    };
    (served, encoding)
}

/// What the command line asks for beside the device.
#[derive(Debug, Clone, Copy)]
struct Settings {
    pool_blocks: usize,
    /// The most requests that join in a step, if bounded.
    joins_per_step: Option<usize>,
    /// Beams of each request's search (1: greedy decoding).
    beams: usize,
    /// Milliseconds between two requests' arrivals (0: all at once).
    arrival_ms: u64,
}

/// The most beams `--beams` takes.
const MOST_BEAMS: usize = 16;

/// Reads `--beams N`, `--pool-blocks N` (at least the blocks of the longest request's beams,
/// which must fit alone), `--joins-per-step N` and `--arrival-ms N`; a bad value exits with the
/// usage.
fn settings(options: &ProgramOptions, requests: &[Request]) -> Settings {
    let number = |flag: &str, least: usize, what: &str| options.number(flag, least, what);
    let beams = number("--beams", 1, "a number of beams (1 to 16)").unwrap_or(1);
    if beams > MOST_BEAMS {
        options.fail(&format!(
            "`--beams` takes a number of beams (1 to {MOST_BEAMS}), not `{beams}`"
        ));
    }
    let longest = beams
        * requests
            .iter()
            .map(Request::blocks)
            .max()
            .expect("requests");
    Settings {
        pool_blocks: number(
            "--pool-blocks",
            longest,
            &format!("a number of blocks that holds the longest request (at least {longest})"),
        )
        .unwrap_or(POOL_BLOCKS),
        joins_per_step: number("--joins-per-step", 1, "a number of requests (at least 1)"),
        beams,
        arrival_ms: number("--arrival-ms", 0, "a number of milliseconds")
            .map_or(ARRIVAL_INTERVAL_MS, |ms| ms as u64),
    }
}

fn main() {
    let (name, device, options) = device_and_options(
        "serve_encoder_decoder",
        &[
            ("--beams", "N"),
            ("--pool-blocks", "N"),
            ("--joins-per-step", "N"),
            ("--arrival-ms", "N"),
        ],
    );
    let mut requests = requests();
    let settings = settings(&options, &requests);
    let arriving = space_arrivals(
        requests.iter_mut().map(|request| &mut request.arrival),
        settings.arrival_ms,
    );
    device.seed(7);
    let model = Model::new(&device);
    let wanted: usize = requests.iter().map(|r| r.max_tokens).sum();
    let sources: usize = requests.iter().map(|r| r.source.len()).sum();
    let decoding = match settings.beams {
        1 => "greedy decoding".to_string(),
        beams => format!("beam search of {beams} beams"),
    };
    println!(
        "{REQUESTS} requests on {name}, {arriving}: sources of 16-320 tokens ({sources} in all), \
         forced starts of 1-8 tokens, {wanted} tokens wanted in all; a {LAYERS}-layer encoder \
         and a {LAYERS}-layer decoder, d_model {D_MODEL}, 8 query / 2 key-value heads, \
         {decoding}\n"
    );
    // A short warm-up, so that neither way pays for first-use costs (allocator, threads).
    serve_one_at_a_time(&model, &requests[..1], settings.beams, &device);
    let (batched, schedule) = ContinuousBatching::new(&model, &requests, settings, &device).serve();
    let (alone, encoding_alone) = serve_one_at_a_time(&model, &requests, settings.beams, &device);
    report_both(&settings, &batched, &alone);
    report_schedule(&settings, &schedule, encoding_alone);
    check_same_tokens("both ways", &batched, &alone);
}

/// The table: a row for each way.
fn report_both(settings: &Settings, batched: &Served, alone: &Served) {
    println!("{TABLE_HEADER}");
    let joins = settings.joins_per_step.map_or(String::new(), |joins| {
        format!(", at most {joins} joining a step")
    });
    let forks = if settings.beams > 1 {
        ", beams forked"
    } else {
        ""
    };
    report(
        &format!(
            "continuous batching (paged, {} blocks of {BLOCK_SIZE} per layer, each source \
             projected once{forks}{joins})",
            settings.pool_blocks
        ),
        batched,
    );
    let batch = if settings.beams > 1 {
        ", beams a batch"
    } else {
        ""
    };
    report(
        &format!("one at a time (TransformerDecoderCache{batch})"),
        alone,
    );
}

/// What continuous batching's scheduler did, and the encoder's time each way.
fn report_schedule(settings: &Settings, schedule: &Schedule, encoding_alone: Duration) {
    let Schedule {
        admission:
            Admission {
                encoding,
                most_in_flight,
                most_reserved,
                steps_with_a_request_waiting,
                most_joined_in_a_step,
            },
        fullest_pool,
    } = schedule;
    println!(
        "\ncontinuous batching held at most {most_in_flight} requests at once, reserving at most \
         {most_reserved} of {} blocks; a request waited for blocks in \
         {steps_with_a_request_waiting} steps; the most requests to join in a step: \
         {most_joined_in_a_step}",
        settings.pool_blocks
    );
    println!(
        "at its fullest the pool held {} blocks per layer, where sequences sharing no blocks would \
         hold {}",
        fullest_pool.blocks_in_use, fullest_pool.unshared
    );
    println!(
        "the encoder took {:.2} s of continuous batching's wall time and {:.2} s of one at a \
         time's",
        encoding.as_secs_f64(),
        encoding_alone.as_secs_f64()
    );
}
