//! Continuous batching of a trained model's decoder: many sequences, each at its own position,
//! decoded one ragged step at a time over the stack's paged caches
//! (`TransformerEncoder::forward_paged` for a causal decoder,
//! `TransformerDecoder::forward_paged` for an encoder-decoder, each sequence over its own
//! source's memory).

use std::collections::BTreeMap;

use burn::tensor::{Device, Int, Tensor, TensorData};
use mha::transformer::{PagedTransformerCache, PagedTransformerDecoderCache};
use mha::{PagedCacheError, PagedKvCacheConfig, SequenceId};

use super::Transformer;

/// The paged caches of a model's decoder and where each of its sequences stands.
pub struct PagedDecoding {
    stack: PagedStack,
    sequences: BTreeMap<SequenceId, Progress>,
}

enum PagedStack {
    DecoderOnly(PagedTransformerCache),
    EncoderDecoder(PagedTransformerDecoderCache),
}

/// What the next tokens of a sequence are embedded with.
#[derive(Debug, Clone, Copy, Default)]
struct Progress {
    /// The next token's position.
    position: usize,
    /// The last token fed: the previous token of the next one (previous-token embeddings).
    last_token: Option<usize>,
}

/// One sequence's tokens in a step: its prompt when it joins, its last token after.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepRun {
    pub id: SequenceId,
    pub tokens: Vec<usize>,
}

impl PagedDecoding {
    /// Blocks in use in each layer's pool (the same in every layer: no layer has a window).
    pub fn blocks_in_use(&self) -> usize {
        let layers = match &self.stack {
            PagedStack::DecoderOnly(cache) => cache.layers(),
            PagedStack::EncoderDecoder(cache) => cache.self_attention().layers(),
        };
        layers
            .iter()
            .map(|layer| layer.blocks_in_use())
            .max()
            .unwrap_or(0)
    }

    /// Removes a finished sequence: its blocks are free for the next at once.
    pub fn remove(&mut self, id: SequenceId) -> Result<(), PagedCacheError> {
        match &mut self.stack {
            PagedStack::DecoderOnly(cache) => cache.remove_sequence(id)?,
            PagedStack::EncoderDecoder(cache) => cache.remove_sequence(id)?,
        }
        self.sequences.remove(&id);
        Ok(())
    }
}

impl Transformer {
    /// Empty paged caches for the model's decoder, a pool of `config` per layer.
    ///
    /// # Errors
    ///
    /// For an encoder-only model (it predicts every position at once: nothing to decode), and
    /// for the encoder-decoder ablation (`--no-attention`), whose cross-attention hides its
    /// whole memory: a paged sequence's memory has no padding mask.
    pub fn start_paged(&self, config: PagedKvCacheConfig) -> Result<PagedDecoding, String> {
        let stack = match (&self.causal_stack, &self.decoder) {
            (Some(stack), _) => PagedStack::DecoderOnly(stack.new_paged_cache(config)),
            (None, Some(_)) if self.no_attention => {
                return Err(
                    "the encoder-decoder ablation (--no-attention) hides its memory \
                            from the cross-attention, which a paged sequence cannot"
                        .into(),
                );
            }
            (None, Some(decoder)) => PagedStack::EncoderDecoder(decoder.new_paged_cache(config)),
            (None, None) => {
                return Err(
                    "an encoder-only model predicts every position at once: it has \
                            no decoder to serve token by token"
                        .into(),
                );
            }
        };
        Ok(PagedDecoding {
            stack,
            sequences: BTreeMap::new(),
        })
    }

    /// A new sequence of `state`; an encoder-decoder encodes `source` (alone) now.
    ///
    /// # Panics
    ///
    /// If an encoder-decoder gets no source.
    pub fn join_paged(
        &self,
        state: &mut PagedDecoding,
        source: &[usize],
        device: &Device,
    ) -> SequenceId {
        let id = match &mut state.stack {
            PagedStack::DecoderOnly(cache) => cache.add_sequence(),
            PagedStack::EncoderDecoder(cache) => {
                assert!(!source.is_empty(), "an encoder-decoder reads a source");
                let memory = self
                    .encode(Some(token_row(source, device)))
                    .expect("an encoder-decoder has an encoder");
                let [_, seq, d_model] = memory.dims();
                let decoder = self.decoder.as_ref().expect("an encoder-decoder");
                decoder.add_paged_sequence(cache, memory.reshape([seq, d_model]))
            }
        };
        state.sequences.insert(id, Progress::default());
        id
    }

    /// One step for every run of `runs` (a sequence of `state` each, at most once): each
    /// run's tokens at its sequence's next positions. Returns the logits of each run's last
    /// token, `[runs, vocab]`, as [`decode_step`](Self::decode_step) gives them to the
    /// sequence alone.
    ///
    /// # Errors
    ///
    /// As `forward_paged`: a sequence not in `state`, a pool without the blocks the step
    /// needs (nothing is then stored).
    ///
    /// # Panics
    ///
    /// If `runs` is empty or a run has no tokens.
    pub fn paged_step(
        &self,
        state: &mut PagedDecoding,
        runs: &[StepRun],
        device: &Device,
    ) -> Result<Tensor<2>, PagedCacheError> {
        assert!(
            !runs.is_empty() && runs.iter().all(|run| !run.tokens.is_empty()),
            "paged_step: every run needs tokens"
        );
        let mut embedded = Vec::with_capacity(runs.len());
        let mut row_ids = Vec::new();
        let mut last_rows = Vec::with_capacity(runs.len());
        for run in runs {
            let progress = *state
                .sequences
                .get(&run.id)
                .ok_or(PagedCacheError::UnknownSequence(run.id))?;
            let previous = progress
                .last_token
                .map(|token| Tensor::<2, Int>::from_data(token_data(&[token]), device));
            let x = self.embed_from(token_row(&run.tokens, device), progress.position, previous);
            let [_, new, d_model] = x.dims();
            embedded.push(x.reshape([new, d_model]));
            row_ids.extend(std::iter::repeat_n(run.id, new));
            last_rows.push((row_ids.len() - 1) as i64);
        }
        let x = Tensor::cat(embedded, 0);
        let output = match &mut state.stack {
            PagedStack::DecoderOnly(cache) => self
                .causal_stack
                .as_ref()
                .expect("a decoder-only model")
                .forward_paged(x, cache, &row_ids)?,
            PagedStack::EncoderDecoder(cache) => self
                .decoder
                .as_ref()
                .expect("an encoder-decoder")
                .forward_paged(x, cache, &row_ids)?,
        };
        // The step is stored: each sequence moves past its tokens.
        for run in runs {
            let progress = state.sequences.get_mut(&run.id).expect("checked above");
            progress.position += run.tokens.len();
            progress.last_token = run.tokens.last().copied();
        }
        let rows = last_rows.len();
        let last = output.select(
            0,
            Tensor::<1, Int>::from_data(TensorData::new(last_rows, [rows]), device),
        );
        Ok(self.head.forward(self.final_norm.forward(last)))
    }
}

/// `tokens` as a `[1, tokens]` tensor.
pub fn token_row(tokens: &[usize], device: &Device) -> Tensor<2, Int> {
    Tensor::from_data(token_data(tokens), device)
}

fn token_data(tokens: &[usize]) -> TensorData {
    let values: Vec<i64> = tokens.iter().map(|&token| token as i64).collect();
    TensorData::new(values, [1, tokens.len()])
}
