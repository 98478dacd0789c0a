//! Generation from a tiny (untrained) causal model with `KvCache`s, each way checked against
//! re-running the whole prefix without a cache:
//! - greedy decoding with the cache (each step feeds only the new token) and without: the same
//!   tokens, each step O(length) instead of O(length²);
//! - beam search: a batch of beams whose caches keep the surviving beams after every step
//!   (`KvCache::select_batch`); each final beam's score equals its tokens' log-probabilities
//!   recomputed;
//! - speculative decoding: the model's first layer alone drafts a few tokens, the whole model
//!   checks them in one step, and both caches are cut back past the first rejected draft
//!   (`KvCache::truncate`): the same tokens as greedy decoding.
//!
//! The example fails (exit status 1) if a check does not hold.
//!
//! ```sh
//! cargo run --release --example causal_generation -- --device flex   # or ndarray; wgpu with `--features wgpu`
//! ```

use std::time::Instant;

use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_mha::device_from_args;
use burn_mha::serving::{Beam, best_continuations};
use mha::{KvCache, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig, RopeConfig};

const VOCAB: usize = 64;
const D_MODEL: usize = 128;
const LAYERS: usize = 4;
const PROMPT: usize = 16;
const NEW_TOKENS: usize = 240;
/// Beams searched at once.
const BEAMS: usize = 4;
/// Tokens each beam search generates.
const BEAM_TOKENS: usize = 24;
/// Tokens the draft proposes per check in speculative decoding.
const DRAFTED: usize = 4;

struct TinyLm {
    embedding: Embedding,
    layers: Vec<MultiHeadAttention>,
    head: Linear,
}

impl TinyLm {
    fn new(device: &Device) -> Self {
        let attention = MultiHeadAttentionConfig::new(D_MODEL, 8)
            .with_n_kv_heads(Some(2))
            .with_rope(Some(RopeConfig::new()));
        Self {
            embedding: EmbeddingConfig::new(VOCAB, D_MODEL).init(device),
            layers: (0..LAYERS).map(|_| attention.init(device)).collect(),
            head: LinearConfig::new(D_MODEL, VOCAB).init(device),
        }
    }

    /// Next-token logits of every position of `tokens` through the first `depth` layers,
    /// `[batch, seq, vocab]`. With caches, `tokens` are the new tokens only.
    fn logits(
        &self,
        tokens: Tensor<2, Int>,
        caches: Option<&mut [KvCache]>,
        depth: usize,
    ) -> Tensor<3> {
        let mut x = self.embedding.forward(tokens);
        let layers = &self.layers[..depth];
        match caches {
            Some(caches) => {
                for (layer, cache) in layers.iter().zip(caches.iter_mut()) {
                    let attended = layer
                        .forward_cached(MhaInput::self_attn(x.clone()).causal(), cache)
                        .expect("unbounded cache");
                    x = x + attended.context;
                }
            }
            None => {
                for layer in layers {
                    x = x.clone() + layer.forward(MhaInput::self_attn(x).causal()).context;
                }
            }
        }
        self.head.forward(x)
    }

    /// Next-token logits of the last position, `[batch, vocab]`, through every layer.
    fn next_logits(&self, tokens: Tensor<2, Int>, caches: Option<&mut [KvCache]>) -> Tensor<2> {
        let logits = self.logits(tokens, caches, LAYERS);
        let [batch, seq, vocab] = logits.dims();
        logits.narrow(1, seq - 1, 1).reshape([batch, vocab])
    }
}

/// `[batch, len]` tokens on `device`.
fn tokens_of(rows: &[Vec<i64>], device: &Device) -> Tensor<2, Int> {
    let len = rows[0].len();
    let values: Vec<i64> = rows.concat();
    Tensor::from_data(TensorData::new(values, [rows.len(), len]), device)
}

/// Fresh caches for `depth` layers.
fn caches(depth: usize) -> Vec<KvCache> {
    (0..depth).map(|_| KvCache::new()).collect()
}

/// Beam search of `BEAMS` beams for `BEAM_TOKENS` tokens after `prompt`: the prompt prefilled
/// once, its caches repeated for every beam, and after each step the caches of the beams that
/// survive kept (`select_batch`). Returns each final beam's tokens and log-probability.
fn beam_search(model: &TinyLm, prompt: &[i64], device: &Device) -> Vec<Beam> {
    let mut caches = caches(LAYERS);
    let mut logits = model.next_logits(tokens_of(&[prompt.to_vec()], device), Some(&mut caches));
    let mut beams = vec![Beam::start()];
    for step in 0..BEAM_TOKENS {
        let log_probs = log_softmax(logits, 1)
            .into_data()
            .try_to_vec::<f32>()
            .expect("f32 logits");
        // Every beam's every next token, best first; the `BEAMS` best survive.
        let survivors = best_continuations(&beams, &log_probs, BEAMS);
        beams = survivors.beams;
        if step + 1 == BEAM_TOKENS {
            break;
        }
        // Each surviving beam continues its parent's cache (the prompt's, repeated, at first).
        for cache in &mut caches {
            cache.select_batch(&survivors.parents);
        }
        let last: Vec<Vec<i64>> = beams.iter().map(|beam| vec![beam.tokens[step]]).collect();
        logits = model.next_logits(tokens_of(&last, device), Some(&mut caches));
    }
    beams
}

