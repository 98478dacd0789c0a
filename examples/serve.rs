//! Serving a stream of requests with a small (untrained) decoder-only model, three ways:
//! continuous batching over a `PagedTransformerCache` (requests join the running batch as they
//! arrive, prompts are prefilled in the same step as the other requests' next tokens, a finished
//! request's blocks go back to the pool at once, and each request is added with its whole prompt,
//! so that the system prompt every request starts with is found by its tokens, computed once and
//! shared); static batches with a `KvCache` per layer, what batching takes without a paged cache
//! (the requests that arrived while the last batch ran, their prompts padded in front to the
//! longest; a finished request leaves, none joins until the batch is done); and one request at a
//! time with a `KvCache` per layer. All decode greedily, or with `--temperature T` sample each
//! token with a uniform number drawn from the request and the token's place in its answer, so
//! each request must get the same tokens every way, unless a choice was within rounding of
//! going the other way (two largest logits, or a draw and a boundary of cumulative probability,
//! that close: a near tie, reported): the example fails (exit status 1), naming the requests
//! and where their tokens part, if one does not. It prints tokens per second, time to first
//! token, time between a request's tokens and peak cache memory for each way: the bytes the
//! sequences in flight store (the pool's blocks in use, each sequence's last one whole; a
//! `KvCache`'s positions, a static batch's padding included), and the bytes the caches had
//! allocated at that moment (the pool's blocks, free ones included; a `KvCache`'s buffers with
//! their room to grow).
//!
//! Requests join without a reservation for the tokens they will generate, as vLLM schedules:
//! when the pool lacks a block for a step (a request's next token or prompt rows), the request
//! that joined last is preempted (its blocks go back to the pool) and comes back first, its
//! prompt and the tokens it had generated recomputed but for the whole blocks the cache still
//! holds. `--pool-blocks N` bounds the pool (512 blocks of 16 per layer by default, which hold
//! the stream's peak); a smaller pool preempts, and the example prints how often.
//! `--prefill-chunk N` feeds at most `N` prompt rows a step (vLLM's chunked prefill): a long
//! prompt is prefilled over several steps beside the running requests' tokens, which then wait
//! less between tokens.
//!
//! Requests arrive one every 2 ms, or every `N` ms with `--arrival-ms N`: with 0 all arrive at
//! once, and the schedule (who joins, who is preempted when) is the same on every machine.
//!
//! With `--window N` every layer attends within a sliding window of `N` positions: the paged
//! cache gives each sequence's blocks behind its window back to the pool after every step, and
//! the `KvCache`s keep the window's positions only, so each request's cache stays bounded
//! however long it runs.
//!
//! ```sh
//! cargo run --release --example serve -- --device flex   # or ndarray; wgpu with `--features wgpu`
//! cargo run --release --example serve -- --window 64
//! cargo run --release --example serve -- --pool-blocks 48
//! cargo run --release --example serve -- --prefill-chunk 32
//! cargo run --release --example serve -- --arrival-ms 0   # all at once
//! cargo run --release --example serve -- --temperature 0.8   # sampled, a seed per request
//! ```

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::{Bool, Device, Tensor};
use burn_mha::serving::{
    CacheBytes, Choice, Decision, Decoding, Numbers, Served, TABLE_HEADER, TokenSlot,
    check_same_tokens, embed, last_rows, next_static_batch, report, space_arrivals,
};
use burn_mha::{ProgramOptions, device_and_options};
use mha::transformer::{
    PagedTransformerCache, TransformerEncoder, TransformerEncoderCache, TransformerEncoderConfig,
    TransformerEncoderInput,
};
use mha::{PagedKvCacheConfig, RopeConfig, SequenceId, Token};

const VOCAB: usize = 256;
const D_MODEL: usize = 256;
const LAYERS: usize = 2;
const HEADS: usize = 8;
const KV_HEADS: usize = 2;
/// Bytes a layer's `KvCache` stores per position: an f32 key and value per key/value head.
const POSITION_BYTES: usize = 2 * KV_HEADS * (D_MODEL / HEADS) * 4;
const REQUESTS: usize = 32;
/// A request arrives every this many milliseconds unless `--arrival-ms` says otherwise.
const ARRIVAL_INTERVAL_MS: u64 = 2;
const BLOCK_SIZE: usize = 16;
/// The pool's bound per layer unless `--pool-blocks` says otherwise: 8192 positions.
const POOL_BLOCKS: usize = 512;
/// Tokens of the system prompt every request starts with (four whole blocks).
const SYSTEM_PROMPT: usize = 64;
/// The seed of `--temperature`'s draws, mixed with each request's index.
const SAMPLING_SEED: u64 = 0x5eed;

