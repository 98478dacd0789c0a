//! Sort: a causal language model reads the digits and generates them sorted, token by token
//! (minGPT's demo: 6 digits of 0-2).

use super::{Architecture, Example, IGNORE, Task, TaskDefaults};
use crate::rng::Rng;

pub const DEFAULTS: TaskDefaults = TaskDefaults {
    d_model: 48,
    heads: 3,
    layers: 2,
    steps: 1500,
    batch_size: 64,
    lr: 2e-3,
    seq_len: 6,
    vocab: 3,
};

pub struct Sort {
    seq_len: usize,
    vocab: usize,
}

impl Sort {
    pub fn new(seq_len: usize, vocab: usize) -> Result<Self, String> {
        if seq_len < 2 || vocab < 2 {
            return Err("sort needs --seq-len >= 2 and --vocab >= 2".into());
        }
        Ok(Self { seq_len, vocab })
    }
}

impl Task for Sort {
    fn architecture(&self) -> Architecture {
        Architecture::Decoder
    }
    fn vocab(&self) -> usize {
        self.vocab
    }
    fn max_len(&self) -> usize {
        2 * self.seq_len - 1
    }
    fn sample(&self, rng: &mut Rng) -> Example {
        let digits: Vec<usize> = (0..self.seq_len).map(|_| rng.below(self.vocab)).collect();
        let mut sorted = digits.clone();
        sorted.sort_unstable();
        let sequence: Vec<usize> = digits.iter().chain(&sorted).copied().collect();
        // Position i predicts token i + 1; only the sorted half is scored.
        let target = (1..sequence.len())
            .map(|i| {
                if i >= self.seq_len {
                    sequence[i] as i64
                } else {
                    IGNORE
                }
            })
            .collect();
        Example {
            source: Vec::new(),
            decoder_input: sequence[..sequence.len() - 1].to_vec(),
            target,
        }
    }
    fn generate_len(&self) -> Option<usize> {
        Some(self.seq_len)
    }
    fn chance_token_accuracy(&self) -> f64 {
        1.0 / self.vocab as f64
    }
    fn describe(&self) -> String {
        format!(
            "sort {} digits of 0..{} (causal decoder, generated)",
            self.seq_len, self.vocab
        )
    }
}
