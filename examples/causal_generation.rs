//! Greedy generation from a tiny (untrained) causal model, twice: with a KV cache (each step
//! feeds only the new token) and by re-running the whole prefix at every step. Both must emit
//! the same tokens; the cache makes each step cost O(length) instead of O(length²).
//!
//! ```sh
//! cargo run --release --example causal_generation -- --device flex   # or ndarray; wgpu with `--features wgpu`
//! ```

use std::time::Instant;

use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_mha::device_from_args;
use mha::{KvCache, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig, RopeConfig};

const VOCAB: usize = 64;
const D_MODEL: usize = 128;
const LAYERS: usize = 4;
const PROMPT: usize = 16;
const NEW_TOKENS: usize = 240;

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

    /// Next-token logits of the last position, `[batch, vocab]`. With caches, `tokens` are the
    /// new tokens only.
    fn next_logits(&self, tokens: Tensor<2, Int>, caches: Option<&mut [KvCache]>) -> Tensor<2> {
        let mut x = self.embedding.forward(tokens);
        match caches {
            Some(caches) => {
                for (layer, cache) in self.layers.iter().zip(caches.iter_mut()) {
                    let attended = layer
                        .forward_cached(MhaInput::self_attn(x.clone()).causal(), cache)
                        .expect("unbounded cache");
                    x = x + attended.context;
                }
            }
            None => {
                for layer in &self.layers {
                    x = x.clone() + layer.forward(MhaInput::self_attn(x).causal()).context;
                }
            }
        }
        let [batch, seq, _] = x.dims();
        let last = x.narrow(1, seq - 1, 1).reshape([batch, D_MODEL]);
        self.head.forward(last)
    }
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
    let tokens = |values: &[i64]| {
        Tensor::<2, Int>::from_data(TensorData::new(values.to_vec(), [1, values.len()]), &device)
    };

    // With the cache: the prompt once, then one token per step.
    let started = Instant::now();
    let mut caches: Vec<KvCache> = (0..LAYERS).map(|_| KvCache::new()).collect();
    let mut cached = prompt.clone();
    let mut next = argmax(model.next_logits(tokens(&prompt), Some(&mut caches)));
    for _ in 0..NEW_TOKENS {
        cached.push(next);
        next = argmax(model.next_logits(tokens(&[next]), Some(&mut caches)));
    }
    let cached_time = started.elapsed();

    // Without: the whole prefix at every step.
    let started = Instant::now();
    let mut recomputed = prompt.clone();
    for _ in 0..NEW_TOKENS {
        let next = argmax(model.next_logits(tokens(&recomputed), None));
        recomputed.push(next);
    }
    let recompute_time = started.elapsed();

    println!(
        "device: {device_name}; {LAYERS} layers, d_model {D_MODEL}, 8 query / 2 key-value heads, RoPE"
    );
    println!("prompt {PROMPT} tokens, generated {NEW_TOKENS}");
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
        eprintln!("error: cached and recomputed generation differ");
        std::process::exit(1);
    }
}