/// One client's request: its own prompt (after the system prompt) and how many tokens it wants
/// back.
struct Request {
    arrival: Duration,
    prompt: Vec<i64>,
    output_len: usize,
}

/// The system prompt: the same tokens in front of every request.
fn system_prompt() -> Vec<i64> {
    (0..SYSTEM_PROMPT as i64)
        .map(|i| (i * 37 + 11) % VOCAB as i64)
        .collect()
}

/// A deterministic stream of requests: prompts of 16–192 tokens, 32–160 tokens wanted.
fn requests() -> Vec<Request> {
    let mut numbers = Numbers::new(0x2545_f491_4f6c_dd1d);
    let mut next = |below: u64| numbers.below(below);
    (0..REQUESTS)
        .map(|_| {
            let prompt_len = 16 + next(177) as usize;
            Request {
                // Spaced by `main` (`--arrival-ms`).
                arrival: Duration::ZERO,
                prompt: (0..prompt_len).map(|_| next(VOCAB as u64) as i64).collect(),
                output_len: 32 + next(129) as usize,
            }
        })
        .collect()
}

/// Embedding, a causal Transformer stack, a head to the vocabulary, and how the next token is
/// picked from its logits.
struct Model {
    embedding: Embedding,
    stack: TransformerEncoder,
    head: Linear,
    decoding: Decoding,
}

impl Model {
    /// A random model whose layers attend within `window` positions, if any, decoding as
    /// `decoding` says.
    fn new(window: Option<usize>, decoding: Decoding, device: &Device) -> Self {
        Self {
            embedding: EmbeddingConfig::new(VOCAB, D_MODEL).init(device),
            stack: TransformerEncoderConfig::new(D_MODEL, 4 * D_MODEL, HEADS, LAYERS)
                .with_n_kv_heads(Some(KV_HEADS))
                .with_window(window)
                .with_rope(Some(RopeConfig::new()))
                .with_causal(true)
                .with_norm_first(true)
                .with_dropout(0.0)
                .init(device),
            head: LinearConfig::new(D_MODEL, VOCAB).init(device),
            decoding,
        }
    }

    fn embed(&self, tokens: &[i64], device: &Device) -> Tensor<3> {
        embed(&self.embedding, tokens, device)
    }

    /// The next tokens of one paged step: `tokens[i]` belongs to `sequences[i]`; one token per
    /// run of rows (its last row's), run `r`'s for `slots[r]`.
    fn step_paged(
        &self,
        tokens: &[i64],
        sequences: &[SequenceId],
        slots: &[TokenSlot],
        cache: &mut PagedTransformerCache,
        device: &Device,
    ) -> Vec<Choice> {
        let x = self.embed(tokens, device).reshape([tokens.len(), D_MODEL]);
        let hidden = self
            .stack
            .forward_paged(x, cache, sequences)
            .expect("admission and preemption keep every step within the pool");
        self.decoding
            .choose(self.head.forward(last_rows(hidden, sequences)), slots)
    }

    /// The next token of each row fed to `cache`, row `i`'s for `slots[i]`: `tokens` holds the
    /// rows one after another, all as long, and `padding` (`[rows, len]`, `true` = padding)
    /// marks the positions no query may attend to.
    fn step_cached(
        &self,
        tokens: &[i64],
        slots: &[TokenSlot],
        padding: Option<Tensor<2, Bool>>,
        cache: &mut TransformerEncoderCache,
        device: &Device,
    ) -> Vec<Choice> {
        let batch = slots.len();
        let len = tokens.len() / batch;
        let mut input =
            TransformerEncoderInput::new(self.embed(tokens, device).reshape([batch, len, D_MODEL]));
        if let Some(padding) = padding {
            input = input.mask_pad(padding);
        }
        let hidden = self
            .stack
            .forward_cached(input, cache)
            .expect("the stack's own caches take every step");
        let last = hidden.narrow(1, len - 1, 1).reshape([batch, D_MODEL]);
        self.decoding.choose(self.head.forward(last), slots)
    }
}

