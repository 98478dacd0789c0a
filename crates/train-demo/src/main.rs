//! Trains small Transformers built from `mha::MultiHeadAttention` on toy sequence tasks that
//! only attention across positions can solve, on any Burn backend compiled in.
//!
//! ```sh
//! cargo run --release -p train-demo                       # reverse, on flex
//! cargo run --release -p train-demo -- --task sort --no-attention
//! cargo run --release -p train-demo -- --task count --heads 1  # one head for two relations
//! cargo run --release -p train-demo -- --devices flex,flex    # burn-train's MultiDevice
//! cargo run --release -p train-demo -- eval --out runs/reverse-…
//! cargo run --release -p train-demo -- serve --out runs/sort-…   # continuous batching
//! ```

mod checkpoint;
mod data;
mod device;
mod loader;
mod model;
mod renderer;
mod report;
mod rng;
mod schedule;
mod serve;
mod step;
mod stopping;
mod tasks;
mod train;

use std::path::PathBuf;

use burn::train::Interrupter;
use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::checkpoint::RunIdentity;
use crate::model::TransformerConfig;
use crate::tasks::{Architecture, TaskKind};
use crate::train::Parallelism;

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
    /// Serve a run's held-out examples to its decoder as a stream of requests: continuous
    /// batching over paged KV caches against one request at a time (generative tasks).
    Serve(ServeArgs),
}

#[derive(Args, Debug, Clone)]
struct ServeArgs {
    /// The run's folder (holding config.json and checkpoint/).
    #[arg(long)]
    out: PathBuf,
    /// Device to serve on.
    #[arg(long, default_value = "flex")]
    device: String,
    /// Held-out examples served, one request each.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    requests: u64,
    /// Milliseconds between two requests' arrivals (0: all at once; fractions allowed: a toy
    /// model answers a request in well under a millisecond).
    #[arg(long, default_value_t = 0.1, value_parser = milliseconds)]
    arrival_ms: f64,
    /// Blocks in each layer's pool: a request waits until the blocks its answer takes are
    /// free.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    pool_blocks: u64,
    /// Positions per block.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
    block_size: u64,
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
    /// Device, or several separated by commas to train on together (`flex,flex`, or
    /// `cuda:0,cuda:1`): any backend compiled in (flex by default).
    #[arg(long, alias = "device", default_value = "flex")]
    devices: String,
    /// How several devices train together.
    #[arg(long, value_enum, default_value_t = Parallelism::Multi)]
    parallel: Parallelism,
    /// Training batches (default: the task's), rounded up to whole epochs.
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
    /// Tokens in the model's vocabulary (for count: (w + 1)², one per pair of counts of w bits).
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
    /// A feed-forward block after every attention (true/false); default: the task's (false for
    /// count only, which then reads its heads out linearly). Encoder tasks only without one.
    #[arg(long)]
    feed_forward: Option<bool>,
    /// Batches per epoch: the held-out evaluation, the checkpoint and the early-stopping
    /// check come at the end of each.
    #[arg(long, default_value_t = 100)]
    eval_every: usize,
    #[arg(long, default_value_t = 512)]
    eval_examples: usize,
    /// Stop once an epoch's held-out exact match reaches this percentage (above 100: never).
    #[arg(long, default_value_t = 100.0)]
    target_exact: f64,
    /// Stop after N epochs in this process (checkpointed; `--resume` continues).
    #[arg(long)]
    stop_after_epochs: Option<usize>,
    /// No output but the final table (no dashboard, no epoch lines).
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
        Some(Command::Serve(args)) => run_serving(&args),
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
        feed_forward: args.feed_forward.unwrap_or(defaults.feed_forward),
    };
    if !model.feed_forward && model.architecture != Architecture::Encoder {
        return Err(format!(
            "--feed-forward false builds an encoder of attention layers alone; {} is not an \
             encoder task",
            args.task.name()
        ));
    }
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
        epoch_steps: args.eval_every.max(1),
        seed: args.seed,
    })
}

