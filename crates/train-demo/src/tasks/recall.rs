//! Multi-query associative recall (Zoology's MQAR): key-value pairs, then the keys again in
//! another order; at each repeated key the model must emit its value. Content-addressed
//! lookup: needs attention, and two layers (an induction-style circuit).

use super::{Architecture, Example, IGNORE, Task, TaskDefaults};
use crate::rng::Rng;

pub const DEFAULTS: TaskDefaults = TaskDefaults {
    d_model: 64,
    heads: 2,
    layers: 2,
    steps: 600,
    batch_size: 64,
    lr: 1e-3,
    // key-value pairs per sequence
    seq_len: 8,
    vocab: 64,
    rotary: false,
    // Without it the induction circuit (a previous-token head, then a head matching on it)
    // did not form within 12000 steps, here and in an equivalent PyTorch model
    // (reference/mqar_plateau.py): token accuracy stays on a plateau near 20%.
    token_shift: true,
    feed_forward: true,
};

pub struct Recall {
    pairs: usize,
    vocab: usize,
}

impl Recall {
    pub fn new(pairs: usize, vocab: usize) -> Result<Self, String> {
        if pairs < 1 || vocab < 4 * pairs {
            return Err(format!(
                "recall needs --vocab >= 4 * pairs (--seq-len counts pairs): {vocab} < {}",
                4 * pairs
            ));
        }
        Ok(Self { pairs, vocab })
    }
}

impl Task for Recall {
    fn architecture(&self) -> Architecture {
        Architecture::Decoder
    }
    fn vocab(&self) -> usize {
        self.vocab
    }
    fn max_len(&self) -> usize {
        4 * self.pairs - 1
    }
    fn sample(&self, rng: &mut Rng) -> Example {
        // Keys from the lower half of the vocabulary, values from the upper, no repeats.
        let half = self.vocab / 2;
        let mut keys: Vec<usize> = (0..half).collect();
        rng.shuffle(&mut keys);
        keys.truncate(self.pairs);
        let values: Vec<usize> = (0..self.pairs).map(|_| half + rng.below(half)).collect();
        // Every key is queried once, in a new order. The first query never asks for the last
        // pair, whose value sits right before it, in reach of the previous-token embedding.
        let mut order: Vec<usize> = (0..self.pairs).collect();
        rng.shuffle(&mut order);
        if self.pairs > 1 && order[0] == self.pairs - 1 {
            let other = 1 + rng.below(self.pairs - 1);
            order.swap(0, other);
        }
        let mut sequence = Vec::with_capacity(4 * self.pairs);
        for (key, value) in keys.iter().zip(&values) {
            sequence.extend([*key, *value]);
        }
        for &index in &order {
            sequence.extend([keys[index], values[index]]);
        }
        // Position i predicts token i + 1: scored where token i is a queried key.
        let target = (0..sequence.len() - 1)
            .map(|i| {
                let is_query = i >= 2 * self.pairs && (i - 2 * self.pairs).is_multiple_of(2);
                if is_query {
                    sequence[i + 1] as i64
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
        None
    }
    fn chance_token_accuracy(&self) -> f64 {
        // One of the vocab / 2 value tokens.
        2.0 / self.vocab as f64
    }
    fn describe(&self) -> String {
        format!(
            "multi-query associative recall, {} pairs, vocabulary {} (causal decoder)",
            self.pairs, self.vocab
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_answer_is_the_bound_value_and_never_the_token_before_its_query() {
        let task = Recall::new(8, 64).unwrap();
        let mut rng = Rng::new(11);
        for _ in 0..500 {
            let example = task.sample(&mut rng);
            let input = &example.decoder_input;
            let mut queried = Vec::new();
            for (position, &target) in example.target.iter().enumerate() {
                if target == IGNORE {
                    continue;
                }
                let key = input[position];
                let bound = (0..16)
                    .step_by(2)
                    .find(|&i| input[i] == key)
                    .map(|i| input[i + 1] as i64);
                assert_eq!(bound, Some(target), "query {key} at {position}");
                // The token before a query is the value of another key's pair.
                assert_ne!(input[position - 2], key, "answer right before its query");
                queried.push(key);
            }
            queried.sort_unstable();
            queried.dedup();
            assert_eq!(queried.len(), 8, "every key queried once");
        }
    }
}
