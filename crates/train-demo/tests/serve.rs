//! `train-demo serve`: a trained run's held-out requests served by continuous batching over
//! paged caches answer as the task expects and as one request at a time does, within a bounded
//! pool; what cannot be served is refused with a message naming why.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

fn train_demo() -> Command {
    Command::new(env!("CARGO_BIN_EXE_train-demo"))
}

/// A run of `task` trained to its default target in a scratch folder, once per test binary.
fn trained(task: &str, slot: &'static OnceLock<PathBuf>, extra: &[&str]) -> &'static Path {
    slot.get_or_init(|| {
        let out =
            std::env::temp_dir().join(format!("train-demo-serve-{task}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let status = train_demo()
            .args(["--task", task, "--quiet", "--out"])
            .arg(&out)
            .args(extra)
            .status()
            .unwrap();
        assert!(status.success(), "training {task} failed");
        out
    })
}

fn sort_run() -> &'static Path {
    static RUN: OnceLock<PathBuf> = OnceLock::new();
    trained("sort", &RUN, &[])
}

fn copy_run() -> &'static Path {
    static RUN: OnceLock<PathBuf> = OnceLock::new();
    trained("copy", &RUN, &[])
}

fn serve(run: &Path, options: &[&str]) -> Output {
    train_demo()
        .args(["serve", "--out"])
        .arg(run)
        .args(options)
        .output()
        .unwrap()
}

/// The printed report of a run that succeeded.
fn report(output: &Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "serve failed: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// The numbers of the line starting with `start`, in order.
fn numbers(report: &str, start: &str) -> Vec<f64> {
    let line = report
        .lines()
        .find(|line| line.starts_with(start))
        .unwrap_or_else(|| panic!("no line starting {start:?} in:\n{report}"));
    line.split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|word| word.trim_end_matches('.').parse().ok())
        .collect()
}

/// Checks what every served run must show: both ways answer every request as the task
/// expects and alike, and the pool never held more than `pool_blocks`.
fn check_answers(report: &str, requests: usize, pool_blocks: usize) -> Vec<f64> {
    for way in ["| continuous batching", "| one at a time"] {
        let row = numbers(report, way);
        let (exact, of) = (row[row.len() - 4], row[row.len() - 3]);
        assert_eq!(
            (exact, of),
            (requests as f64, requests as f64),
            "{way}: {report}"
        );
    }
    let same = numbers(report, "the same answers both ways");
    assert_eq!(same[..2], [requests as f64, requests as f64], "{report}");
    let batching = numbers(report, "continuous batching: up to");
    assert!(batching[1] <= pool_blocks as f64, "{report}");
    batching
}

#[test]
fn a_trained_decoder_served_by_continuous_batching_answers_as_one_at_a_time() {
    let output = report(&serve(
        sort_run(),
        &["--requests", "96", "--arrival-ms", "0"],
    ));
    let batching = check_answers(&output, 96, 256);
    // All at once: every request in one step, a block each.
    assert_eq!(batching[0], 96.0, "{output}");
    assert_eq!(batching[1], 96.0, "{output}");
}

#[test]
fn an_encoder_decoder_in_a_small_pool_waits_for_blocks_and_answers_alike() {
    let output = report(&serve(
        copy_run(),
        &[
            "--requests",
            "64",
            "--arrival-ms",
            "0",
            "--pool-blocks",
            "8",
        ],
    ));
    let batching = check_answers(&output, 64, 8);
    assert_eq!(
        batching[0], 8.0,
        "eight requests in flight at most: {output}"
    );
    assert_eq!(
        batching[4], 56.0,
        "all but the first eight waited: {output}"
    );
}

#[test]
fn requests_arriving_over_time_join_while_others_decode() {
    let output = report(&serve(
        copy_run(),
        &[
            "--requests",
            "48",
            "--arrival-ms",
            "0.05",
            "--block-size",
            "4",
        ],
    ));
    check_answers(&output, 48, 256);
}

#[test]
fn what_cannot_be_served_is_refused_with_its_reason() {
    let refused = |output: Output, expected: &str| {
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert!(!output.status.success(), "{expected}: served");
        assert!(stderr.contains(expected), "{expected:?} not in {stderr:?}");
    };
    refused(
        serve(sort_run(), &["--pool-blocks", "5", "--block-size", "1"]),
        "--pool-blocks 5: a request needs 11 blocks of 1 positions",
    );
    refused(serve(sort_run(), &["--pool-blocks", "0"]), "--pool-blocks");
    for arrival in ["--arrival-ms=-1", "--arrival-ms=1e30", "--arrival-ms=NaN"] {
        refused(
            serve(sort_run(), &[arrival]),
            "not a number of milliseconds",
        );
    }
    static REVERSE: OnceLock<PathBuf> = OnceLock::new();
    let reverse = trained("reverse", &REVERSE, &["--steps", "1", "--eval-every", "1"]);
    refused(
        serve(reverse, &[]),
        "reverse is scored by teacher forcing, not generated",
    );
}
