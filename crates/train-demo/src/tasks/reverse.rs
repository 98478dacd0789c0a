//! Reverse a sequence: output `i` is input `L - 1 - i`. Needs attention across positions and
//! positional information (UvA DL tutorial 6: 1 layer, 1 head reaches 100%).

use super::{Architecture, Example, Task, TaskDefaults};
use crate::rng::Rng;

pub const DEFAULTS: TaskDefaults = TaskDefaults {
    d_model: 64,
    heads: 1,
    layers: 1,
    steps: 1500,
    batch_size: 64,
    lr: 1e-3,
    seq_len: 16,
    vocab: 10,
    rotary: false,
    token_shift: false,
    feed_forward: true,
};

pub struct Reverse {
    seq_len: usize,
    vocab: usize,
}

impl Reverse {
    pub fn new(seq_len: usize, vocab: usize) -> Result<Self, String> {
        if seq_len < 2 || vocab < 2 {
            return Err("reverse needs --seq-len >= 2 and --vocab >= 2".into());
        }
        Ok(Self { seq_len, vocab })
    }
}

impl Task for Reverse {
    fn architecture(&self) -> Architecture {
        Architecture::Encoder
    }
    fn vocab(&self) -> usize {
        self.vocab
    }
    fn max_len(&self) -> usize {
        self.seq_len
    }
    fn sample(&self, rng: &mut Rng) -> Example {
        let source: Vec<usize> = (0..self.seq_len).map(|_| rng.below(self.vocab)).collect();
        let target = source.iter().rev().map(|&t| t as i64).collect();
        Example {
            source,
            decoder_input: Vec::new(),
            target,
        }
    }
    fn generate_len(&self) -> Option<usize> {
        None
    }
    fn chance_token_accuracy(&self) -> f64 {
        1.0 / self.vocab as f64
    }
    fn describe(&self) -> String {
        format!(
            "reverse {} tokens of {} symbols (encoder)",
            self.seq_len, self.vocab
        )
    }
}