/// A request in the batch: its sequence in the cache, and the rows of its prompt (with the
/// tokens it generated before a preemption) that the cache does not hold yet.
struct Running {
    request: usize,
    id: SequenceId,
    /// Rows still to prefill, fed from the front; empty once it decodes.
    pending: VecDeque<i64>,
}

/// How many times continuous batching took a request out of the batch to make room for the
/// others' rows (a request may be taken out more than once), how many of those times the
/// request was still prefilling its prompt, and the positions the requests had to compute
/// again when they came back (those they held, less the whole blocks the cache still held).
#[derive(Debug, Clone, Copy, Default)]
struct Preemptions {
    count: usize,
    prefilling: usize,
    recomputed: usize,
}

/// What the scheduler did beside the tokens: its preemptions, and the most prompt rows a step
/// fed (at most `--prefill-chunk`).
#[derive(Debug, Clone, Copy, Default)]
struct Scheduled {
    preemptions: Preemptions,
    most_prompt_rows: usize,
}

/// The rows of one step: for each running request that takes part, in the order they joined,
/// its rows (a decoding request its last token, a prefilling one a chunk of its prompt).
struct StepPlan {
    tokens: Vec<i64>,
    sequences: Vec<SequenceId>,
    /// Each part's request (its index in `running`) and the prompt rows it feeds (0: it
    /// decodes).
    parts: Vec<(usize, usize)>,
}

/// Continuous batching over a pool of `pool_blocks` blocks per layer, as vLLM schedules. At
/// every step the requests that arrived join while the pool, beyond all the rows they and the
/// others have still to prefill, keeps a block free for each request that will decode; the
/// decoding requests feed one token each and the prefilling ones their prompts, at most
/// `prefill_chunk` prompt rows in a step in all (the first to join first, so that a long prompt
/// is prefilled over several steps beside the others' tokens instead of holding up a step);
/// a finished request leaves. A request joins without a reservation for the tokens it will
/// generate, so the pool may come to lack a block for a step: the request that joined last is
/// then preempted (its blocks go back to the pool) and waits at the head of the queue, to come
/// back with its prompt and the tokens it had generated, recomputed but for the whole blocks of
/// them the cache still holds (its own blocks stay filed by their tokens until another request
/// takes them).
struct ContinuousBatching<'a> {
    model: &'a Model,
    requests: &'a [Request],
    device: &'a Device,
    cache: PagedTransformerCache,
    prefill_chunk: usize,
    waiting: VecDeque<usize>,
    /// In the order they joined: the last is preempted first.
    running: Vec<Running>,
    tokens: Vec<Vec<i64>>,
    decisions: Vec<Vec<Decision>>,
    token_times: Vec<Vec<Duration>>,
    /// The positions each request held when it was last preempted (0: not preempted since it
    /// came back).
    held_when_preempted: Vec<usize>,
    started: Instant,
    peak_cache: CacheBytes,
    scheduled: Scheduled,
}

impl<'a> ContinuousBatching<'a> {
    fn new(
        model: &'a Model,
        requests: &'a [Request],
        settings: &Settings,
        device: &'a Device,
    ) -> Self {
        let config = PagedKvCacheConfig::new(settings.pool_blocks).with_block_size(BLOCK_SIZE);
        Self {
            model,
            requests,
            device,
            cache: model.stack.new_paged_cache(config),
            prefill_chunk: settings.prefill_chunk.unwrap_or(usize::MAX),
            waiting: (0..requests.len()).collect(),
            running: Vec::new(),
            tokens: vec![Vec::new(); requests.len()],
            decisions: vec![Vec::new(); requests.len()],
            token_times: vec![Vec::new(); requests.len()],
            held_when_preempted: vec![0; requests.len()],
            started: Instant::now(),
            peak_cache: CacheBytes::default(),
            scheduled: Scheduled::default(),
        }
    }

