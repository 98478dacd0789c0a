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
//! With `--window N` every layer attends within a sliding window of `N` positions: the paged
//! cache gives each sequence's blocks behind its window back to the pool after every step, and
//! the `KvCache`s keep the window's positions only, so each request's cache stays bounded
//! however long it runs.
//!
//! ```sh
//! cargo run --release --example serve -- --device flex   # or ndarray; wgpu with `--features wgpu`
//! cargo run --release --example serve -- --window 64
//! ```

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_mha::device_and_options;
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
/// The pool's bound, per layer: 8192 positions.
const MAX_BLOCKS: usize = 512;
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
            .expect("admission keeps the pool from filling");
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

/// A request being decoded in the batch.
struct Running {
    request: usize,
    id: SequenceId,
    /// Positions of its whole prompt (its first step's, with the prefix it shares).
    prompt_len: usize,
    /// Positions it may come to hold: its prompt and every token it wants (the last, sampled
    /// and not fed back, takes none; an upper bound).
    final_len: usize,
}

impl Running {
    /// Blocks it holds at most at any moment of its life: every position it comes to hold;
    /// under a `window`, the blocks of its prompt (its first step takes blocks for every row
    /// before it gives any back) or of the positions its window sees, whichever are more (the
    /// blocks wholly behind the window of its next query are given back after every step:
    /// between steps it holds at most `window.div_ceil(BLOCK_SIZE) + 1`, one more while a step
    /// takes a block before giving one back).
    fn peak_blocks(&self, window: Option<usize>) -> usize {
        let every = self.final_len.div_ceil(BLOCK_SIZE);
        match window {
            None => every,
            Some(window) => {
                let seen = every.min(window.div_ceil(BLOCK_SIZE) + 2);
                seen.max(self.prompt_len.div_ceil(BLOCK_SIZE))
            }
        }
    }

    /// Blocks it has still to take from the pool beyond those it holds now, which it keeps
    /// to its end (without a window: its shared prefix takes none).
    fn blocks_to_take(&self, cache: &PagedTransformerCache) -> usize {
        let len = cache.len(self.id).expect("a running sequence");
        self.final_len.div_ceil(BLOCK_SIZE) - len.div_ceil(BLOCK_SIZE)
    }
}

/// Whether the pool has room for every block of the `running` requests' futures and `joining`'s
/// beside them, whatever order they take and give back blocks in. Without a window a request
/// keeps every block it holds, so the blocks it has still to take must be free. Under a window
/// it gives blocks back as it goes, and a block it shares (the system prompt's) stays in use
/// while another request holds it, so each request's peak counts whole, shared blocks
/// included: a bound that does not count the sharing.
fn pool_holds(
    cache: &PagedTransformerCache,
    running: &[&Running],
    joining: &[&Running],
    window: Option<usize>,
) -> bool {
    let all = running.iter().chain(joining);
    match window {
        None => all.map(|run| run.blocks_to_take(cache)).sum::<usize>() <= cache.free_blocks(),
        Some(_) => all.map(|run| run.peak_blocks(window)).sum::<usize>() <= MAX_BLOCKS,
    }
}

/// A request's whole prompt: the system prompt, then its own.
fn full_prompt(request: &Request) -> Vec<i64> {
    [system_prompt().as_slice(), &request.prompt].concat()
}

