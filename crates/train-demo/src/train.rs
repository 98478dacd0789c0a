//! The training loop: autodiff, AdamW with warm-up and cosine decay, gradient clipping,
//! periodic held-out evaluation, checkpoints, Ctrl-C.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use burn::module::Module;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer};
use burn::tensor::Device;
use indicatif::{ProgressBar, ProgressStyle};

use crate::checkpoint::{self, RunIdentity, RunState};
use crate::data::{Accuracy, Batch, accuracy, attention_maps, masked_cross_entropy, predict};
use crate::model::Transformer;
use crate::report::{MetricsRow, plot_attention, plot_curves, read_metrics, write_metrics};
use crate::rng::Rng;
use crate::tasks::{Example, Task, TaskKind};

/// Everything a training run needs to know.
pub struct TrainSettings {
    pub identity: RunIdentity,
    pub device: Device,
    pub out: PathBuf,
    pub resume: bool,
    /// Stop (saving a checkpoint, as on Ctrl-C) after this many steps in this process.
    pub stop_after: Option<usize>,
    pub eval_every: usize,
    pub eval_examples: usize,
    pub quiet: bool,
}

/// What a run reports at its end.
#[derive(Debug, Clone)]
pub struct Summary {
    pub task: TaskKind,
    pub steps: usize,
    pub final_loss: f64,
    pub accuracy: Accuracy,
    pub chance: f64,
    pub seconds: f64,
    pub interrupted: bool,
}

/// The held-out examples: another generator than the training data's.
pub fn held_out(task: &dyn Task, seed: u64, count: usize) -> Vec<Example> {
    let mut rng = Rng::new(seed ^ 0x005E_ED0F_E7A1_u64);
    (0..count).map(|_| task.sample(&mut rng)).collect()
}

fn learning_rate(base: f64, step: usize, steps: usize) -> f64 {
    let warmup = (steps / 10).clamp(1, 100);
    if step < warmup {
        return base * (step + 1) as f64 / warmup as f64;
    }
    let progress = (step - warmup) as f64 / (steps - warmup).max(1) as f64;
    base * (0.05 + 0.95 * 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos()))
}

fn optimizer() -> ModuleOptimizer {
    AdamWConfig::new()
        .with_weight_decay(0.01)
        .with_grad_clipping(Some(GradientClippingConfig::Norm(1.0)))
        .init()
}