    fn serve(mut self) -> (Served, Scheduled) {
        while !self.waiting.is_empty() || !self.running.is_empty() {
            self.preempt_until_the_step_fits();
            self.admit();
            if self.running.is_empty() {
                let next = *self.waiting.front().expect("work left");
                let arrival = self.requests[next].arrival;
                std::thread::sleep(arrival.saturating_sub(self.started.elapsed()));
                continue;
            }
            let plan = self.plan();
            self.step(plan);
        }
        let served = Served {
            tokens: self.tokens,
            decisions: self.decisions,
            wall: self.started.elapsed(),
            token_times: self.token_times,
            arrivals: self
                .requests
                .iter()
                .map(|request| request.arrival)
                .collect(),
            peak_cache: self.peak_cache,
        };
        (served, self.scheduled)
    }

    /// The next step's rows: every decoding request's token, and the prefilling requests'
    /// prompt rows, at most `prefill_chunk` in all, the first to join first.
    fn plan(&self) -> StepPlan {
        let mut plan = StepPlan {
            tokens: Vec::new(),
            sequences: Vec::new(),
            parts: Vec::new(),
        };
        let mut budget = self.prefill_chunk;
        for (index, run) in self.running.iter().enumerate() {
            let rows: Vec<i64> = if run.pending.is_empty() {
                vec![*self.tokens[run.request].last().expect("a first token")]
            } else {
                run.pending.iter().take(budget).copied().collect()
            };
            if rows.is_empty() {
                continue;
            }
            let prompt_rows = if run.pending.is_empty() {
                0
            } else {
                rows.len()
            };
            budget -= prompt_rows;
            plan.sequences
                .extend(std::iter::repeat_n(run.id, rows.len()));
            plan.tokens.extend(rows);
            plan.parts.push((index, prompt_rows));
        }
        plan
    }

    /// Preempts the requests that joined last until the next step fits the pool.
    fn preempt_until_the_step_fits(&mut self) {
        while !self
            .cache
            .fits(&self.plan().sequences)
            .expect("running sequences")
        {
            // A request alone always fits: the pool holds the longest request whole.
            let run = self.running.pop().expect("a request alone fits the pool");
            self.held_when_preempted[run.request] =
                self.cache.len(run.id).expect("a running sequence");
            self.cache
                .remove_sequence(run.id)
                .expect("a running sequence");
            self.waiting.push_front(run.request);
            let preemptions = &mut self.scheduled.preemptions;
            preemptions.count += 1;
            preemptions.prefilling += usize::from(self.tokens[run.request].is_empty());
        }
    }

    /// Adds the requests that arrived, in order, while the pool holds every row the running
    /// and joining requests have still to feed and keeps a block free for each of them beside
    /// (vLLM's watermark, so that one joining does not preempt another at once); a preempted
    /// request comes back first.
    fn admit(&mut self) {
        // Every row still to feed: each decoding request's next token, every pending row.
        let mut rows: Vec<SequenceId> = Vec::new();
        for run in &self.running {
            rows.extend(std::iter::repeat_n(run.id, run.pending.len().max(1)));
        }
        while let Some(&next) = self.waiting.front() {
            if self.requests[next].arrival > self.started.elapsed() {
                break;
            }
            // Its whole prompt and what it generated before a preemption, the last token
            // generated not yet fed.
            let prompt = [full_prompt(&self.requests[next]), self.tokens[next].clone()].concat();
            let tokens: Vec<Token> = prompt.iter().map(|&t| t as Token).collect();
            // Whole blocks of it that a request in the batch (or one that left, its blocks
            // not yet taken again) computed are shared.
            let matched = self.cache.add_sequence_with_prompt(&tokens);
            let pending: VecDeque<i64> = prompt[matched.cached..].iter().copied().collect();
            rows.extend(std::iter::repeat_n(matched.id, pending.len()));
            // A request alone joins whenever it fits: the pool holds the longest request whole.
            let headroom = match self.running.len() {
                0 => 0,
                others => others + 1,
            };
            let needed = self
                .cache
                .blocks_needed(&rows)
                .expect("sequences of the cache");
            if needed + headroom > self.cache.free_blocks() {
                self.cache
                    .remove_sequence(matched.id)
                    .expect("the sequence just added");
                break;
            }
            self.waiting.pop_front();
            // Positions it held before a preemption that it computes again.
            let held = std::mem::take(&mut self.held_when_preempted[next]);
            self.scheduled.preemptions.recomputed += held.saturating_sub(matched.cached);
            self.running.push(Running {
                request: next,
                id: matched.id,
                pending,
            });
        }
    }

