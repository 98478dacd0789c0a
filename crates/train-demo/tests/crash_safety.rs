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

/// The training command for `out`: sort, 60 steps, a checkpoint every 10.
fn training(out: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_train-demo"));
    command.args([
        "--task",
        "sort",
        "--steps",
        "60",
        "--checkpoint-every",
        "10",
        "--eval-every",
        "1000",
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

fn checkpoint_step(out: &Path) -> u64 {
    let text = std::fs::read_to_string(out.join("checkpoint/state.json")).unwrap();
    let state: serde_json::Value = serde_json::from_str(&text).unwrap();
    state["step"].as_u64().unwrap()
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
    kill_when(training(&killed), "checkpoint: step 20 saved");
    let step = checkpoint_step(&killed);
    assert!(
        step >= 20 && step.is_multiple_of(10),
        "checkpoint at step {step}"
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
    first.args(["--stop-after", "20"]);
    run_to_the_end(first);
    assert_eq!(checkpoint_step(&killed), 20);
    // The next save (step 30) pauses with its files written but not in place; kill it there.
    let mut resumed = training(&killed);
    resumed
        .arg("--resume")
        .env("TRAIN_DEMO_SAVE_PAUSE_MS", "60000");
    kill_when(resumed, "checkpoint: step 30 written, not yet in place");
    assert_eq!(
        checkpoint_step(&killed),
        20,
        "the previous checkpoint is in place"
    );
    let leftovers: Vec<_> = std::fs::read_dir(killed.join("checkpoints"))
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert!(
        leftovers.iter().any(|name| name.ends_with(".partial")),
        "the killed save left its partial folder: {leftovers:?}"
    );
    let mut resume = training(&killed);
    resume.arg("--resume");
    run_to_the_end(resume);
    assert_same_run(&whole, &killed);
    let left: Vec<_> = std::fs::read_dir(killed.join("checkpoints"))
        .unwrap()
        .collect();
    assert_eq!(left.len(), 1, "later saves cleaned up what the crash left");
}
