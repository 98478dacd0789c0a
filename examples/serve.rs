//! Serving a stream of requests with a small (untrained) decoder-only model, two ways: continuous
//! batching over a `PagedTransformerCache` (requests join the running batch as they arrive,
//! prompts are prefilled in the same step as the other requests' next tokens, a finished
//! request's blocks go back to the pool at once, and each request is added with its whole prompt,
//! so that the system prompt every request starts with is found by its tokens, computed once and
//! shared), and one request at a time with a `KvCache` per layer. Both decode greedily, so each
//! request must get the same tokens either way, unless its two largest logits were within
//! rounding of each other (a near tie, reported): the example fails (exit status 1), naming the
//! requests and where their tokens part, if one does not. It prints tokens per second, time to
//! first token and peak cache memory for each way: the bytes the sequences in flight store (the
//! pool's blocks in use, each sequence's last one whole; a `KvCache`'s positions), and the bytes
//! the caches had allocated at that moment (the pool's blocks, free ones included; a
//! `KvCache`'s buffers with their room to grow).
//!
//! Requests join without a reservation for the tokens they will generate, as vLLM schedules:
//! when the pool lacks a block for some request's next token, the request that joined last is
//! preempted (its blocks go back to the pool) and comes back first, its prompt and the tokens it
//! had generated recomputed but for the whole blocks the cache still holds. `--pool-blocks N`
//! bounds the pool (512 blocks of 16 per layer by default, which hold the stream's peak); a
//! smaller pool preempts, and the example prints how often.
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
//! ```

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
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
/// A request arrives every this many milliseconds.
const ARRIVAL_INTERVAL_MS: u64 = 2;
const BLOCK_SIZE: usize = 16;
/// The pool's bound per layer unless `--pool-blocks` says otherwise: 8192 positions.
const POOL_BLOCKS: usize = 512;
/// Tokens of the system prompt every request starts with (four whole blocks).
const SYSTEM_PROMPT: usize = 64;

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
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = |below: u64| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        (state >> 33) % below
    };
    (0..REQUESTS)
        .map(|i| {
            let prompt_len = 16 + next(177) as usize;
            Request {
                arrival: Duration::from_millis(i as u64 * ARRIVAL_INTERVAL_MS),
                prompt: (0..prompt_len).map(|_| next(VOCAB as u64) as i64).collect(),
                output_len: 32 + next(129) as usize,
            }
        })
        .collect()
}

/// Embedding, a causal Transformer stack, and a head to the vocabulary.
struct Model {
    embedding: Embedding,
    stack: TransformerEncoder,
    head: Linear,
}

impl Model {
    /// A random model whose layers attend within `window` positions, if any.
    fn new(window: Option<usize>, device: &Device) -> Self {
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
        }
    }

    fn embed(&self, tokens: &[i64], device: &Device) -> Tensor<3> {
        let tokens = Tensor::<2, Int>::from_data(
            TensorData::new(tokens.to_vec(), [1, tokens.len()]),
            device,
        );
        self.embedding.forward(tokens)
    }

    /// Greedy next tokens of one paged step: `tokens[i]` belongs to `sequences[i]`; one token
    /// per run of rows (its last row's).
    fn step_paged(
        &self,
        tokens: &[i64],
        sequences: &[SequenceId],
        cache: &mut PagedTransformerCache,
        device: &Device,
    ) -> Vec<Choice> {
        let x = self.embed(tokens, device).reshape([tokens.len(), D_MODEL]);
        let hidden = self
            .stack
            .forward_paged(x, cache, sequences)
            .expect("admission and preemption keep every step within the pool");
        let last_rows: Vec<i64> = (0..sequences.len())
            .filter(|&row| row + 1 == sequences.len() || sequences[row + 1] != sequences[row])
            .map(|row| row as i64)
            .collect();
        let count = last_rows.len();
        let rows = Tensor::<1, Int>::from_data(TensorData::new(last_rows, [count]), device);
        greedy(self.head.forward(hidden.select(0, rows)))
    }

    /// The greedy next token after `tokens` fed to `cache`.
    fn step_cached(
        &self,
        tokens: &[i64],
        cache: &mut TransformerEncoderCache,
        device: &Device,
    ) -> Choice {
        let hidden = self
            .stack
            .forward_cached(
                TransformerEncoderInput::new(self.embed(tokens, device)),
                cache,
            )
            .expect("the stack's own caches take every step");
        let last = hidden.narrow(1, tokens.len() - 1, 1).reshape([1, D_MODEL]);
        greedy(self.head.forward(last))[0]
    }
}

