//! A run killed with SIGKILL — mid-training or mid-save — resumes from its last complete
//! checkpoint and ends exactly as the uninterrupted run does.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("train-demo-crash-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The training command for `out`: sort, 60 steps in epochs of 10 (a checkpoint each), no
/// early stop.
fn training(out: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_train-demo"));
    command.args([
        "--task",
        "sort",
        "--steps",
        "60",
        "--eval-every",
        "10",
        "--target-exact",
        "101",
        "--eval-examples",
        "16",
        "--quiet",
        "--out",
    ]);
    command.arg(out);
    command
}

fn run_to_the_end(mut command: Command) {
    let output = command.output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Starts `command` and kills it with SIGKILL once it writes `line` to stderr.
fn kill_when(mut command: Command, line: &str) {
    let mut child = command.stderr(Stdio::piped()).spawn().unwrap();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let mut seen = Vec::new();
    let mut found = false;
    for text in stderr.lines() {
        let text = text.unwrap();
        found = text.contains(line);
        seen.push(text);
        if found {
            child.kill().unwrap(); // SIGKILL on Unix
            break;
        }
    }
    child.wait().unwrap();
    assert!(
        found,
        "the run ended without writing {line:?}; it wrote {seen:?}"
    );
}

/// The checkpoint files of a run.
fn checkpoint_files(out: &Path) -> Vec<String> {
    std::fs::read_dir(out.join("checkpoint"))
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().to_string())
        .collect()
}

/// The last epoch with its model, optimizer and scheduler records all in place.
fn complete_epoch(out: &Path) -> Option<usize> {
    let files = checkpoint_files(out);
    (1..=6)
        .filter(|epoch| {
            ["model", "optim", "scheduler"]
                .iter()
                .all(|name| files.contains(&format!("{name}-{epoch}.bpk")))
        })
        .max()
}

/// `(step, loss)` of every row of a run's metrics.
fn losses(out: &Path) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(out.join("metrics.csv")).unwrap();
    text.lines()
        .skip(1)
        .map(|line| {
            let mut fields = line.split(',');
            let step = fields.next().unwrap().parse().unwrap();
            let loss = fields.next().unwrap().parse().unwrap();
            (step, loss)
        })
        .collect()
}

fn assert_same_run(whole: &Path, resumed: &Path) {
    let (expected, actual) = (losses(whole), losses(resumed));
    assert_eq!(expected.len(), 60);
    assert_eq!(
        actual.iter().map(|row| row.0).collect::<Vec<_>>(),
        (1..=60).collect::<Vec<_>>(),
        "every step once"
    );
    for ((step, a), (_, b)) in expected.iter().zip(&actual) {
        assert!(
            (a - b).abs() <= 1e-5 * a.abs().max(1.0),
            "step {step}: {a} vs {b}"
        );
    }
}

#[test]
fn a_run_killed_mid_training_resumes_from_its_last_checkpoint_and_loses_nothing() {
    let whole = scratch("whole-a");
    run_to_the_end(training(&whole));

    let killed = scratch("killed-a");
    kill_when(training(&killed), "checkpoint: epoch 2 model saved");
    let epoch = complete_epoch(&killed);
    assert!(
        epoch.is_some_and(|epoch| epoch < 6),
        "killed mid-run with a complete checkpoint: {:?}",
        checkpoint_files(&killed)
    );
    let mut resume = training(&killed);
    resume.arg("--resume");
    run_to_the_end(resume);
    assert_same_run(&whole, &killed);
}

#[test]
fn a_run_killed_mid_save_keeps_the_previous_checkpoint() {
    let whole = scratch("whole-b");
    run_to_the_end(training(&whole));

    let killed = scratch("killed-b");
    let mut first = training(&killed);
    first.args(["--stop-after-epochs", "2"]);
    run_to_the_end(first);
    assert_eq!(complete_epoch(&killed), Some(2));
    // The next save (epoch 3) pauses with the model written but not in place; kill it there.
    let mut resumed = training(&killed);
    resumed
        .arg("--resume")
        .env("TRAIN_DEMO_SAVE_PAUSE_MS", "60000");
    kill_when(resumed, "checkpoint: epoch 3 written, not yet in place");
    assert_eq!(
        complete_epoch(&killed),
        Some(2),
        "the previous checkpoint is the last complete one"
    );
    let files = checkpoint_files(&killed);
    assert!(
        files.contains(&"model-3.bpk.partial".to_string())
            && !files.contains(&"model-3.bpk".to_string()),
        "the killed save left its partial file, not a model-3.bpk: {files:?}"
    );
    let mut resume = training(&killed);
    resume.arg("--resume");
    run_to_the_end(resume);
    assert_same_run(&whole, &killed);
    let files = checkpoint_files(&killed);
    assert!(
        !files.iter().any(|name| name.ends_with(".partial")),
        "the resume removed what the crash left: {files:?}"
    );
}
