//! Running a serving example (`serve`, `serve_encoder_decoder`) and reading what it printed:
//! its table's rows and the lines after the table.
#![allow(dead_code)] // each test binary uses its own subset

use std::process::{Command, Output};
use std::time::Duration;

use super::{example_binary, output_within};

/// Far more than a serving example takes (seconds); a run that loops fails here.
const EXAMPLE_LIMIT: Duration = Duration::from_secs(300);

/// What example `name` printed with `args`, and how it exited.
pub fn run(name: &str, args: &[&str]) -> Output {
    output_within(Command::new(example_binary(name)).args(args), EXAMPLE_LIMIT)
}

/// The standard output of example `name` with `args`.
///
/// # Panics
///
/// If the example did not exit 0 (a serving example exits 1 where two ways gave a request
/// different tokens but at a near tie).
pub fn stdout_of(name: &str, args: &[&str]) -> String {
    let run = run(name, args);
    let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
    assert!(
        run.status.success(),
        "{name} {args:?}: {stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    stdout
}

/// How many of the 32 requests got the same tokens served the two ways `ways` names (the
/// example's "… requests got the same tokens {ways}" line).
///
/// # Panics
///
/// If there is no such line, or it counts fewer than 28: the example passes a request whose
/// ways part at a near tie, which is rare (none in any run so far), so many would mean
/// decisions excused that should not be.
pub fn same_tokens(stdout: &str, ways: &str) -> usize {
    let same: usize = stdout
        .lines()
        .find_map(|line| line.strip_suffix(&format!(" of 32 requests got the same tokens {ways}")))
        .unwrap_or_else(|| panic!("no count of requests with the same tokens {ways}: {stdout}"))
        .parse()
        .unwrap();
    assert!(same >= 28, "{stdout}");
    same
}

/// A way's cache memory when it stored the most, in MiB.
#[derive(Debug, Clone, Copy)]
pub struct PeakMib {
    /// What the sequences in flight stored.
    pub stored: f64,
    /// What the caches had allocated then.
    pub allocated: f64,
}

/// The peak cache memory of the table's row of `way` (the row that starts with `| {way}`; its
/// last cell is `stored MiB / allocated MiB`).
///
/// # Panics
///
/// If there is no such row, or it stored nothing or more than it had allocated.
pub fn peak_mib(stdout: &str, way: &str) -> PeakMib {
    let row = stdout
        .lines()
        .find(|line| line.starts_with(&format!("| {way}")))
        .unwrap_or_else(|| panic!("no row {way}: {stdout}"));
    let cell = row.trim_end_matches(" |").rsplit(" | ").next().unwrap();
    let mib: Vec<f64> = cell
        .split(" / ")
        .map(|part| part.trim_end_matches(" MiB").parse().unwrap())
        .collect();
    assert!(0.0 < mib[0] && mib[0] <= mib[1], "{row}");
    PeakMib {
        stored: mib[0],
        allocated: mib[1],
    }
}

/// The numbers of the line that starts with `prefix`, in order.
///
/// # Panics
///
/// If no line starts with `prefix`.
pub fn numbers_after(stdout: &str, prefix: &str) -> Vec<usize> {
    stdout
        .lines()
        .find_map(|line| line.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no line `{prefix}…`: {stdout}"))
        .split(|c: char| !c.is_ascii_digit())
        .filter(|part| !part.is_empty())
        .map(|part| part.parse().unwrap())
        .collect()
}

/// Checks that example `name` refused `args` with exit status 2, `error` and its usage line
/// `usage` on standard error.
pub fn refused(name: &str, args: &[&str], error: &str, usage: &str) {
    let run = run(name, args);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{args:?}: {stderr}");
    assert!(stderr.contains(error) && stderr.contains(usage), "{stderr}");
}
