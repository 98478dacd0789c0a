//! What burn-train shows while training, and what the demo keeps of it.
//!
//! [`Recorder`] sits between burn-train and the renderer the user sees: Burn's terminal
//! dashboard where stdout is a terminal, one plain line per epoch where it is not (a log file,
//! CI). It keeps every training step's loss and learning rate and every epoch's held-out
//! metrics, writes them to `metrics.csv` at the end of each epoch, and hands them back for the
//! curves.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use burn::train::Interrupter;
use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
use burn::train::metric::{MetricDefinition, MetricId, NumericEntry};
use burn::train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, default_renderer,
};

use crate::report::{MetricsRow, write_metrics};
use crate::step::EXACT_MATCH;

const LOSS: &str = "Loss";
const LEARNING_RATE: &str = "Learning Rate";
const TOKEN_ACCURACY: &str = "Token Accuracy";

/// The rows of a run, shared between the recorder (on burn-train's metrics thread) and the
/// training code that plots them afterwards.
pub type History = Arc<Mutex<Vec<MetricsRow>>>;

/// Which split burn-train is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum SplitKind {
    Train,
    Valid,
}

/// A weighted mean, over the batches of a split.
#[derive(Debug, Clone, Copy, Default)]
struct Mean {
    sum: f64,
    weight: f64,
}

impl Mean {
    fn add(&mut self, entry: &NumericEntry) {
        let (value, weight) = match entry {
            NumericEntry::Value(value) | NumericEntry::Final(value) => (*value, 1.0),
            NumericEntry::Aggregated {
                aggregated_value,
                count,
            } => (*aggregated_value, *count as f64),
        };
        if value.is_finite() && weight > 0.0 {
            self.sum += value * weight;
            self.weight += weight;
        }
    }

    fn value(&self) -> Option<f64> {
        (self.weight > 0.0).then(|| self.sum / self.weight)
    }
}

/// Records the metrics and forwards every event to the renderer the user sees.
pub struct Recorder {
    inner: Box<dyn MetricsRenderer>,
    /// Print one line per epoch (where the dashboard is not shown, unless quiet).
    epoch_lines: bool,
    names: HashMap<MetricId, String>,
    history: History,
    metrics_csv: PathBuf,
    split: SplitKind,
    /// The last learning rate seen (burn-train reports it before the loss of the same step).
    learning_rate: f64,
    /// This epoch's means: train loss; held-out loss, token accuracy and exact match.
    epoch: HashMap<(SplitKind, &'static str), Mean>,
    epoch_number: usize,
    total_epochs: usize,
}

impl Recorder {
    /// `history` holds the rows kept from before a resume. `quiet`: no output at all.
    pub fn new(
        history: History,
        metrics_csv: PathBuf,
        interrupter: Interrupter,
        resumed_epoch: Option<usize>,
        quiet: bool,
    ) -> Self {
        let dashboard = !quiet && std::io::stdout().is_terminal();
        let inner: Box<dyn MetricsRenderer> = if dashboard {
            default_renderer(interrupter, resumed_epoch)
        } else {
            Box::new(Silent)
        };
        Self {
            inner,
            epoch_lines: !dashboard && !quiet,
            names: HashMap::new(),
            history,
            metrics_csv,
            split: SplitKind::Train,
            learning_rate: f64::NAN,
            epoch: HashMap::new(),
            epoch_number: resumed_epoch.unwrap_or(0) + 1,
            total_epochs: 0,
        }
    }

    fn record(&mut self, split: SplitKind, state: &MetricState) {
        let MetricState::Numeric(entry, Some(value)) = state else {
            return;
        };
        // Each epoch ends with a summary entry of every metric: not a step of its own.
        if matches!(value, NumericEntry::Final(_)) {
            return;
        }
        let Some(name) = self.names.get(&entry.metric_id).map(String::as_str) else {
            return;
        };
        let key: &'static str = match name {
            LOSS => LOSS,
            TOKEN_ACCURACY => TOKEN_ACCURACY,
            EXACT_MATCH => EXACT_MATCH,
            LEARNING_RATE => {
                self.learning_rate = value.current();
                return;
            }
            _ => return,
        };
        self.epoch.entry((split, key)).or_default().add(value);
        if split == SplitKind::Train && key == LOSS {
            let mut history = self.history.lock().expect("the history lock");
            let step = history.last().map_or(0, |row| row.step) + 1;
            history.push(MetricsRow {
                step,
                loss: value.current(),
                lr: self.learning_rate,
                eval_loss: None,
                token_accuracy: None,
                exact_accuracy: None,
            });
        }
    }

