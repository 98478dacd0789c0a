//! Toy sequence tasks that need attention across positions, one file each, behind [`Task`].

mod copy;
mod count;
mod recall;
mod reverse;
mod sort;

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

use crate::rng::Rng;

/// The target of a position that carries no loss and no accuracy.
pub const IGNORE: i64 = -1;

/// How the model reads an example.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Architecture {
    /// Bidirectional self-attention over `source`; one prediction per position.
    Encoder,
    /// Causal language model over `decoder_input`.
    Decoder,
    /// Bidirectional encoder over `source`, causal decoder with cross-attention over
    /// `decoder_input`.
    EncoderDecoder,
}

/// One training example. Unused parts are empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    pub source: Vec<usize>,
    pub decoder_input: Vec<usize>,
    /// Per position of the model's output sequence; [`IGNORE`] where nothing is predicted.
    pub target: Vec<i64>,
}

/// The tasks the demo trains on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskKind {
    /// Reverse a sequence (encoder only).
    Reverse,
    /// Generate the sorted sequence token by token (decoder only).
    Sort,
    /// Copy the source through cross-attention (encoder-decoder).
    Copy,
    /// Multi-query associative recall (decoder only, 2 layers).
    Recall,
    /// Count the ones before and after each position at once, as one symbol (an attention-only
    /// encoder, one head per side; --vocab is (w + 1)² for windows of w bits).
    Count,
}

/// The default model and training sizes of a task: what reaches its target.
#[derive(Debug, Clone, Copy)]
pub struct TaskDefaults {
    pub d_model: usize,
    pub heads: usize,
    pub layers: usize,
    pub steps: usize,
    pub batch_size: usize,
    pub lr: f64,
    pub seq_len: usize,
    pub vocab: usize,
    /// Rotary positions instead of learned position embeddings.
    pub rotary: bool,
    /// Previous-token embeddings (see `TransformerConfig::token_shift`).
    pub token_shift: bool,
    /// Feed-forward blocks (see `TransformerConfig::feed_forward`).
    pub feed_forward: bool,
}

/// A task: draws examples, says how outputs are scored and what chance level is.
pub trait Task: Send + Sync {
    fn architecture(&self) -> Architecture;
    /// Tokens in the model's vocabulary.
    fn vocab(&self) -> usize;
    /// Longest input the model reads.
    fn max_len(&self) -> usize;
    fn sample(&self, rng: &mut Rng) -> Example;
    /// Whether an example belongs to the held-out split (never trained on). Tasks with few
    /// distinct inputs split them (sort holds out a quarter, as minGPT does); the others rely
    /// on the held-out generator's other seed.
    fn is_held_out(&self, _example: &Example) -> bool {
        false
    }
    /// For generative tasks: how many tokens to generate after the prompt, which is the
    /// part of `decoder_input` before the first scored position.
    fn generate_len(&self) -> Option<usize>;
    /// Token accuracy of a model that ignores the other positions.
    fn chance_token_accuracy(&self) -> f64;
    fn describe(&self) -> String;
}

/// A training example: outside the held-out split.
pub fn sample_train(task: &dyn Task, rng: &mut Rng) -> Example {
    loop {
        let example = task.sample(rng);
        if !task.is_held_out(&example) {
            return example;
        }
    }
}

/// A held-out example: inside the held-out split where the task has one.
pub fn sample_held_out(task: &dyn Task, rng: &mut Rng, has_split: bool) -> Example {
    loop {
        let example = task.sample(rng);
        if !has_split || task.is_held_out(&example) {
            return example;
        }
    }
}

impl TaskKind {
    pub fn defaults(self) -> TaskDefaults {
        match self {
            Self::Reverse => reverse::DEFAULTS,
            Self::Sort => sort::DEFAULTS,
            Self::Copy => copy::DEFAULTS,
            Self::Recall => recall::DEFAULTS,
            Self::Count => count::DEFAULTS,
        }
    }

    pub fn build(self, seq_len: usize, vocab: usize) -> Result<Box<dyn Task>, String> {
        Ok(match self {
            Self::Reverse => Box::new(reverse::Reverse::new(seq_len, vocab)?),
            Self::Sort => Box::new(sort::Sort::new(seq_len, vocab)?),
            Self::Copy => Box::new(copy::Copy::new(seq_len, vocab)?),
            Self::Recall => Box::new(recall::Recall::new(seq_len, vocab)?),
            Self::Count => Box::new(count::Count::new(seq_len, vocab)?),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Reverse => "reverse",
            Self::Sort => "sort",
            Self::Copy => "copy",
            Self::Recall => "recall",
            Self::Count => "count",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_samples_consistent_examples() {
        for kind in [
            TaskKind::Reverse,
            TaskKind::Sort,
            TaskKind::Copy,
            TaskKind::Recall,
            TaskKind::Count,
        ] {
            let defaults = kind.defaults();
            let task = kind.build(defaults.seq_len, defaults.vocab).unwrap();
            let mut rng = Rng::new(3);
            for _ in 0..20 {
                let example = task.sample(&mut rng);
                let length = match task.architecture() {
                    Architecture::Encoder => example.source.len(),
                    _ => example.decoder_input.len(),
                };
                assert_eq!(example.target.len(), length, "{kind:?}");
                assert!(length <= task.max_len());
                let tokens = example.source.iter().chain(&example.decoder_input);
                assert!(tokens.into_iter().all(|&t| t < task.vocab()), "{kind:?}");
                assert!(example.target.iter().any(|&t| t != IGNORE));
                assert!(
                    example
                        .target
                        .iter()
                        .all(|&t| t == IGNORE || (t as usize) < task.vocab())
                );
            }
        }
    }
}