/// The devices of `--devices`; distributed data parallel only where Burn has its all-reduce.
fn devices(args: &TrainArgs) -> Result<Vec<burn::tensor::Device>, String> {
    let names: Vec<&str> = args.devices.split(',').map(str::trim).collect();
    if args.parallel == Parallelism::Ddp && !names.iter().all(|name| name.starts_with("cuda")) {
        return Err(format!(
            "--parallel ddp needs CUDA devices (Burn 0.22's all-reduce runs on CUDA only), got \
             {}; --parallel multi runs on any backend",
            args.devices
        ));
    }
    names.into_iter().map(device::by_name).collect()
}

fn run_training(args: TrainArgs) -> Result<(), String> {
    let identity = identity(&args)?;
    let devices = devices(&args)?;
    let out = output_folder(&args);
    if !args.resume && checkpoint::latest_complete_epoch(&out).is_some() {
        return Err(format!(
            "{} already holds a run; pass --resume to continue it or choose another --out",
            out.display()
        ));
    }
    let interrupter = Interrupter::new();
    let on_ctrl_c = interrupter.clone();
    ctrlc::set_handler(move || on_ctrl_c.stop(Some("Ctrl-C")))
        .map_err(|e| format!("installing the Ctrl-C handler: {e}"))?;

    let task = args.task.build(identity.seq_len, identity.model.vocab)?;
    println!(
        "task: {} | model: {} layer(s), d_model {}, {} head(s), {} kv head(s){} | devices: {} | \
         out: {}",
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
        args.devices,
        out.display()
    );
    let summary = train::train(
        train::TrainSettings {
            identity,
            devices,
            parallelism: args.parallel,
            out: out.clone(),
            resume: args.resume,
            stop_after_epochs: args.stop_after_epochs,
            target_exact: args.target_exact,
            eval_examples: args.eval_examples.max(1),
            quiet: args.quiet,
        },
        interrupter,
    )?;
    if summary.interrupted {
        println!(
            "stopped after epoch {} (step {}): checkpoint in {}; continue with --resume --out {}",
            summary.epochs,
            summary.steps,
            checkpoint::checkpoint_dir(&out).display(),
            out.display()
        );
        return Ok(());
    }
    print_final_table(&summary, &args.devices);
    println!("outputs: {}", out.display());
    Ok(())
}

/// `--out`, or `runs/<task>-<unix time>`.
fn output_folder(args: &TrainArgs) -> PathBuf {
    args.out.clone().unwrap_or_else(|| {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        PathBuf::from("runs").join(format!("{}-{stamp}", args.task.name()))
    })
}

/// The run's result as one Markdown table row under its header.
fn print_final_table(summary: &train::Summary, devices: &str) {
    println!(
        "| task | steps | epochs | final loss | held-out token acc | exact match | chance | time | \
         devices |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    println!(
        "| {} | {} | {} | {:.4} | {:.1}% | {:.1}% | {:.1}% | {:.0} s | {devices} |",
        summary.task.name(),
        summary.steps,
        summary.epochs,
        summary.final_loss,
        100.0 * summary.accuracy.token,
        100.0 * summary.accuracy.exact,
        100.0 * summary.chance,
        summary.seconds,
    );
}

fn evaluate(run: &RunArgs, predictions: Option<usize>) -> Result<(), String> {
    let identity: RunIdentity = checkpoint::load_identity(&run.out)?;
    let device = device::by_name(&run.device)?;
    let task = identity
        .task
        .build(identity.seq_len, identity.model.vocab)?;
    let model = checkpoint::load_model(&run.out, identity.model.init(&device))?;
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

/// The longest time between two arrivals `serve` takes, in milliseconds: a minute (longer
/// gaps serve one request at a time both ways, and the arrival times must fit a `Duration`).
const MOST_ARRIVAL_MS: f64 = 60_000.0;

/// A number of milliseconds from 0 to [`MOST_ARRIVAL_MS`].
fn milliseconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(value) if (0.0..=MOST_ARRIVAL_MS).contains(&value) => Ok(value),
        _ => Err(format!(
            "{text:?} is not a number of milliseconds from 0 to {MOST_ARRIVAL_MS}"
        )),
    }
}

