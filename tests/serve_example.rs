//! The `serve` example end to end on flex: continuous batching and one request at a time give
//! every request the same tokens, but at a near tie of its two largest logits (the example exits
//! 1 otherwise), with and without a sliding window, and each way reports its peak cache memory,
//! stored within allocated (less under the window); a bad `--window` is refused.

mod common;

use std::process::Command;

use common::example_binary;

/// The MiB figures of a table row's last cell, `stored MiB / allocated MiB`.
fn peak_memory(row: &str) -> (f64, f64) {
    let cell = row.trim_end_matches(" |").rsplit(" | ").next().unwrap();
    let mib: Vec<f64> = cell
        .split(" / ")
        .map(|part| part.trim_end_matches(" MiB").parse().unwrap())
        .collect();
    (mib[0], mib[1])
}

/// The example's output with `args`, checked: every request the same tokens both ways, or
/// parted at a near tie (the example fails otherwise), and each way's peak cache memory stored
/// within allocated. Returns each way's peak stored MiB: continuous batching, one at a time.
fn served(args: &[&str]) -> [f64; 2] {
    let run = Command::new(example_binary("serve"))
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{args:?}: {stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let same: usize = stdout
        .lines()
        .find_map(|line| line.strip_suffix(" of 32 requests got the same tokens both ways"))
        .unwrap_or_else(|| panic!("no count of requests with the same tokens: {stdout}"))
        .parse()
        .unwrap();
    assert!(
        same == 32 || stdout.contains("parted at a near tie"),
        "{stdout}"
    );
    ["| continuous batching", "| one at a time"].map(|way| {
        let row = stdout
            .lines()
            .find(|line| line.starts_with(way))
            .unwrap_or_else(|| panic!("no row {way}: {stdout}"));
        let (stored, allocated) = peak_memory(row);
        assert!(0.0 < stored && stored <= allocated, "{row}");
        stored
    })
}

#[test]
fn continuous_batching_serves_every_request_the_tokens_of_serving_it_alone() {
    let every_position = served(&["--device", "flex"]);
    // Under a window of 32 positions each way stores less at its peak: the paged cache gives
    // back the blocks behind each sequence's window, a `KvCache` keeps the window only.
    let windowed = served(&["--device", "flex", "--window", "32"]);
    for (way, (window, all)) in ["continuous batching", "one at a time"]
        .iter()
        .zip(windowed.iter().zip(every_position))
    {
        assert!(
            *window < all,
            "{way}: {window} MiB stored under a window, {all} without"
        );
    }
}

#[test]
fn a_bad_window_is_refused_with_the_usage() {
    let run = Command::new(example_binary("serve"))
        .args(["--window", "0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("`--window` takes a number of positions (at least 1), not `0`")
            && stderr.contains("usage: serve [--device flex|ndarray|wgpu] [--window N]"),
        "{stderr}"
    );
}