    /// Puts the epoch's held-out metrics on its last row, saves the rows, prints the line.
    fn end_valid(&mut self) {
        let mean = |epoch: &HashMap<_, Mean>, key| epoch.get(&key).and_then(Mean::value);
        let eval_loss = mean(&self.epoch, (SplitKind::Valid, LOSS));
        let token = mean(&self.epoch, (SplitKind::Valid, TOKEN_ACCURACY)).map(|v| v / 100.0);
        let exact = mean(&self.epoch, (SplitKind::Valid, EXACT_MATCH)).map(|v| v / 100.0);
        let rows = {
            let mut history = self.history.lock().expect("the history lock");
            if let Some(last) = history.last_mut() {
                last.eval_loss = eval_loss;
                last.token_accuracy = token;
                last.exact_accuracy = exact;
            }
            history.clone()
        };
        if let Err(error) = write_metrics(&self.metrics_csv, &rows) {
            eprintln!("{}: {error}", self.metrics_csv.display());
        }
        let line = format!(
            "epoch {}/{} | train loss {:.4} | held-out loss {:.4}, token accuracy {:.1}%, exact \
             match {:.1}% | lr {:.2e}",
            self.epoch_number,
            self.total_epochs,
            mean(&self.epoch, (SplitKind::Train, LOSS)).unwrap_or(f64::NAN),
            eval_loss.unwrap_or(f64::NAN),
            100.0 * token.unwrap_or(f64::NAN),
            100.0 * exact.unwrap_or(f64::NAN),
            self.learning_rate
        );
        if self.epoch_lines {
            println!("{line}");
        }
        self.epoch.clear();
    }
}

/// The renderer under the recorder where stdout is not a terminal: the recorder prints the
/// epoch lines itself, and burn-train's per-step events are not printed.
struct Silent;

impl MetricsRendererTraining for Silent {
    fn update_train(&mut self, _: MetricState) {}
    fn update_valid(&mut self, _: MetricState) {}
}

impl MetricsRendererEvaluation for Silent {
    fn update_test(&mut self, _: EvaluationName, _: MetricState) {}
}

impl TrainingProgressLogger for Silent {
    fn start(&mut self, _: usize, _: usize, _: Option<usize>, _: Option<&str>) {}
    fn update_epoch(&mut self, _: usize) {}
    fn start_split(&mut self, _: &str, _: usize) {}
    fn update_split(&mut self, _: usize) {}
    fn end_split(&mut self) {}
    fn end(&mut self) {}
    fn log_event_training(&mut self, _: String) {}
}

impl EvaluationProgressLogger for Silent {
    fn start_global_progress(&mut self, _: usize) {}
    fn start_test(&mut self, _: &str, _: usize) {}
    fn update_test_progress(&mut self, _: usize) {}
    fn end_test(&mut self) {}
    fn end_global_progress(&mut self) {}
    fn log_event_evaluation(&mut self, _: String) {}
}

impl MetricsRenderer for Silent {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _: MetricDefinition) {}
}

impl MetricsRendererTraining for Recorder {
    fn update_train(&mut self, state: MetricState) {
        self.record(SplitKind::Train, &state);
        self.inner.update_train(state);
    }

    fn update_valid(&mut self, state: MetricState) {
        self.record(SplitKind::Valid, &state);
        self.inner.update_valid(state);
    }

    fn on_train_end(
        &mut self,
        summary: Option<burn::train::LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        self.inner.on_train_end(summary)
    }
}

impl MetricsRendererEvaluation for Recorder {
    fn update_test(&mut self, name: EvaluationName, state: MetricState) {
        self.inner.update_test(name, state);
    }
}

impl TrainingProgressLogger for Recorder {
    fn start(
        &mut self,
        total_epochs: usize,
        starting_epoch: usize,
        total_items: Option<usize>,
        label: Option<&str>,
    ) {
        self.total_epochs = total_epochs;
        if self.epoch_lines {
            println!("training: epochs {starting_epoch} to {total_epochs}");
        }
        self.inner
            .start(total_epochs, starting_epoch, total_items, label);
    }

    fn update_epoch(&mut self, epoch: usize) {
        self.inner.update_epoch(epoch);
    }

    fn start_split(&mut self, split: &str, total_items: usize) {
        self.split = if split == "valid" {
            SplitKind::Valid
        } else {
            SplitKind::Train
        };
        self.inner.start_split(split, total_items);
    }

    fn update_split(&mut self, items_processed: usize) {
        self.inner.update_split(items_processed);
    }

    fn end_split(&mut self) {
        if self.split == SplitKind::Valid {
            self.end_valid();
            self.epoch_number += 1;
        }
        self.inner.end_split();
    }

    fn end(&mut self) {
        self.inner.end();
    }

    fn log_event_training(&mut self, event: String) {
        self.inner.log_event_training(event);
    }
}

impl EvaluationProgressLogger for Recorder {
    fn start_global_progress(&mut self, total_tests: usize) {
        self.inner.start_global_progress(total_tests);
    }
    fn start_test(&mut self, name: &str, total_items: usize) {
        self.inner.start_test(name, total_items);
    }
    fn update_test_progress(&mut self, items_processed: usize) {
        self.inner.update_test_progress(items_processed);
    }
    fn end_test(&mut self) {
        self.inner.end_test();
    }
    fn end_global_progress(&mut self) {
        self.inner.end_global_progress();
    }
    fn log_event_evaluation(&mut self, event: String) {
        self.inner.log_event_evaluation(event);
    }
}

impl MetricsRenderer for Recorder {
    fn manual_close(&mut self) {
        self.inner.manual_close();
    }

    fn register_metric(&mut self, definition: MetricDefinition) {
        self.names
            .insert(definition.metric_id.clone(), definition.name.to_string());
        self.inner.register_metric(definition);
    }
}