/// The log-probability of `generated` after `prompt`, from one forward without a cache.
fn log_probability(model: &TinyLm, prompt: &[i64], generated: &[i64], device: &Device) -> f32 {
    let sequence = [prompt, generated].concat();
    let logits = model.logits(tokens_of(&[sequence], device), None, LAYERS);
    let [_, _, vocab] = logits.dims();
    let log_probs = log_softmax(logits, 2)
        .into_data()
        .try_to_vec::<f32>()
        .expect("f32 logits");
    generated
        .iter()
        .enumerate()
        .map(|(i, &token)| log_probs[(prompt.len() - 1 + i) * vocab + token as usize])
        .sum()
}

/// Greedy decoding of `count` tokens after `prompt`, speculatively: the first layer alone (the
/// draft) proposes `DRAFTED` tokens one at a time, the whole model scores them with the token
/// before them in one step, the drafts up to the first it disagrees with are kept with its own
/// next token, and both caches are cut back to the positions kept.
fn speculative(model: &TinyLm, prompt: &[i64], count: usize, device: &Device) -> Speculated {
    let (mut target, mut draft) = (caches(LAYERS), caches(1));
    let greedy = |logits: Tensor<3>| -> Vec<i64> {
        logits
            .argmax(2)
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .expect("int tokens")
    };
    let prompt_tokens = tokens_of(&[prompt.to_vec()], device);
    model.logits(prompt_tokens.clone(), Some(&mut draft), 1);
    let mut next = *greedy(model.logits(prompt_tokens, Some(&mut target), LAYERS))
        .last()
        .expect("a prompt");
    let (mut generated, mut kept, mut proposed) = (Vec::new(), 0, 0);
    let mut caches_apart = None;
    for round in 0.. {
        if generated.len() >= count {
            break;
        }
        // Both caches hold the prompt and `generated`; `next` is fed to neither yet.
        let held = prompt.len() + generated.len();
        let mut drafts = Vec::with_capacity(DRAFTED);
        let mut fed = next;
        for _ in 0..DRAFTED {
            let token =
                greedy(model.logits(tokens_of(&[vec![fed]], device), Some(&mut draft), 1))[0];
            drafts.push(token);
            fed = token;
        }
        let checked: Vec<i64> = [&[next][..], &drafts].concat();
        let chosen = greedy(model.logits(
            tokens_of(std::slice::from_ref(&checked), device),
            Some(&mut target),
            LAYERS,
        ));
        let accepted = drafts
            .iter()
            .zip(&chosen)
            .take_while(|(d, c)| d == c)
            .count();
        proposed += DRAFTED;
        kept += accepted;
        generated.extend(&checked[..=accepted]);
        next = chosen[accepted];
        // The positions kept: `next` and the accepted drafts.
        let len = held + 1 + accepted;
        for cache in &mut target {
            cache.truncate(len).expect("an unbounded cache");
        }
        for cache in &mut draft {
            cache.truncate(len).expect("an unbounded cache");
        }
        if accepted == DRAFTED {
            // The draft never fed its last proposal.
            model.logits(
                tokens_of(&[vec![drafts[DRAFTED - 1]]], device),
                Some(&mut draft),
                1,
            );
        }
        if caches_apart.is_none() && draft[0].len() != target[0].len() {
            caches_apart = Some(round);
        }
    }
    generated.truncate(count);
    Speculated {
        tokens: generated,
        drafts: [kept, proposed],
        caches_apart,
    }
}

/// What speculative decoding gave.
struct Speculated {
    tokens: Vec<i64>,
    /// Drafted tokens kept, of those proposed.
    drafts: [usize; 2],
    /// The first round after which the draft's cache and the model's held different lengths (a
    /// mistake that would only lower the drafts kept), if any.
    caches_apart: Option<usize>,
}

fn argmax(logits: Tensor<2>) -> i64 {
    logits.argmax(1).into_scalar::<i64>()
}

fn main() {
    let (device_name, device) = device_from_args("causal_generation");
    device.seed(0);
    let model = TinyLm::new(&device);
    let prompt: Vec<i64> = (0..PROMPT as i64)
        .map(|i| (i * 7 + 3) % VOCAB as i64)
        .collect();
    println!(
        "device: {device_name}; {LAYERS} layers, d_model {D_MODEL}, 8 query / 2 key-value heads, RoPE"
    );
    println!("prompt {PROMPT} tokens, generated {NEW_TOKENS}");
    let mut failures = Vec::new();
    let greedy = check_greedy(&model, &prompt, &device, &mut failures);
    check_beams(&model, &prompt, &device, &mut failures);
    check_speculative(&model, &prompt, &greedy, &device, &mut failures);
    if !failures.is_empty() {
        eprintln!("error: {}", failures.join("; "));
        std::process::exit(1);
    }
}