fn run_serving(args: &ServeArgs) -> Result<(), String> {
    let identity: RunIdentity = checkpoint::load_identity(&args.out)?;
    let device = device::by_name(&args.device)?;
    let task = identity
        .task
        .build(identity.seq_len, identity.model.vocab)?;
    if task.generate_len().is_none() {
        let generative: Vec<&str> = TaskKind::value_variants()
            .iter()
            .filter(|kind| {
                let defaults = kind.defaults();
                kind.build(defaults.seq_len, defaults.vocab)
                    .is_ok_and(|task| task.generate_len().is_some())
            })
            .map(|kind| kind.name())
            .collect();
        return Err(format!(
            "{} is scored by teacher forcing, not generated: there is nothing to serve token by \
             token (a run of {} is)",
            identity.task.name(),
            generative.join(" or ")
        ));
    }
    let model = checkpoint::load_model(&args.out, identity.model.init(&device))?;
    let examples = train::held_out(task.as_ref(), identity.seed, args.requests as usize);
    let requests: Vec<serve::Request> = examples.iter().map(serve::Request::of).collect();
    let settings = serve::ServeSettings {
        arrival: std::time::Duration::from_secs_f64(args.arrival_ms / 1e3),
        pool_blocks: args.pool_blocks as usize,
        block_size: args.block_size as usize,
    };
    let batched = serve::continuously(&model, &requests, settings, &device)?;
    let alone = serve::one_at_a_time(&model, &requests, settings, &device);
    serve::report(task.describe(), &requests, settings, &batched, &alone)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn train_args(arguments: &[&str]) -> TrainArgs {
        let cli = Cli::try_parse_from([&["train-demo"], arguments].concat()).unwrap();
        cli.train
    }

    #[test]
    fn devices_are_listed_and_ddp_needs_cuda() {
        assert_eq!(
            devices(&train_args(&["--devices", "flex, flex"]))
                .unwrap()
                .len(),
            2
        );
        assert_eq!(
            devices(&train_args(&["--device", "flex"])).unwrap().len(),
            1
        );
        let error = devices(&train_args(&[
            "--devices",
            "flex,flex",
            "--parallel",
            "ddp",
        ]));
        assert!(error.unwrap_err().contains("needs CUDA devices"));
        let error = devices(&train_args(&["--devices", "flex:1"])).unwrap_err();
        assert!(error.contains("only CUDA devices take an index"), "{error}");
        let error = devices(&train_args(&["--devices", "cuda:x"])).unwrap_err();
        assert!(error.contains("the index is not a number"), "{error}");
    }

    #[test]
    fn count_defaults_to_one_attention_layer_of_two_heads_and_takes_one_head() {
        let two = identity(&train_args(&["--task", "count"])).unwrap();
        let model = &two.model;
        assert_eq!(
            (model.layers, model.heads, model.kv_heads, model.d_model),
            (1, 2, 2, 64)
        );
        assert_eq!((model.vocab, model.max_len, two.seq_len), (64, 16, 16));
        assert!(!model.rotary && !model.token_shift && !model.feed_forward);
        let one = identity(&train_args(&["--task", "count", "--heads", "1"])).unwrap();
        assert_eq!((one.model.heads, one.model.kv_heads), (1, 1));
        assert!(identity(&train_args(&["--task", "count", "--vocab", "60"])).is_err());
        assert!(identity(&train_args(&["--task", "count", "--seq-len", "14"])).is_err());
        let error =
            identity(&train_args(&["--task", "sort", "--feed-forward", "false"])).unwrap_err();
        assert!(error.contains("not an encoder task"), "{error}");
    }
}
