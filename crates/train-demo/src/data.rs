//! Batches of examples as tensors, the masked loss, and accuracy by teacher forcing or greedy
//! generation.

use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};

use crate::model::{LayerWeights, Transformer};
use crate::tasks::{Architecture, Example, IGNORE, Task};

/// How a task's outputs are scored: what [`predict`] needs to know of the task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scoring {
    pub architecture: Architecture,
    /// For generative tasks, the tokens generated after the prompt ([`Task::generate_len`]).
    pub generate_len: Option<usize>,
}

impl Scoring {
    pub fn of(task: &dyn Task) -> Self {
        Self {
            architecture: task.architecture(),
            generate_len: task.generate_len(),
        }
    }
}

/// A batch as the model reads it, with its examples (the held-out step generates from their
/// prompts).
pub struct Batch {
    pub source: Option<Tensor<2, Int>>,
    pub decoder_input: Option<Tensor<2, Int>>,
    /// `[batch · seq]`, [`IGNORE`] where unscored.
    pub targets: Vec<i64>,
    pub seq: usize,
    pub examples: Vec<Example>,
    pub scoring: Scoring,
}

fn tokens(rows: &[&Vec<usize>], device: &Device) -> Option<Tensor<2, Int>> {
    let length = rows.first()?.len();
    if length == 0 {
        return None;
    }
    let flat: Vec<i64> = rows
        .iter()
        .flat_map(|row| row.iter().map(|&t| t as i64))
        .collect();
    Some(Tensor::from_data(
        TensorData::new(flat, [rows.len(), length]),
        device,
    ))
}

impl Batch {
    pub fn new(examples: &[Example], scoring: Scoring, device: &Device) -> Self {
        let sources: Vec<&Vec<usize>> = examples.iter().map(|e| &e.source).collect();
        let inputs: Vec<&Vec<usize>> = examples.iter().map(|e| &e.decoder_input).collect();
        let targets: Vec<i64> = examples
            .iter()
            .flat_map(|e| e.target.iter().copied())
            .collect();
        let seq = examples[0].target.len();
        Self {
            source: tokens(&sources, device),
            decoder_input: tokens(&inputs, device),
            targets,
            seq,
            examples: examples.to_vec(),
            scoring,
        }
    }

    pub fn logits(&self, model: &Transformer) -> Tensor<3> {
        model.forward(self.source.clone(), self.decoder_input.clone(), &mut None)
    }
}

/// Mean cross-entropy over the scored positions.
pub fn masked_cross_entropy(logits: Tensor<3>, targets: &[i64]) -> Tensor<1> {
    let device = logits.device();
    let [batch, seq, vocab] = logits.dims();
    let log_probs = log_softmax(logits.reshape([batch * seq, vocab]), 1);
    let indices: Vec<i64> = targets.iter().map(|&t| t.max(0)).collect();
    let indices = Tensor::<2, Int>::from_data(TensorData::new(indices, [batch * seq, 1]), &device);
    let weights: Vec<f32> = targets.iter().map(|&t| f32::from(t != IGNORE)).collect();
    let count = weights.iter().sum::<f32>().max(1.0);
    let weights = Tensor::<1>::from_data(TensorData::new(weights, [batch * seq]), &device);
    let picked = log_probs.gather(1, indices).reshape([batch * seq]);
    (picked * weights).sum().neg().div_scalar(count)
}

/// Accuracy over held-out examples.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Accuracy {
    /// Scored tokens predicted right.
    pub token: f64,
    /// Examples with every scored token right.
    pub exact: f64,
}

/// Predictions for the scored positions of each example, `[examples][scored positions]`:
/// argmax under teacher forcing, or greedy generation for generative tasks.
pub fn predict(
    model: &Transformer,
    scoring: Scoring,
    examples: &[Example],
    device: &Device,
) -> Vec<Vec<i64>> {
    match scoring.generate_len {
        None => {
            let batch = Batch::new(examples, scoring, device);
            scored_positions(examples, &argmax_last(batch.logits(model)), batch.seq)
        }
        Some(length) => generate(model, scoring.architecture, examples, length, device),
    }
}

/// Each example's predictions at its scored positions, from `flat`: one prediction per
/// position, row-major `[examples, seq]`.
pub fn scored_positions(examples: &[Example], flat: &[i64], seq: usize) -> Vec<Vec<i64>> {
    examples
        .iter()
        .enumerate()
        .map(|(row, example)| {
            example
                .target
                .iter()
                .enumerate()
                .filter(|(_, t)| **t != IGNORE)
                .map(|(column, _)| flat[row * seq + column])
                .collect()
        })
        .collect()
}

/// `[batch, seq, vocab]` → argmax per position, row-major.
fn argmax_last(logits: Tensor<3>) -> Vec<i64> {
    logits
        .argmax(2)
        .into_data()
        .convert::<i64>()
        .try_into_vec_as::<i64>()
        .expect("integer predictions")
}