/// A greedy choice: the token of the largest logit, and how far that logit lies above the
/// runner-up's (two ways that compute the same logits to within rounding may choose apart only
/// where this margin is about as small as the rounding).
#[derive(Debug, Clone, Copy)]
struct Choice {
    token: i64,
    margin: f32,
}

/// Each row's greedy choice.
fn greedy(logits: Tensor<2>) -> Vec<Choice> {
    let [_, vocab] = logits.dims();
    let logits = logits.into_data().try_to_vec::<f32>().expect("f32 logits");
    logits
        .chunks_exact(vocab)
        .map(|row| {
            let (mut best, mut second) = ((0, f32::NEG_INFINITY), f32::NEG_INFINITY);
            for (token, &logit) in row.iter().enumerate() {
                if logit > best.1 {
                    second = best.1;
                    best = (token, logit);
                } else if logit > second {
                    second = logit;
                }
            }
            Choice {
                token: best.0 as i64,
                margin: best.1 - second,
            }
        })
        .collect()
}

/// A margin between the two largest logits below which two ways that compute the same logits
/// to within rounding may choose apart.
const NEAR_TIE: f32 = 1e-3;

/// What serving the stream one way measured.
struct Served {
    tokens: Vec<Vec<i64>>,
    /// Each token's [`Choice::margin`].
    margins: Vec<Vec<f32>>,
    wall: Duration,
    first_token: Vec<Duration>,
    peak_cache: CacheBytes,
}

/// A cache's memory at its peak: what the sequences in flight store, and what the cache had
/// allocated then.
#[derive(Debug, Clone, Copy, Default)]
struct CacheBytes {
    stored: usize,
    allocated: usize,
}

impl CacheBytes {
    /// The larger of `self` and `now` by the bytes stored.
    fn peak(self, now: CacheBytes) -> CacheBytes {
        if now.stored > self.stored { now } else { self }
    }
}

impl Served {
    /// Each request's tokens and their margins.
    fn runs(&self) -> impl Iterator<Item = (&[i64], &[f32])> {
        self.tokens
            .iter()
            .zip(&self.margins)
            .map(|(tokens, margins)| (tokens.as_slice(), margins.as_slice()))
    }
}

/// A request being decoded in the batch, and its sequence in the cache.
struct Running {
    request: usize,
    id: SequenceId,
}

/// A request joining the batch in this step: the rows of its prompt the cache does not hold.
struct Joining {
    run: Running,
    rows: Vec<i64>,
}

/// How many times continuous batching took a request out of the batch to make room for the
/// others' next tokens (a request may be taken out more than once), and the positions those
/// requests had to compute again when they came back.
#[derive(Debug, Clone, Copy, Default)]
struct Preemptions {
    count: usize,
    recomputed: usize,
}

