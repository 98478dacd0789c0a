//! Trains small Transformers built from `mha::MultiHeadAttention` on toy sequence tasks that
//! only attention across positions can solve, on any Burn backend compiled in.
//!
//! ```sh
//! cargo run --release -p train-demo                       # reverse, on flex
//! cargo run --release -p train-demo -- --task sort --no-attention
//! cargo run --release -p train-demo -- eval --out runs/reverse-…
//! ```

mod checkpoint;
mod data;
mod device;
mod model;
mod report;
mod rng;
mod tasks;
mod train;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::{Args, Parser, Subcommand};

use crate::checkpoint::RunIdentity;
use crate::model::TransformerConfig;
use crate::tasks::TaskKind;

/// Serialises the tests that seed a device: Burn's seeded generator is shared by every test
/// thread, so a test that draws between another's `seed` and its `init` breaks reproducibility.
#[cfg(test)]
pub(crate) fn seeded_rng_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[derive(Parser, Debug)]
#[command(version, about, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    train: TrainArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train (the default when no command is given).
    Train(TrainArgs),
    /// Evaluate a run's checkpoint on its held-out examples.
    Eval(RunArgs),
    /// Print a run's predictions on a few held-out examples.
    Predict {
        #[command(flatten)]
        run: RunArgs,
        /// How many examples.
        #[arg(long, default_value_t = 5)]
        count: usize,
    },
}

#[derive(Args, Debug, Clone)]
struct RunArgs {
    /// The run's folder (holding config.json and checkpoint/).
    #[arg(long)]
    out: PathBuf,
    /// Device to evaluate on.
    #[arg(long, default_value = "flex")]
    device: String,
    /// Held-out examples.
    #[arg(long, default_value_t = 512)]
    eval_examples: usize,
}

#[derive(Args, Debug, Clone)]
struct TrainArgs {
    /// The toy task.
    #[arg(long, value_enum, default_value_t = TaskKind::Reverse)]
    task: TaskKind,
    /// Backend: any compiled in (flex by default; see --help of the features).
    #[arg(long, default_value = "flex")]
    device: String,
    /// Optimizer steps (default: the task's).
    #[arg(long)]
    steps: Option<usize>,
    #[arg(long)]
    batch_size: Option<usize>,
    /// Peak learning rate (default: the task's).
    #[arg(long)]
    lr: Option<f64>,
    #[arg(long)]
    d_model: Option<usize>,
    /// Query heads.
    #[arg(long)]
    heads: Option<usize>,
    /// Key/value heads (fewer than --heads: grouped-query attention).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Layers per stack.
    #[arg(long)]
    layers: Option<usize>,
    /// Sequence length (for recall: key-value pairs).
    #[arg(long)]
    seq_len: Option<usize>,
    #[arg(long)]
    vocab: Option<usize>,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Output folder (default runs/TASK-TIMESTAMP).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Continue the run in --out from its checkpoint.
    #[arg(long, requires = "out")]
    resume: bool,
    /// Ablation: replace every attention output with zeros.
    #[arg(long)]
    no_attention: bool,
    /// Rotary positions (true) or learned position embeddings (false); default: the task's.
    #[arg(long)]
    rotary: Option<bool>,
    /// Add a previous-token embedding to each position (true/false); default: the task's
    /// (true for recall only).
    #[arg(long)]
    token_shift: Option<bool>,
    /// Evaluate on held-out examples every N steps.
    #[arg(long, default_value_t = 100)]
    eval_every: usize,
    #[arg(long, default_value_t = 512)]
    eval_examples: usize,
    /// Stop after N steps in this process, saving a checkpoint as Ctrl-C does.
    #[arg(long)]
    stop_after: Option<usize>,
    /// Save a checkpoint every N steps (0: only at the end and on Ctrl-C), so that a crash
    /// loses at most N steps; `--resume` continues from the latest.
    #[arg(long, default_value_t = 250)]
    checkpoint_every: usize,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        None => run_training(cli.train),
        Some(Command::Train(args)) => run_training(args),
        Some(Command::Eval(run)) => evaluate(&run, None),
        Some(Command::Predict { run, count }) => evaluate(&run, Some(count)),
    };
    if let Err(message) = result {
        eprintln!("error: {message}");
        std::process::exit(1);
    }
}