/// Trains (or resumes) a run; writes everything into `settings.out`.
pub fn train(settings: TrainSettings, interrupted: Arc<AtomicBool>) -> Result<Summary, String> {
    let identity = settings.identity.clone();
    let task = identity
        .task
        .build(identity.seq_len, identity.model.vocab)?;
    let device = settings.device.clone().autodiff();
    std::fs::create_dir_all(&settings.out)
        .map_err(|e| format!("{}: {e}", settings.out.display()))?;
    device.seed(identity.seed);

    let model = identity.model.init(&device);
    let (mut model, mut optimizer, mut state, mut rows) = if settings.resume {
        let state = checkpoint::load_state(&settings.out)?;
        let differences = checkpoint::differences(&state.identity, &identity);
        if !differences.is_empty() {
            return Err(format!(
                "the checkpoint in {} belongs to another run, refusing to resume (nothing was \
                 overwritten):\n  {}",
                settings.out.display(),
                differences.join("\n  ")
            ));
        }
        let (model, optimizer) = checkpoint::load(&settings.out, model, optimizer())?;
        let rows: Vec<MetricsRow> = read_metrics(&settings.out.join("metrics.csv"))
            .into_iter()
            .filter(|row| row.step <= state.step)
            .collect();
        (model, optimizer, state, rows)
    } else {
        let state = RunState {
            identity: identity.clone(),
            step: 0,
            data_rng: Rng::new(identity.seed),
        };
        (model, optimizer(), state, Vec::new())
    };
    std::fs::write(
        settings.out.join("config.json"),
        serde_json::to_string_pretty(&identity).expect("serializes"),
    )
    .map_err(|e| format!("config.json: {e}"))?;

    let eval_set = held_out(task.as_ref(), identity.seed, settings.eval_examples);
    let progress = if settings.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(identity.steps as u64)
    };
    progress.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .expect("valid template"),
    );
    progress.set_position(state.step as u64);

    let started = Instant::now();
    let started_step = state.step;
    let mut tokens_seen = 0usize;
    let mut last_eval = Accuracy::default();
    let mut last_loss = f64::NAN;
    let mut stopped = false;
    while state.step < identity.steps {
        if interrupted.load(Ordering::SeqCst)
            || settings
                .stop_after
                .is_some_and(|n| state.step - started_step >= n)
        {
            stopped = true;
            break;
        }
        let examples: Vec<Example> = (0..identity.batch_size)
            .map(|_| task.sample(&mut state.data_rng))
            .collect();
        let batch = Batch::new(&examples, &device);
        tokens_seen += batch.batch * batch.seq;
        let loss = masked_cross_entropy(batch.logits(&model), &batch.targets);
        let loss_value = loss.clone().into_scalar::<f64>();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let lr = learning_rate(identity.lr, state.step, identity.steps);
        model = optimizer.step(lr, model, grads);
        state.step += 1;
        last_loss = loss_value;

        let evaluate = state.step % settings.eval_every == 0 || state.step == identity.steps;
        let (token_accuracy, exact_accuracy) = if evaluate {
            last_eval = accuracy(
                &model.valid(),
                task.as_ref(),
                &eval_set,
                &device.clone().inner(),
            );
            (Some(last_eval.token), Some(last_eval.exact))
        } else {
            (None, None)
        };
        rows.push(MetricsRow {
            step: state.step,
            loss: loss_value,
            lr,
            token_accuracy,
            exact_accuracy,
        });
        let rate = tokens_seen as f64 / started.elapsed().as_secs_f64().max(1e-9);
        progress.set_position(state.step as u64);
        progress.set_message(format!(
            "loss {loss_value:.4} | eval acc {:.1}% exact {:.1}% | lr {lr:.2e} | {rate:.0} tok/s",
            100.0 * last_eval.token,
            100.0 * last_eval.exact
        ));
    }
    progress.finish_and_clear();

    checkpoint::save(&settings.out, &state, &model, &optimizer)?;
    write_metrics(&settings.out.join("metrics.csv"), &rows)
        .map_err(|e| format!("metrics.csv: {e}"))?;
    let seconds = started.elapsed().as_secs_f64();
    if stopped {
        return Ok(Summary {
            task: identity.task,
            steps: state.step,
            final_loss: last_loss,
            accuracy: last_eval,
            chance: task.chance_token_accuracy(),
            seconds,
            interrupted: true,
        });
    }

    let valid = model.valid();
    let inner = device.inner();
    let final_accuracy = accuracy(&valid, task.as_ref(), &eval_set, &inner);
    plot_curves(&settings.out.join("curves.png"), &rows, &task.describe())?;
    write_predictions(
        &settings.out.join("predictions.txt"),
        &valid,
        task.as_ref(),
        &eval_set[..8],
        &inner,
    )?;
    for (index, (label, weights)) in attention_maps(&valid, &eval_set[0], &inner)
        .into_iter()
        .enumerate()
    {
        let file = format!("attention-{index}-{}.png", label.replace(' ', "-"));
        plot_attention(&settings.out.join(file), &label, weights)?;
    }
    Ok(Summary {
        task: identity.task,
        steps: state.step,
        final_loss: last_loss,
        accuracy: final_accuracy,
        chance: task.chance_token_accuracy(),
        seconds,
        interrupted: false,
    })
}

/// A few held-out examples with the model's predictions, one per line.
pub fn format_predictions(
    model: &Transformer,
    task: &dyn Task,
    examples: &[Example],
    device: &Device,
) -> String {
    let predictions = predict(model, task, examples, device);
    let mut text = String::new();
    for (example, predicted) in examples.iter().zip(predictions) {
        let input = if example.source.is_empty() {
            &example.decoder_input
        } else {
            &example.source
        };
        let expected: Vec<i64> = example.target.iter().copied().filter(|&t| t >= 0).collect();
        let mark = if expected == predicted { "ok " } else { "BAD" };
        text.push_str(&format!(
            "{mark} input {input:?}\n    expected  {expected:?}\n    predicted {predicted:?}\n"
        ));
    }
    text
}

fn write_predictions(
    path: &std::path::Path,
    model: &Transformer,
    task: &dyn Task,
    examples: &[Example],
    device: &Device,
) -> Result<(), String> {
    std::fs::write(path, format_predictions(model, task, examples, device))
        .map_err(|e| format!("{}: {e}", path.display()))
}