/// Greedy decoding with the cache (the prompt once, then one token per step) and without (the
/// whole prefix at every step): the same tokens, returned (after the prompt).
fn check_greedy(
    model: &TinyLm,
    prompt: &[i64],
    device: &Device,
    failures: &mut Vec<String>,
) -> Vec<i64> {
    let tokens = |values: &[i64]| tokens_of(&[values.to_vec()], device);
    let started = Instant::now();
    let mut caches = caches(LAYERS);
    let mut cached = prompt.to_vec();
    let mut next = argmax(model.next_logits(tokens(prompt), Some(&mut caches)));
    for _ in 0..NEW_TOKENS {
        cached.push(next);
        next = argmax(model.next_logits(tokens(&[next]), Some(&mut caches)));
    }
    let cached_time = started.elapsed();

    let started = Instant::now();
    let mut recomputed = prompt.to_vec();
    for _ in 0..NEW_TOKENS {
        let next = argmax(model.next_logits(tokens(&recomputed), None));
        recomputed.push(next);
    }
    let recompute_time = started.elapsed();

    println!(
        "KV cache:        {:8.2} ms per token",
        cached_time.as_secs_f64() * 1e3 / NEW_TOKENS as f64
    );
    println!(
        "re-run prefix:   {:8.2} ms per token ({:.1}x slower)",
        recompute_time.as_secs_f64() * 1e3 / NEW_TOKENS as f64,
        recompute_time.as_secs_f64() / cached_time.as_secs_f64()
    );
    let same = cached == recomputed;
    println!("same tokens both ways: {same}");
    println!("last tokens: {:?}", &cached[cached.len() - 12..]);
    if !same {
        failures.push("cached and recomputed generation differ".to_string());
    }
    cached.split_off(prompt.len())
}

/// Beam search, each final beam's score against its tokens' log-probability recomputed.
fn check_beams(model: &TinyLm, prompt: &[i64], device: &Device, failures: &mut Vec<String>) {
    let started = Instant::now();
    let beams = beam_search(model, prompt, device);
    let beam_time = started.elapsed();
    let off = beams
        .iter()
        .map(|beam| (beam.score - log_probability(model, prompt, &beam.tokens, device)).abs())
        .fold(0.0f32, f32::max);
    println!(
        "beam search:     {BEAMS} beams, {BEAM_TOKENS} tokens in {:.1} ms; best log-probability \
         {:.3}; scores within {off:.1e} of recomputed",
        beam_time.as_secs_f64() * 1e3,
        beams[0].score
    );
    if off > 1e-3 {
        failures.push(format!(
            "a beam's score is {off} off its recomputed log-probability"
        ));
    }
}

/// Speculative decoding against `greedy`'s tokens: the same, unless at a near tie of the
/// model's two largest logits (the check step computes them in another order than one token
/// at a time).
fn check_speculative(
    model: &TinyLm,
    prompt: &[i64],
    greedy: &[i64],
    device: &Device,
    failures: &mut Vec<String>,
) {
    let started = Instant::now();
    let speculated = speculative(model, prompt, NEW_TOKENS, device);
    let speculative_time = started.elapsed();
    let [kept, proposed] = speculated.drafts;
    println!(
        "speculative:     {:8.2} ms per token, {kept} of {proposed} drafted tokens kept",
        speculative_time.as_secs_f64() * 1e3 / NEW_TOKENS as f64
    );
    if let Some(round) = speculated.caches_apart {
        failures.push(format!(
            "after speculative round {round} the draft's and the model's caches held different \
             lengths"
        ));
    }
    let Some(at) = speculated
        .tokens
        .iter()
        .zip(greedy)
        .position(|(a, b)| a != b)
    else {
        println!("speculative decoding gave greedy decoding's tokens");
        return;
    };
    let before = [prompt, &greedy[..at]].concat();
    let margin = top_two_margin(model.next_logits(tokens_of(&[before], device), None));
    if margin < 1e-3 {
        println!(
            "speculative decoding parted from greedy at token {at}, a near tie ({margin:.1e})"
        );
    } else {
        failures.push(format!(
            "speculative decoding parted from greedy at token {at}"
        ));
    }
}

/// How far the largest of `logits` (`[1, vocab]`) lies above the runner-up.
fn top_two_margin(logits: Tensor<2>) -> f32 {
    let mut values = logits.into_data().try_to_vec::<f32>().expect("f32 logits");
    values.sort_by(|a, b| b.total_cmp(a));
    values[0] - values[1]
}