    /// One step of `plan`: a token for each decoding request and for each whose prompt the
    /// step finishes; a finished request leaves.
    fn step(&mut self, plan: StepPlan) {
        let prompt_rows: usize = plan.parts.iter().map(|&(_, rows)| rows).sum();
        let most = &mut self.scheduled.most_prompt_rows;
        *most = (*most).max(prompt_rows);
        // Each part's token (dropped where the part is a chunk of a prompt).
        let slots: Vec<TokenSlot> = plan
            .parts
            .iter()
            .map(|&(index, _)| {
                let request = self.running[index].request;
                TokenSlot {
                    request,
                    index: self.tokens[request].len(),
                }
            })
            .collect();
        let next = self.model.step_paged(
            &plan.tokens,
            &plan.sequences,
            &slots,
            &mut self.cache,
            self.device,
        );
        let now = self.started.elapsed();
        self.peak_cache = self.peak_cache.peak(CacheBytes {
            stored: self.cache.bytes_in_use(),
            allocated: self.cache.reserved_bytes(),
        });
        for ((index, prompt_rows), choice) in plan.parts.into_iter().zip(next) {
            let run = &mut self.running[index];
            run.pending.drain(..prompt_rows);
            if !run.pending.is_empty() {
                // A chunk of a prompt: its last row's output is not a token yet.
                continue;
            }
            self.tokens[run.request].push(choice.token);
            self.decisions[run.request].push(choice.decision());
            self.token_times[run.request].push(now);
            // The token the next step feeds: once its block is whole, a request preempted
            // later finds it by its tokens.
            self.cache
                .extend_tokens(run.id, &[choice.token as Token])
                .expect("a running sequence");
        }
        let (cache, tokens, requests) = (&mut self.cache, &self.tokens, self.requests);
        self.running.retain(|run| {
            let done = tokens[run.request].len() == requests[run.request].output_len;
            if done {
                cache.remove_sequence(run.id).expect("a running sequence");
            }
            !done
        });
    }
}

/// A request's whole prompt: the system prompt, then its own.
fn full_prompt(request: &Request) -> Vec<i64> {
    [system_prompt().as_slice(), &request.prompt].concat()
}

/// What the `KvCache`s of a stack hold for a batch of `rows`: the positions they store (a
/// static batch's padding included), and their buffers with the room they keep to grow.
fn cache_bytes(cache: &TransformerEncoderCache, rows: usize) -> CacheBytes {
    CacheBytes {
        stored: cache
            .layers
            .iter()
            .map(|layer| rows * layer.stored())
            .sum::<usize>()
            * POSITION_BYTES,
        allocated: cache.layers.iter().map(|layer| layer.bytes()).sum(),
    }
}

/// One request at a time, in arrival order, each with its own `KvCache` per layer, its system
/// prompt prefilled with its own prompt.
fn serve_one_at_a_time(model: &Model, requests: &[Request], device: &Device) -> Served {
    let (mut tokens, mut decisions, mut token_times) = (Vec::new(), Vec::new(), Vec::new());
    let mut peak_cache = CacheBytes::default();
    let started = Instant::now();
    for (index, request) in requests.iter().enumerate() {
        std::thread::sleep(request.arrival.saturating_sub(started.elapsed()));
        let slot = |generated: &[Choice]| {
            [TokenSlot {
                request: index,
                index: generated.len(),
            }]
        };
        let mut cache = model.stack.new_cache();
        let prompt = full_prompt(request);
        let mut generated = model.step_cached(&prompt, &slot(&[]), None, &mut cache, device);
        let mut times = vec![started.elapsed()];
        while generated.len() < request.output_len {
            let last = generated.last().expect("a first token").token;
            let slot = slot(&generated);
            generated.extend(model.step_cached(&[last], &slot, None, &mut cache, device));
            times.push(started.elapsed());
        }
        peak_cache = peak_cache.peak(cache_bytes(&cache, 1));
        tokens.push(generated.iter().map(|choice| choice.token).collect());
        decisions.push(generated.iter().map(Choice::decision).collect());
        token_times.push(times);
    }
    Served {
        tokens,
        decisions,
        wall: started.elapsed(),
        token_times,
        arrivals: requests.iter().map(|request| request.arrival).collect(),
        peak_cache,
    }
}

