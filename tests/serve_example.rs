//! The `serve` example end to end on flex: continuous batching and one request at a time give
//! every request the same tokens, but at a near tie of its two largest logits (the example exits
//! 1 otherwise), and each way reports its peak cache memory, stored within allocated.

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

#[test]
fn continuous_batching_serves_every_request_the_tokens_of_serving_it_alone() {
    let run = Command::new(example_binary("serve"))
        .args(["--device", "flex"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    // Every request the same tokens, or parted at a near tie (the example fails otherwise).
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
    for way in ["| continuous batching", "| one at a time"] {
        let row = stdout
            .lines()
            .find(|line| line.starts_with(way))
            .unwrap_or_else(|| panic!("no row {way}: {stdout}"));
        let (stored, allocated) = peak_memory(row);
        assert!(0.0 < stored && stored <= allocated, "{row}");
    }
}
