//! Copy through cross-attention: an encoder reads the source, a causal decoder emits it again
//! (The Annotated Transformer's toy task: vocabulary 11, length 10).

use super::{Architecture, Example, Task, TaskDefaults};
use crate::rng::Rng;

/// The decoder's start token; sources use the other symbols.
pub const BOS: usize = 0;

pub const DEFAULTS: TaskDefaults = TaskDefaults {
    d_model: 64,
    heads: 4,
    layers: 1,
    steps: 800,
    batch_size: 64,
    lr: 1e-3,
    seq_len: 10,
    vocab: 11,
    rotary: false,
    token_shift: false,
    feed_forward: true,
};

pub struct Copy {
    seq_len: usize,
    vocab: usize,
}

impl Copy {
    pub fn new(seq_len: usize, vocab: usize) -> Result<Self, String> {
        if seq_len < 2 || vocab < 3 {
            return Err("copy needs --seq-len >= 2 and --vocab >= 3".into());
        }
        Ok(Self { seq_len, vocab })
    }
}

impl Task for Copy {
    fn architecture(&self) -> Architecture {
        Architecture::EncoderDecoder
    }
    fn vocab(&self) -> usize {
        self.vocab
    }
    fn max_len(&self) -> usize {
        self.seq_len
    }
    fn sample(&self, rng: &mut Rng) -> Example {
        let source: Vec<usize> = (0..self.seq_len)
            .map(|_| 1 + rng.below(self.vocab - 1))
            .collect();
        let decoder_input = std::iter::once(BOS)
            .chain(source[..self.seq_len - 1].iter().copied())
            .collect();
        let target = source.iter().map(|&t| t as i64).collect();
        Example {
            source,
            decoder_input,
            target,
        }
    }
    fn generate_len(&self) -> Option<usize> {
        Some(self.seq_len)
    }
    fn chance_token_accuracy(&self) -> f64 {
        1.0 / (self.vocab - 1) as f64
    }
    fn describe(&self) -> String {
        format!(
            "copy {} symbols of {} (encoder-decoder, greedy decoding)",
            self.seq_len,
            self.vocab - 1
        )
    }
}