/// Static batching with `KvCache`s, the way to serve many requests at once without a paged
/// cache: the requests that arrived while the last batch ran (at least the next one) form a
/// batch and decode together; a finished request leaves it (`select_batch`), but none joins
/// until it is empty, since a `KvCache` batch's rows share one length. Prompts are padded in
/// front to the longest, the padding masked out of every key (RoPE's scores depend only on
/// the distance between positions, so a request's tokens depend on its padding through
/// rounding only: at a near tie, reported), and stored: every row of the batch holds the
/// longest prompt's positions.
fn serve_in_static_batches(model: &Model, requests: &[Request], device: &Device) -> Served {
    let mut served = Served::nothing_yet(requests.iter().map(|request| request.arrival).collect());
    let started = Instant::now();
    let mut next = 0;
    while next < requests.len() {
        let batch = next_static_batch(&served.arrivals, next, started);
        next = batch.end;
        let batch: Vec<usize> = batch.collect();
        serve_a_static_batch(model, requests, &batch, &mut served, started, device);
    }
    served.wall = started.elapsed();
    served
}

/// One batch of [`serve_in_static_batches`]: `batch`'s requests prefilled together, then
/// decoded until the last of them is done, into `served` (times from `started`).
fn serve_a_static_batch(
    model: &Model,
    requests: &[Request],
    batch: &[usize],
    served: &mut Served,
    started: Instant,
    device: &Device,
) {
    let prompts: Vec<Vec<i64>> = batch
        .iter()
        .map(|&request| full_prompt(&requests[request]))
        .collect();
    let longest = prompts.iter().map(Vec::len).max().expect("a request");
    // The padding's token is never attended to; any will do.
    let tokens: Vec<i64> = prompts
        .iter()
        .flat_map(|prompt| std::iter::repeat_n(0, longest - prompt.len()).chain(prompt.clone()))
        .collect();
    let padding: Vec<bool> = prompts
        .iter()
        .flat_map(|prompt| (0..longest).map(|position| position < longest - prompt.len()))
        .collect();
    let padding =
        Tensor::<1, Bool>::from_data(padding.as_slice(), device).reshape([batch.len(), longest]);
    let mut cache = model.stack.new_cache();
    // The batch's requests still decoding, in the cache's row order.
    let mut rows: Vec<usize> = batch.to_vec();
    let slots = |rows: &[usize], served: &Served| -> Vec<TokenSlot> {
        rows.iter()
            .map(|&request| TokenSlot {
                request,
                index: served.tokens[request].len(),
            })
            .collect()
    };
    let first = slots(&rows, served);
    let mut choices = model.step_cached(&tokens, &first, Some(padding), &mut cache, device);
    loop {
        let now = started.elapsed();
        for (&request, choice) in rows.iter().zip(&choices) {
            served.tokens[request].push(choice.token);
            served.decisions[request].push(choice.decision());
            served.token_times[request].push(now);
        }
        served.peak_cache = served.peak_cache.peak(cache_bytes(&cache, rows.len()));
        let still: Vec<usize> = (0..rows.len())
            .filter(|&row| served.tokens[rows[row]].len() < requests[rows[row]].output_len)
            .collect();
        if still.is_empty() {
            return;
        }
        if still.len() < rows.len() {
            cache.select_batch(&still);
            rows = still.iter().map(|&row| rows[row]).collect();
        }
        let last: Vec<i64> = rows
            .iter()
            .map(|&request| *served.tokens[request].last().expect("a first token"))
            .collect();
        let next = slots(&rows, served);
        choices = model.step_cached(&last, &next, None, &mut cache, device);
    }
}

/// What the command line asks for beside the device.
struct Settings {
    window: Option<usize>,
    pool_blocks: usize,
    /// The most prompt rows a step of continuous batching feeds, if bounded.
    prefill_chunk: Option<usize>,
    /// Milliseconds between two requests' arrivals (0: all at once).
    arrival_ms: u64,
    decoding: Decoding,
}