/// Greedy decoding with the model's KV caches: the prompt is the decoder input up to the
/// first scored position, then one new token per step.
fn generate(
    model: &Transformer,
    architecture: Architecture,
    examples: &[Example],
    length: usize,
    device: &Device,
) -> Vec<Vec<i64>> {
    let first_scored = examples[0]
        .target
        .iter()
        .position(|&t| t != IGNORE)
        .unwrap_or(0);
    let prompts: Vec<Vec<usize>> = examples
        .iter()
        .map(|e| e.decoder_input[..=first_scored].to_vec())
        .collect();
    let source = match architecture {
        Architecture::EncoderDecoder => {
            let rows: Vec<&Vec<usize>> = examples.iter().map(|e| &e.source).collect();
            tokens(&rows, device)
        }
        _ => None,
    };
    let mut state = model.start_decoding(source);
    let rows: Vec<&Vec<usize>> = prompts.iter().collect();
    let mut logits = model.decode_step(tokens(&rows, device).expect("a prompt"), &mut state);
    let mut generated = vec![Vec::with_capacity(length); examples.len()];
    for step in 0..length {
        let next: Vec<i64> = logits
            .clone()
            .argmax(1)
            .into_data()
            .convert::<i64>()
            .try_into_vec_as::<i64>()
            .expect("integer predictions");
        for (row, &token) in next.iter().enumerate() {
            generated[row].push(token);
        }
        if step + 1 < length {
            let batch = next.len();
            let input = Tensor::<2, Int>::from_data(TensorData::new(next, [batch, 1]), device);
            logits = model.decode_step(input, &mut state);
        }
    }
    generated
}

pub fn accuracy(
    model: &Transformer,
    task: &dyn Task,
    examples: &[Example],
    device: &Device,
) -> Accuracy {
    let mut counts = Counts::default();
    for chunk in examples.chunks(256) {
        let predictions = predict(model, Scoring::of(task), chunk, device);
        counts.add(&Counts::of(chunk, &predictions));
    }
    counts.accuracy()
}

/// Scored tokens and examples, and how many of each were predicted right.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub tokens: usize,
    pub right_tokens: usize,
    pub examples: usize,
    pub exact: usize,
}

impl Counts {
    /// Scores `predictions` (per example, its scored positions) against the examples' targets.
    pub fn of(examples: &[Example], predictions: &[Vec<i64>]) -> Self {
        let mut counts = Self::default();
        for (example, predicted) in examples.iter().zip(predictions) {
            let expected = example.target.iter().copied().filter(|&t| t != IGNORE);
            let scored = expected.clone().count();
            let right = expected.zip(predicted).filter(|(a, b)| a == *b).count();
            counts.tokens += scored;
            counts.right_tokens += right;
            counts.examples += 1;
            counts.exact += usize::from(right == scored);
        }
        counts
    }

    pub fn add(&mut self, other: &Self) {
        self.tokens += other.tokens;
        self.right_tokens += other.right_tokens;
        self.examples += other.examples;
        self.exact += other.exact;
    }

    pub fn accuracy(&self) -> Accuracy {
        Accuracy {
            token: self.right_tokens as f64 / self.tokens.max(1) as f64,
            exact: self.exact as f64 / self.examples.max(1) as f64,
        }
    }
}

/// Per-head attention weights of every layer on one example.
pub fn attention_maps(model: &Transformer, example: &Example, device: &Device) -> LayerWeights {
    let scoring = Scoring {
        architecture: Architecture::Encoder,
        generate_len: None,
    };
    let batch = Batch::new(std::slice::from_ref(example), scoring, device);
    let mut weights = Some(Vec::new());
    model.forward(
        batch.source.clone(),
        batch.decoder_input.clone(),
        &mut weights,
    );
    weights.unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::TransformerConfig;
    use crate::rng::Rng;
    use crate::tasks::TaskKind;

    #[test]
    fn cached_decoding_gives_the_full_forward_logits() {
        let _seeded = crate::seeded_rng_lock();
        let device = Device::flex();
        device.seed(4);
        for (kind, rotary, token_shift) in [
            (TaskKind::Sort, false, false),
            (TaskKind::Copy, false, false),
            (TaskKind::Sort, true, false),
            (TaskKind::Copy, true, true),
            (TaskKind::Recall, false, true),
        ] {
            let defaults = kind.defaults();
            let task = kind.build(defaults.seq_len, defaults.vocab).unwrap();
            let config = TransformerConfig {
                architecture: task.architecture(),
                vocab: task.vocab(),
                max_len: task.max_len(),
                d_model: 32,
                heads: 4,
                kv_heads: 2,
                layers: 2,
                no_attention: false,
                rotary,
                token_shift,
                feed_forward: true,
            };
            let model = config.init(&device);
            let mut rng = Rng::new(9);
            let examples: Vec<Example> = (0..3).map(|_| task.sample(&mut rng)).collect();
            assert!(
                examples.windows(2).all(|pair| pair[0] != pair[1]),
                "{kind:?}: three different examples"
            );
            let batch = Batch::new(&examples, Scoring::of(task.as_ref()), &device);
            let full = batch.logits(&model);
            let [_, seq, vocab] = full.dims();
            let mut state = model.start_decoding(batch.source.clone());
            let decoder_input = batch.decoder_input.clone().unwrap();
            for (start, length) in [(0, 2), (2, 1), (3, seq - 3)] {
                let step =
                    model.decode_step(decoder_input.clone().narrow(1, start, length), &mut state);
                let expected = full
                    .clone()
                    .narrow(1, start + length - 1, 1)
                    .reshape([3, vocab]);
                let diff = (step - expected).abs().max().into_scalar::<f32>();
                assert!(
                    diff < 1e-4,
                    "{kind:?} rotary {rotary} token shift {token_shift} step at {start}: {diff}"
                );
            }
        }
    }
}
