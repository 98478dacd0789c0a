//! Sort: a causal language model reads the digits and generates them sorted, token by token
//! (minGPT's demo: 6 digits of 0-2).

use super::{Architecture, Example, IGNORE, Task, TaskDefaults};
use crate::rng::Rng;

pub const DEFAULTS: TaskDefaults = TaskDefaults {
    d_model: 48,
    heads: 3,
    layers: 2,
    steps: 3000,
    batch_size: 64,
    lr: 2e-3,
    seq_len: 6,
    vocab: 3,
    rotary: false,
    token_shift: false,
    feed_forward: true,
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
    fn is_held_out(&self, example: &Example) -> bool {
        // A quarter of the digit sequences, chosen by a hash of the digits.
        let digits = &example.decoder_input[..self.seq_len];
        let hash = digits.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &d| {
            (h ^ d as u64).wrapping_mul(0x100_0000_01b3)
        });
        hash % 4 == 0
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tasks::{sample_held_out, sample_train};

    #[test]
    fn a_quarter_of_the_sequences_is_held_out_and_never_trained_on() {
        let sort = Sort::new(6, 3).unwrap();
        let mut rng = Rng::new(1);
        let held: Vec<Example> = (0..300)
            .map(|_| sample_held_out(&sort, &mut rng, true))
            .collect();
        let trained: Vec<Example> = (0..300).map(|_| sample_train(&sort, &mut rng)).collect();
        assert!(trained.iter().all(|e| !held.contains(e)));
        let fraction = (0..2000)
            .filter(|_| sort.is_held_out(&sort.sample(&mut rng)))
            .count() as f64
            / 2000.0;
        assert!(
            (0.15..0.35).contains(&fraction),
            "held-out fraction {fraction}"
        );
    }
}