/// Reads `--window N`, `--pool-blocks N`, `--prefill-chunk N`, `--arrival-ms N` and
/// `--temperature T`; a bad value exits with the usage.
fn settings(options: &ProgramOptions, requests: &[Request]) -> Settings {
    let number = |flag: &str, least: usize, what: &str| options.number(flag, least, what);
    // The pool must hold the longest request whole, its prompt and every token it wants: a
    // request alone is never preempted.
    let longest = requests
        .iter()
        .map(|request| (full_prompt(request).len() + request.output_len).div_ceil(BLOCK_SIZE))
        .max()
        .expect("requests");
    Settings {
        window: number("--window", 1, "a number of positions (at least 1)"),
        pool_blocks: number(
            "--pool-blocks",
            longest,
            &format!("a number of blocks that holds the longest request (at least {longest})"),
        )
        .unwrap_or(POOL_BLOCKS),
        prefill_chunk: number("--prefill-chunk", 1, "a number of rows (at least 1)"),
        arrival_ms: number("--arrival-ms", 0, "a number of milliseconds")
            .map_or(ARRIVAL_INTERVAL_MS, |ms| ms as u64),
        decoding: Decoding::from_options(options, SAMPLING_SEED),
    }
}

fn main() {
    let (name, device, options) = device_and_options(
        "serve",
        &[
            ("--window", "N"),
            ("--pool-blocks", "N"),
            ("--prefill-chunk", "N"),
            ("--arrival-ms", "N"),
            ("--temperature", "T"),
        ],
    );
    let mut requests = requests();
    let settings = settings(&options, &requests);
    let arriving = space_arrivals(
        requests.iter_mut().map(|request| &mut request.arrival),
        settings.arrival_ms,
    );
    device.seed(7);
    let model = Model::new(settings.window, settings.decoding, &device);
    let wanted: usize = requests.iter().map(|r| r.output_len).sum();
    let decoding = match settings.decoding {
        Decoding::Greedy => "greedy decoding".to_string(),
        Decoding::Sampled { temperature, .. } => {
            format!("tokens sampled at temperature {temperature}, a seed per request")
        }
    };
    let attends = settings
        .window
        .map_or("every position before it".to_string(), |window| {
            format!("a sliding window of {window} positions")
        });
    println!(
        "{REQUESTS} requests on {name}, {arriving}: a {SYSTEM_PROMPT}-token \
         system prompt then 16-192 tokens of their own, {wanted} tokens wanted in all; a \
         {LAYERS}-layer causal Transformer, d_model {D_MODEL}, 8 query / 2 key-value heads, \
         each query attending to {attends}, {decoding}\n"
    );
    // A short warm-up, so that no way pays for first-use costs (allocator, threads).
    serve_one_at_a_time(&model, &requests[..1], &device);
    let (batched, scheduled) =
        ContinuousBatching::new(&model, &requests, &settings, &device).serve();
    let in_batches = serve_in_static_batches(&model, &requests, &device);
    let alone = serve_one_at_a_time(&model, &requests, &device);
    println!("{TABLE_HEADER}");
    let chunks = settings.prefill_chunk.map_or(String::new(), |rows| {
        format!(", prompts in chunks of {rows} rows a step")
    });
    report(
        &format!(
            "continuous batching (paged, {} blocks of {BLOCK_SIZE} per layer, prompt prefixes \
             shared{chunks})",
            settings.pool_blocks
        ),
        &batched,
    );
    report(
        "static batches (a KvCache batch per layer, prompts padded to the longest)",
        &in_batches,
    );
    report("one at a time (KvCache per layer)", &alone);
    let Preemptions {
        count,
        prefilling,
        recomputed,
    } = scheduled.preemptions;
    println!(
        "\ncontinuous batching preempted requests {count} times ({prefilling} while prefilling; \
         {recomputed} positions computed again) and fed at most {} prompt rows in a step",
        scheduled.most_prompt_rows
    );
    check_same_tokens("continuously batched as alone", &batched, &alone);
    check_same_tokens("in static batches as alone", &in_batches, &alone);
}
