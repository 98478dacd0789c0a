//! The requests and the model the example serves.

use std::time::Duration;

use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Bool, Device, Tensor};
use burn_mha::serving::{Numbers, embed, last_rows};
use mha::transformer::{
    PagedTransformerDecoderCache, TransformerDecoder, TransformerDecoderCache,
    TransformerDecoderConfig, TransformerDecoderInput, TransformerEncoder,
    TransformerEncoderConfig, TransformerEncoderInput,
};
use mha::{RopeConfig, SequenceId};

pub(crate) const VOCAB: usize = 256;
pub(crate) const D_MODEL: usize = 256;
/// Layers of the encoder, and of the decoder.
pub(crate) const LAYERS: usize = 2;
pub(crate) const HEADS: usize = 8;
pub(crate) const KV_HEADS: usize = 2;
/// Bytes a layer stores per position, of the decoder's own or of a projected source: an f32
/// key and value per key/value head.
pub(crate) const POSITION_BYTES: usize = 2 * KV_HEADS * (D_MODEL / HEADS) * 4;
pub(crate) const REQUESTS: usize = 32;
pub(crate) const BLOCK_SIZE: usize = 16;
/// The token every output starts with.
pub(crate) const START: i64 = 1;

/// One client's request: its source, the forced start of its output, and how many tokens it
/// wants after that.
pub(crate) struct Request {
    pub(crate) arrival: Duration,
    pub(crate) source: Vec<i64>,
    /// [`START`], then up to seven tokens.
    pub(crate) forced: Vec<i64>,
    pub(crate) max_tokens: usize,
}

impl Request {
    /// The decoder positions it takes: its forced start and every token it wants (the last one
    /// generated is not fed back).
    fn target_len(&self) -> usize {
        self.forced.len() + self.max_tokens - 1
    }

    /// The blocks of one layer's pool its decoder positions take.
    pub(crate) fn blocks(&self) -> usize {
        self.target_len().div_ceil(BLOCK_SIZE)
    }
}

/// A deterministic stream of requests: sources of 16–320 tokens, forced starts of 1–8 tokens,
/// 16–128 tokens wanted.
pub(crate) fn requests() -> Vec<Request> {
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
pub(crate) struct Model {
    embedding: Embedding,
    encoder: TransformerEncoder,
    pub(crate) decoder: TransformerDecoder,
    head: Linear,
}

impl Model {
    pub(crate) fn new(device: &Device) -> Self {
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
    pub(crate) fn encode(&self, source: &[i64], device: &Device) -> Tensor<3> {
        self.encoder
            .forward(TransformerEncoderInput::new(self.embed(source, device)))
    }

    /// Next-token log-probabilities of one paged step, `[runs, vocab]` row by row:
    /// `tokens[i]` belongs to `sequences[i]`; one row per run of rows (its last row's).
    pub(crate) fn step_paged(
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
    /// `cache` over `memory`, `[batch, vocab]` row by row. `padding`, at a batch's first step,
    /// marks what no query may attend to; the caches keep it for the later steps.
    pub(crate) fn step_cached(
        &self,
        tokens: &[i64],
        batch: usize,
        memory: &Tensor<3>,
        padding: Option<Padding>,
        cache: &mut TransformerDecoderCache,
        device: &Device,
    ) -> Vec<f32> {
        let new = tokens.len() / batch;
        let x = self.embed(tokens, device).reshape([batch, new, D_MODEL]);
        let mut input = TransformerDecoderInput::new(x, memory.clone());
        if let Some(Padding { target, memory }) = padding {
            input = input.target_mask_pad(target).memory_mask_pad(memory);
        }
        let hidden = self
            .decoder
            .forward_cached(input, cache)
            .expect("the decoder's own caches take every step");
        let last = hidden.narrow(1, new - 1, 1).reshape([batch, D_MODEL]);
        log_probs(self.head.forward(last))
    }
}

/// A static batch's padding, `true` = padding: its targets' in front (`[batch, new]`) and its
/// memories' behind (`[batch, seq_memory]`).
pub(crate) struct Padding {
    pub(crate) target: Tensor<2, Bool>,
    pub(crate) memory: Tensor<2, Bool>,
}

/// `logits`' log-softmax over the vocabulary, row by row.
fn log_probs(logits: Tensor<2>) -> Vec<f32> {
    log_softmax(logits, 1)
        .into_data()
        .try_to_vec::<f32>()
        .expect("f32 logits")
}
