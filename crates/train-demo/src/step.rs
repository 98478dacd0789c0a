//! What burn-train's `Learner` calls: a training step (forward, masked loss, backward) and a
//! held-out step (loss under teacher forcing, predictions by greedy generation for generative
//! tasks), their output, and the metrics read from it: token accuracy and exact match.

use std::sync::Arc;

use burn::tensor::ExecutionError;
use burn::tensor::{Int, Tensor, TensorReadError};
use burn::train::metric::state::{FormatOptions, NumericMetricState};
use burn::train::metric::{
    Adaptor, LossInput, Metric, MetricAttributes, MetricMetadata, MetricName, Numeric,
    NumericAttributes, NumericEntry, SerializedEntry,
};
use burn::train::{InferenceStep, ItemLazy, TrainOutput, TrainStep};

use crate::data::{Batch, Counts, masked_cross_entropy, predict, scored_positions};
use crate::model::Transformer;
use crate::tasks::Example;

/// One step's loss and how its predictions scored.
pub struct TaskOutput {
    /// `[1]`, the mean over scored positions.
    pub loss: Tensor<1>,
    predictions: Predictions,
}

enum Predictions {
    /// Teacher forcing: the argmax per position `[batch, seq]`, until the item is synced.
    Argmax {
        argmax: Box<Tensor<2, Int>>,
        examples: Arc<Vec<Example>>,
    },
    /// Scored (held-out steps generate token by token, reading as they go).
    Scored(Counts),
}

impl ItemLazy for TaskOutput {
    /// Reads and scores the argmax: burn-train syncs items on its metrics thread, so the
    /// training loop never waits for this read.
    fn sync(self) -> Result<Self, ExecutionError> {
        let loss = self.loss.without_autodiff();
        let counts = match self.predictions {
            Predictions::Scored(counts) => counts,
            Predictions::Argmax { argmax, examples } => {
                let seq = argmax.dims()[1];
                let flat: Vec<i64> = argmax
                    .try_into_data()?
                    .convert::<i64>()
                    .try_to_vec::<i64>()
                    .expect("integer predictions");
                Counts::of(&examples, &scored_positions(&examples, &flat, seq))
            }
        };
        Ok(Self {
            loss,
            predictions: Predictions::Scored(counts),
        })
    }
}

impl Adaptor<LossInput> for TaskOutput {
    fn adapt(&self) -> LossInput {
        LossInput::new(self.loss.clone())
    }
}

/// What the accuracy metrics read: the counts of a synced item (`None` before the sync).
pub struct CountsInput(Option<Counts>);

impl Adaptor<CountsInput> for TaskOutput {
    fn adapt(&self) -> CountsInput {
        match &self.predictions {
            Predictions::Scored(counts) => CountsInput(Some(*counts)),
            Predictions::Argmax { .. } => CountsInput(None),
        }
    }
}

impl TrainStep for Transformer {
    type Input = Batch;
    type Output = TaskOutput;

    fn step(&self, batch: Batch) -> TrainOutput<TaskOutput> {
        let logits = batch.logits(self);
        let loss = masked_cross_entropy(logits.clone(), &batch.targets);
        let grads = loss.backward();
        let argmax = logits.detach().argmax(2).squeeze_dim::<2>(2);
        let output = TaskOutput {
            loss,
            predictions: Predictions::Argmax {
                argmax: Box::new(argmax),
                examples: Arc::new(batch.examples),
            },
        };
        TrainOutput::new(self, grads, output)
    }
}

impl InferenceStep for Transformer {
    type Input = Batch;
    type Output = TaskOutput;

    fn step(&self, batch: Batch) -> TaskOutput {
        let loss = masked_cross_entropy(batch.logits(self), &batch.targets);
        let device = loss.device();
        let predictions = predict(self, batch.scoring, &batch.examples, &device);
        TaskOutput {
            loss,
            predictions: Predictions::Scored(Counts::of(&batch.examples, &predictions)),
        }
    }
}

/// Which fraction a [`CountsMetric`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fraction {
    /// Scored tokens predicted right.
    Tokens,
    /// Examples with every scored token right.
    Exact,
}

/// Token accuracy or exact match, in percent, over the scored positions only (the
/// [`IGNORE`](crate::tasks::IGNORE) ones count for neither).
#[derive(Clone)]
pub struct CountsMetric {
    fraction: Fraction,
    name: MetricName,
    state: NumericMetricState,
}

/// The name the exact-match metric is logged under (early stopping reads it).
pub const EXACT_MATCH: &str = "Exact Match";

impl CountsMetric {
    pub fn token_accuracy() -> Self {
        Self::new(Fraction::Tokens, "Token Accuracy")
    }

    pub fn exact_match() -> Self {
        Self::new(Fraction::Exact, EXACT_MATCH)
    }

    fn new(fraction: Fraction, name: &str) -> Self {
        Self {
            fraction,
            name: Arc::new(name.to_string()),
            state: NumericMetricState::new(),
        }
    }

    fn format(&self) -> FormatOptions {
        FormatOptions::new(self.name()).unit("%").precision(2)
    }
}

impl Metric for CountsMetric {
    type Input = CountsInput;

    fn update(
        &mut self,
        input: &CountsInput,
        _metadata: &MetricMetadata,
    ) -> Result<SerializedEntry, TensorReadError> {
        let counts = input
            .0
            .expect("burn-train syncs an item before its metrics read it");
        let (right, total) = match self.fraction {
            Fraction::Tokens => (counts.right_tokens, counts.tokens),
            Fraction::Exact => (counts.exact, counts.examples),
        };
        self.state
            .update(100.0 * right as f64 / total.max(1) as f64, total);
        Ok(self.state.compute_update(self.format()))
    }

    fn compute(&mut self) -> Result<SerializedEntry, TensorReadError> {
        Ok(self.state.compute_final(self.format()))
    }

    fn clear(&mut self) {
        self.state.reset();
    }

    fn name(&self) -> MetricName {
        self.name.clone()
    }

    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: Some("%".to_string()),
            higher_is_better: true,
        }
        .into()
    }
}

impl Numeric for CountsMetric {
    fn value(&self) -> Option<NumericEntry> {
        Some(self.state.current_value())
    }

    fn running_value(&self) -> Option<NumericEntry> {
        Some(self.state.running_value())
    }

    fn final_value(&self) -> NumericEntry {
        self.state.final_value()
    }
}