/// Continuous batching over a pool of `pool_blocks` blocks per layer, as vLLM schedules: at
/// every step the requests that arrived join (the part of their prompts the cache does not hold
/// is prefilled in that step) while the step leaves a block free for each request that will
/// decode after it, the others decode one token each, and a finished request leaves. A request
/// joins without a reservation for the tokens it will generate, so the pool may come to lack a
/// block for some request's next token: the request that joined last is then preempted (its
/// blocks go back to the pool) and waits at the head of the queue, to come back with its prompt
/// and the tokens it had generated, recomputed but for the whole blocks of them the cache still
/// holds (its own blocks stay filed by their tokens until another request takes them).
struct ContinuousBatching<'a> {
    model: &'a Model,
    requests: &'a [Request],
    device: &'a Device,
    cache: PagedTransformerCache,
    waiting: VecDeque<usize>,
    /// In the order they joined: the last is preempted first.
    running: Vec<Running>,
    tokens: Vec<Vec<i64>>,
    margins: Vec<Vec<f32>>,
    first_token: Vec<Duration>,
    started: Instant,
    peak_cache: CacheBytes,
    preemptions: Preemptions,
}

impl<'a> ContinuousBatching<'a> {
    fn new(
        model: &'a Model,
        requests: &'a [Request],
        pool_blocks: usize,
        device: &'a Device,
    ) -> Self {
        let config = PagedKvCacheConfig::new(pool_blocks).with_block_size(BLOCK_SIZE);
        Self {
            model,
            requests,
            device,
            cache: model.stack.new_paged_cache(config),
            waiting: (0..requests.len()).collect(),
            running: Vec::new(),
            tokens: vec![Vec::new(); requests.len()],
            margins: vec![Vec::new(); requests.len()],
            first_token: vec![Duration::ZERO; requests.len()],
            started: Instant::now(),
            peak_cache: CacheBytes::default(),
            preemptions: Preemptions::default(),
        }
    }

    fn serve(mut self) -> (Served, Preemptions) {
        while !self.waiting.is_empty() || !self.running.is_empty() {
            self.preempt_until_decoding_fits();
            let joining = self.admit();
            if self.running.is_empty() && joining.is_empty() {
                let next = *self.waiting.front().expect("work left");
                let arrival = self.requests[next].arrival;
                std::thread::sleep(arrival.saturating_sub(self.started.elapsed()));
                continue;
            }
            self.step(joining);
        }
        let served = Served {
            tokens: self.tokens,
            margins: self.margins,
            wall: self.started.elapsed(),
            first_token: self.first_token,
            peak_cache: self.peak_cache,
        };
        (served, self.preemptions)
    }

    /// The running requests' sequences, one row each: the step that decodes them.
    fn decoding(&self) -> Vec<SequenceId> {
        self.running.iter().map(|run| run.id).collect()
    }

    /// Preempts the requests that joined last until the others' next tokens fit the pool.
    fn preempt_until_decoding_fits(&mut self) {
        while !self
            .cache
            .fits(&self.decoding())
            .expect("running sequences")
        {
            // A request alone always fits: the pool holds the longest request whole.
            let run = self.running.pop().expect("a request alone fits the pool");
            self.cache
                .remove_sequence(run.id)
                .expect("a running sequence");
            self.waiting.push_front(run.request);
            self.preemptions.count += 1;
        }
    }