fn identity(args: &TrainArgs) -> Result<RunIdentity, String> {
    let defaults = args.task.defaults();
    let seq_len = args.seq_len.unwrap_or(defaults.seq_len);
    let vocab = args.vocab.unwrap_or(defaults.vocab);
    let task = args.task.build(seq_len, vocab)?;
    let heads = args.heads.unwrap_or(defaults.heads);
    let model = TransformerConfig {
        architecture: task.architecture(),
        vocab: task.vocab(),
        max_len: task.max_len(),
        d_model: args.d_model.unwrap_or(defaults.d_model),
        heads,
        kv_heads: args.kv_heads.unwrap_or(heads),
        layers: args.layers.unwrap_or(defaults.layers),
        no_attention: args.no_attention,
        rotary: args.rotary.unwrap_or(defaults.rotary),
        token_shift: args.token_shift.unwrap_or(defaults.token_shift),
    };
    mha::MultiHeadAttentionConfig::new(model.d_model, model.heads)
        .with_n_kv_heads(Some(model.kv_heads))
        .validate()
        .map_err(|e| e.to_string())?;
    Ok(RunIdentity {
        task: args.task,
        model,
        seq_len,
        batch_size: args.batch_size.unwrap_or(defaults.batch_size),
        lr: args.lr.unwrap_or(defaults.lr),
        steps: args.steps.unwrap_or(defaults.steps),
        seed: args.seed,
    })
}

fn run_training(args: TrainArgs) -> Result<(), String> {
    let identity = identity(&args)?;
    let device = device::by_name(&args.device)?;
    let out = args.out.clone().unwrap_or_else(|| {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        PathBuf::from("runs").join(format!("{}-{stamp}", args.task.name()))
    });
    if !args.resume && out.join("checkpoint").exists() {
        return Err(format!(
            "{} already holds a run; pass --resume to continue it or choose another --out",
            out.display()
        ));
    }
    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
        .map_err(|e| format!("installing the Ctrl-C handler: {e}"))?;

    let task = args.task.build(identity.seq_len, identity.model.vocab)?;
    println!(
        "task: {} | model: {} layer(s), d_model {}, {} head(s), {} kv head(s){} | device: {} | out: {}",
        task.describe(),
        identity.model.layers,
        identity.model.d_model,
        identity.model.heads,
        identity.model.kv_heads,
        if identity.model.no_attention {
            ", ATTENTION DISABLED"
        } else {
            ""
        },
        args.device,
        out.display()
    );
    let summary = train::train(
        train::TrainSettings {
            identity,
            device,
            out: out.clone(),
            resume: args.resume,
            stop_after: args.stop_after,
            checkpoint_every: args.checkpoint_every,
            eval_every: args.eval_every.max(1),
            eval_examples: args.eval_examples.max(1),
            quiet: args.quiet,
        },
        interrupted,
    )?;
    if summary.interrupted {
        println!(
            "stopped at step {}: checkpoint saved in {}; continue with --resume --out {}",
            summary.steps,
            out.join("checkpoint").display(),
            out.display()
        );
        return Ok(());
    }
    println!(
        "| task | steps | final loss | held-out token acc | exact match | chance | time | device |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    println!(
        "| {} | {} | {:.4} | {:.1}% | {:.1}% | {:.1}% | {:.0} s | {} |",
        summary.task.name(),
        summary.steps,
        summary.final_loss,
        100.0 * summary.accuracy.token,
        100.0 * summary.accuracy.exact,
        100.0 * summary.chance,
        summary.seconds,
        args.device
    );
    println!("outputs: {}", out.display());
    Ok(())
}

fn evaluate(run: &RunArgs, predictions: Option<usize>) -> Result<(), String> {
    let config_path = run.out.join("config.json");
    let text = std::fs::read_to_string(&config_path)
        .map_err(|e| format!("{}: {e}", config_path.display()))?;
    let identity: RunIdentity = serde_json::from_str(&text)
        .map_err(|e| format!("{} is corrupt: {e}", config_path.display()))?;
    let device = device::by_name(&run.device)?;
    let task = identity
        .task
        .build(identity.seq_len, identity.model.vocab)?;
    let model = identity.model.init(&device);
    let optimizer = burn::optim::AdamWConfig::new().init();
    let (model, _) = checkpoint::load(&run.out, model, optimizer)?;
    let examples = train::held_out(task.as_ref(), identity.seed, run.eval_examples);
    match predictions {
        Some(count) => {
            let count = count.min(examples.len());
            print!(
                "{}",
                train::format_predictions(&model, task.as_ref(), &examples[..count], &device)
            );
        }
        None => {
            let accuracy = data::accuracy(&model, task.as_ref(), &examples, &device);
            println!(
                "{}: held-out token accuracy {:.2}%, exact match {:.2}% ({} examples)",
                task.describe(),
                100.0 * accuracy.token,
                100.0 * accuracy.exact,
                examples.len()
            );
        }
    }
    Ok(())
}