/// Continuous batching: at every step the requests that arrived join (the part of their prompts
/// the cache does not hold is prefilled in that step) while the pool has room for all their
/// tokens, the others decode one token each, and a finished request leaves.
fn serve_batched(
    model: &Model,
    requests: &[Request],
    window: Option<usize>,
    device: &Device,
) -> Served {
    let mut cache = model
        .stack
        .new_paged_cache(PagedKvCacheConfig::new(MAX_BLOCKS).with_block_size(BLOCK_SIZE));
    let mut tokens: Vec<Vec<i64>> = requests.iter().map(|_| Vec::new()).collect();
    let mut margins: Vec<Vec<f32>> = requests.iter().map(|_| Vec::new()).collect();
    let mut first_token = vec![Duration::ZERO; requests.len()];
    let mut waiting: VecDeque<usize> = (0..requests.len()).collect();
    let mut running: Vec<Running> = Vec::new();
    let started = Instant::now();
    let mut peak_cache = CacheBytes::default();
    while !waiting.is_empty() || !running.is_empty() {
        // Each joining request and the rows of its prompt the cache does not hold: a request
        // joins only if the pool has room for all its tokens beside the others'.
        let mut joining: Vec<(Running, usize)> = Vec::new();
        while let Some(&next) = waiting.front() {
            let request = &requests[next];
            if request.arrival > started.elapsed() {
                break;
            }
            let prompt = full_prompt(request);
            let tokens: Vec<Token> = prompt.iter().map(|&t| t as Token).collect();
            // The system prompt's whole blocks, if a request in the batch (or one that left,
            // its blocks not yet overwritten) computed them, are shared.
            let matched = cache.add_sequence_with_prompt(&tokens);
            let run = Running {
                request: next,
                id: matched.id,
                prompt_len: prompt.len(),
                final_len: prompt.len() + request.output_len,
            };
            let others: Vec<&Running> = running.iter().collect();
            let mut joined: Vec<&Running> = joining.iter().map(|(run, _)| run).collect();
            joined.push(&run);
            if !pool_holds(&cache, &others, &joined, window) {
                cache
                    .remove_sequence(run.id)
                    .expect("the sequence just added");
                break;
            }
            waiting.pop_front();
            joining.push((run, matched.cached));
        }
        if running.is_empty() && joining.is_empty() {
            let arrival = requests[*waiting.front().expect("work left")].arrival;
            std::thread::sleep(arrival.saturating_sub(started.elapsed()));
            continue;
        }
        let (mut step_tokens, mut sequences) = (Vec::new(), Vec::new());
        for run in &running {
            step_tokens.push(*tokens[run.request].last().expect("a first token"));
            sequences.push(run.id);
        }
        for (run, cached) in &joining {
            let prompt = full_prompt(&requests[run.request]);
            step_tokens.extend(&prompt[*cached..]);
            sequences.extend(std::iter::repeat_n(run.id, prompt.len() - cached));
        }
        let next = model.step_paged(&step_tokens, &sequences, &mut cache, device);
        peak_cache = peak_cache.peak(CacheBytes {
            stored: cache.bytes_in_use(),
            allocated: cache.reserved_bytes(),
        });
        for (run, _) in &joining {
            first_token[run.request] = started.elapsed() - requests[run.request].arrival;
        }
        running.extend(joining.into_iter().map(|(run, _)| run));
        for (run, choice) in running.iter().zip(next) {
            tokens[run.request].push(choice.token);
            margins[run.request].push(choice.margin);
        }
        running.retain(|run| {
            let done = tokens[run.request].len() == requests[run.request].output_len;
            if done {
                cache.remove_sequence(run.id).expect("a running sequence");
            }
            !done
        });
    }
    Served {
        tokens,
        margins,
        wall: started.elapsed(),
        first_token,
        peak_cache,
    }
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

fn main() {
    let (name, device, options) = device_and_options("serve", &[("--window", "N")]);
    let window = options
        .value("--window")
        .map(|value| match value.parse::<usize>() {
            Ok(window) if window > 0 => window,
            _ => options.fail(&format!(
                "`--window` takes a number of positions (at least 1), not `{value}`"
            )),
        });
    device.seed(7);
    let model = Model::new(window, &device);
    let requests = requests();
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
    let batched = serve_batched(&model, &requests, window, &device);
    let alone = serve_one_at_a_time(&model, &requests, &device);
    println!(
        "| way | tokens/s | wall s | time to first token, ms (mean / median / max) | peak cache memory: stored / allocated |"
    );
    println!("|---|---|---|---|---|");
    report(
        &format!(
            "continuous batching (paged, {MAX_BLOCKS} blocks of {BLOCK_SIZE} per layer, prompt prefixes shared)"
        ),
        &batched,
    );
    report("one at a time (KvCache per layer)", &alone);
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
    println!("\n{same} of {REQUESTS} requests got the same tokens both ways");
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