    /// Adds the requests that arrived, in order, while the step with their prompts leaves a
    /// free block for each request that will decode after it (vLLM's watermark, so that one
    /// joining does not preempt another at once); a preempted request comes back first.
    fn admit(&mut self) -> Vec<Joining> {
        let mut step = self.decoding();
        let mut joining: Vec<Joining> = Vec::new();
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
            let rows = prompt[matched.cached..].to_vec();
            step.extend(std::iter::repeat_n(matched.id, rows.len()));
            // A request alone joins whenever it fits: the pool holds the longest request whole.
            let alone = self.running.is_empty() && joining.is_empty();
            let headroom = if alone {
                0
            } else {
                self.running.len() + joining.len() + 1
            };
            let needed = self
                .cache
                .blocks_needed(&step)
                .expect("sequences of the cache");
            if needed + headroom > self.cache.free_blocks() {
                self.cache
                    .remove_sequence(matched.id)
                    .expect("the sequence just added");
                break;
            }
            self.waiting.pop_front();
            if !self.tokens[next].is_empty() {
                // Rows it had computed before, all but the last token's.
                self.preemptions.recomputed += rows.len() - 1;
            }
            let run = Running {
                request: next,
                id: matched.id,
            };
            joining.push(Joining { run, rows });
        }
        joining
    }

    /// One step: a token for every running request, the rows of every joining one's prompt.
    fn step(&mut self, joining: Vec<Joining>) {
        let (mut step_tokens, mut sequences) = (Vec::new(), self.decoding());
        for run in &self.running {
            step_tokens.push(*self.tokens[run.request].last().expect("a first token"));
        }
        for join in &joining {
            step_tokens.extend(&join.rows);
            sequences.extend(std::iter::repeat_n(join.run.id, join.rows.len()));
        }
        let next = self
            .model
            .step_paged(&step_tokens, &sequences, &mut self.cache, self.device);
        self.peak_cache = self.peak_cache.peak(CacheBytes {
            stored: self.cache.bytes_in_use(),
            allocated: self.cache.reserved_bytes(),
        });
        for join in joining {
            if self.tokens[join.run.request].is_empty() {
                let arrival = self.requests[join.run.request].arrival;
                self.first_token[join.run.request] = self.started.elapsed() - arrival;
            }
            self.running.push(join.run);
        }
        for (run, choice) in self.running.iter().zip(next) {
            self.tokens[run.request].push(choice.token);
            self.margins[run.request].push(choice.margin);
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

/// One request at a time, in arrival order, each with its own `KvCache` per layer, its system
/// prompt prefilled with its own prompt.
fn serve_one_at_a_time(model: &Model, requests: &[Request], device: &Device) -> Served {
    let (mut tokens, mut margins) = (Vec::new(), Vec::new());
    let mut first_token = Vec::new();
    let mut peak_cache = CacheBytes::default();
    let started = Instant::now();
    let system = system_prompt();
    for request in requests {
        std::thread::sleep(request.arrival.saturating_sub(started.elapsed()));
        let mut cache = model.stack.new_cache();
        let prompt = [system.as_slice(), &request.prompt].concat();
        let mut generated = vec![model.step_cached(&prompt, &mut cache, device)];
        first_token.push(started.elapsed() - request.arrival);
        while generated.len() < request.output_len {
            let last = generated.last().expect("a first token").token;
            generated.push(model.step_cached(&[last], &mut cache, device));
        }
        peak_cache = peak_cache.peak(CacheBytes {
            stored: cache
                .layers
                .iter()
                .map(|layer| layer.stored())
                .sum::<usize>()
                * POSITION_BYTES,
            allocated: cache.layers.iter().map(|layer| layer.bytes()).sum(),
        });
        tokens.push(generated.iter().map(|choice| choice.token).collect());
        margins.push(generated.iter().map(|choice| choice.margin).collect());
    }
    Served {
        tokens,
        margins,
        wall: started.elapsed(),
        first_token,
        peak_cache,
    }
}

fn report(way: &str, served: &Served) {
    let generated: usize = served.tokens.iter().map(Vec::len).sum();
    let mut first: Vec<f64> = served
        .first_token
        .iter()
        .map(|d| d.as_secs_f64() * 1e3)
        .collect();
    first.sort_by(f64::total_cmp);
    let mean = first.iter().sum::<f64>() / first.len() as f64;
    let mib = |bytes: usize| bytes as f64 / (1 << 20) as f64;
    println!(
        "| {way} | {:.0} | {:.2} | {:.0} / {:.0} / {:.0} | {:.2} MiB / {:.2} MiB |",
        generated as f64 / served.wall.as_secs_f64(),
        served.wall.as_secs_f64(),
        mean,
        first[first.len() / 2],
        first[first.len() - 1],
        mib(served.peak_cache.stored),
        mib(served.peak_cache.allocated)
    );
}

/// What the command line asks for beside the device.
struct Settings {
    window: Option<usize>,
    pool_blocks: usize,
}

/// Reads `--window N` and `--pool-blocks N`; a bad value exits with the usage.
fn settings(options: &ProgramOptions, requests: &[Request]) -> Settings {
    let number = |flag: &str, least: usize, what: &str| {
        options
            .value(flag)
            .map(|value| match value.parse::<usize>() {
                Ok(number) if number >= least => number,
                _ => options.fail(&format!("`{flag}` takes {what}, not `{value}`")),
            })
    };
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
    }
}

fn main() {
    let (name, device, options) =
        device_and_options("serve", &[("--window", "N"), ("--pool-blocks", "N")]);
    let requests = requests();
    let Settings {
        window,
        pool_blocks,
    } = settings(&options, &requests);
    device.seed(7);
    let model = Model::new(window, &device);
    let wanted: usize = requests.iter().map(|r| r.output_len).sum();
    let attends = window.map_or("every position before it".to_string(), |window| {
        format!("a sliding window of {window} positions")
    });
    println!(
        "{REQUESTS} requests on {name}, one every {ARRIVAL_INTERVAL_MS} ms: a {SYSTEM_PROMPT}-token \
         system prompt then 16-192 tokens of their own, {wanted} tokens wanted in all; a \
         {LAYERS}-layer causal Transformer, d_model {D_MODEL}, 8 query / 2 key-value heads, \
         each query attending to {attends}, greedy decoding\n"
    );
    // A short warm-up, so that neither way pays for first-use costs (allocator, threads).
    serve_one_at_a_time(&model, &requests[..1], &device);
    let (batched, preemptions) =
        ContinuousBatching::new(&model, &requests, pool_blocks, &device).serve();
    let alone = serve_one_at_a_time(&model, &requests, &device);
    println!(
        "| way | tokens/s | wall s | time to first token, ms (mean / median / max) | peak cache memory: stored / allocated |"
    );
    println!("|---|---|---|---|---|");
    report(
        &format!(
            "continuous batching (paged, {pool_blocks} blocks of {BLOCK_SIZE} per layer, prompt prefixes shared)"
        ),
        &batched,
    );
    report("one at a time (KvCache per layer)", &alone);
    println!(
        "\ncontinuous batching preempted requests {} times ({} positions computed again)",
        preemptions.count, preemptions.recomputed
    );
    check_same_tokens(&batched, &alone);
}

/// Exits with status 1 if a request got different tokens from the two ways, but at a near tie.
fn check_same_tokens(batched: &Served, alone: &Served) {
    // The two ways compute the same logits to within float rounding (about 1e-5 here), so a
    // greedy choice may differ only where its two largest logits are about that close; anywhere
    // else a difference is a bug.
    let (mut ties, mut parted) = (Vec::new(), Vec::new());
    for (request, (batched_run, alone_run)) in batched.runs().zip(alone.runs()).enumerate() {
        let (batched_tokens, batched_margins) = batched_run;
        let (alone_tokens, alone_margins) = alone_run;
        let differs = batched_tokens
            .iter()
            .zip(alone_tokens)
            .position(|(a, b)| a != b)
            .or((batched_tokens.len() != alone_tokens.len())
                .then(|| batched_tokens.len().min(alone_tokens.len())));
        let Some(at) = differs else { continue };
        let margin = |margins: &[f32]| margins.get(at).copied().unwrap_or(f32::INFINITY);
        let margin = margin(batched_margins).min(margin(alone_margins));
        let line = format!("request {request} from token {at} (margin {margin:.1e})");
        if margin < NEAR_TIE {
            ties.push(line);
        } else {
            parted.push(line);
        }
    }
    let same = REQUESTS - ties.len() - parted.len();
    println!("{same} of {REQUESTS} requests got the same tokens both ways");
    if !ties.is_empty() {
        println!(
            "parted at a near tie (two largest logits within {NEAR_TIE:.0e}): {}",
            ties.join(", ")
        );
    }
    if !parted.is_empty() {
        eprintln!(
            "error: the two ways gave different tokens: {}",
            parted.join(", ")
        );
        std::process::exit(1);
    }
}
