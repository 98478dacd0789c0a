//! The `serve` example end to end on flex: continuous batching, static batches of padded
//! prompts and one request at a time give every request the same tokens, but at a near tie of
//! its two largest logits (the example exits 1 otherwise), with and without a sliding window
//! and with a pool too small for the stream, whose requests are preempted and recomputed; each
//! way reports its peak cache memory, stored within allocated (less under the window, within
//! the pool's bound); prompts fed in chunks give the same tokens; tokens sampled with a seed
//! per request are the same every way too; bad options are refused.

mod common;

use common::served::{PeakMib, numbers_after, peak_mib, refused, same_tokens, stdout_of};

/// What a run of the example reported.
struct Report {
    /// Each way's peak cache memory: continuous batching, static batches, one at a time.
    peak_mib: [PeakMib; 3],
    /// Times continuous batching preempted a request, and the positions computed again.
    preempted: (usize, usize),
    /// Those of the preemptions that took a request still prefilling its prompt.
    preempted_prefilling: usize,
    /// The most prompt rows a step of continuous batching fed.
    most_prompt_rows: usize,
    /// What the example said it serves, ending with how it picks each token.
    first_line: String,
}

/// The example's output with `args`, checked: every request the same tokens every way, or
/// parted at a near tie (the example fails otherwise), and each way's peak cache memory stored
/// within allocated.
fn served(args: &[&str]) -> Report {
    let stdout = stdout_of("serve", args);
    // Continuous batching and static batches, each against one at a time.
    same_tokens(&stdout, "continuously batched as alone");
    same_tokens(&stdout, "in static batches as alone");
    let peak_mib = ["continuous batching", "static batches", "one at a time"]
        .map(|way| peak_mib(&stdout, way));
    let numbers = numbers_after(&stdout, "continuous batching preempted requests ");
    Report {
        first_line: stdout.lines().next().unwrap_or_default().to_string(),
        peak_mib,
        preempted: (numbers[0], numbers[2]),
        preempted_prefilling: numbers[1],
        most_prompt_rows: numbers[3],
    }
}

#[test]
fn continuous_batching_serves_every_request_the_tokens_of_serving_it_alone() {
    // All at once, so that how many requests overlap at the peak is the same on every machine.
    let every_position = served(&["--device", "flex", "--arrival-ms", "0"]);
    // The default pool of 512 blocks holds the stream's peak: nothing is preempted. Whole
    // prompts (80-256 rows, less the system prompt's shared blocks) go in one step.
    assert_eq!(every_position.preempted, (0, 0));
    assert!(every_position.most_prompt_rows > 16);
    // Under a window of 32 positions each way stores less at its peak: the paged cache gives
    // back the blocks behind each sequence's window, a `KvCache` keeps the window only.
    let windowed = served(&["--device", "flex", "--window", "32", "--arrival-ms", "0"]);
    for (way, (window, all)) in ["continuous batching", "static batches", "one at a time"]
        .iter()
        .zip(windowed.peak_mib.iter().zip(every_position.peak_mib))
    {
        assert!(
            window.stored < all.stored,
            "{way}: {} MiB stored under a window, {} without",
            window.stored,
            all.stored
        );
    }
}

#[test]
fn a_pool_too_small_for_the_stream_preempts_and_recomputes_to_the_same_tokens() {
    // The stream stores about 280 blocks per layer at its peak; 48 hold a few requests at once.
    // All 32 arrive at once, so that the schedule (and when a request is preempted) is the
    // same on every machine.
    let small = served(&[
        "--device",
        "flex",
        "--pool-blocks",
        "48",
        "--arrival-ms",
        "0",
    ]);
    let (count, recomputed) = small.preempted;
    assert!(
        count > 0 && recomputed > 0,
        "{count} preemptions, {recomputed} positions"
    );
    // The pool's bound: 48 blocks of 16 positions of two key/value heads of 32 f32 values,
    // keys and values, in each of the two layers.
    let bound_mib = (48 * 16 * 2 * 32 * 4 * 2 * 2) as f64 / (1 << 20) as f64;
    let PeakMib { stored, allocated } = small.peak_mib[0];
    assert!(
        stored <= allocated && allocated <= bound_mib,
        "{stored} / {allocated} MiB"
    );
}

#[test]
fn prompts_prefilled_in_chunks_give_the_same_tokens() {
    // Every prompt (80-256 rows) fed 16 rows a step beside the others' tokens. The default pool
    // holds every request's every block at once (509 of 512): nothing is preempted.
    let chunked = served(&["--device", "flex", "--prefill-chunk", "16"]);
    assert_eq!(chunked.preempted, (0, 0));
    assert_eq!(chunked.most_prompt_rows, 16);
    let small = served(&[
        "--device",
        "flex",
        "--prefill-chunk",
        "16",
        "--pool-blocks",
        "48",
        "--arrival-ms",
        "0",
    ]);
    assert!(small.preempted.0 > 0, "{:?}", small.preempted);
    assert!(small.most_prompt_rows <= 16, "{}", small.most_prompt_rows);
    // Prompts fed 2 rows a step into a pool that holds about one request: requests are
    // preempted halfway through their prompts and come back for the rows the cache lacks.
    let halfway = served(&[
        "--device",
        "flex",
        "--prefill-chunk",
        "2",
        "--pool-blocks",
        "30",
        "--arrival-ms",
        "0",
    ]);
    assert!(
        halfway.preempted_prefilling > 0,
        "{} of {} preemptions while prefilling",
        halfway.preempted_prefilling,
        halfway.preempted.0
    );
    assert!(
        halfway.most_prompt_rows <= 2,
        "{}",
        halfway.most_prompt_rows
    );
}

#[test]
fn sampled_tokens_do_not_depend_on_the_batch_nor_on_preemptions() {
    // Each request draws from its own seed by its tokens' places, so every way samples it the
    // same tokens; in a pool of 48 blocks requests are preempted and recompute what they had
    // sampled, then go on drawing where they left off; prompts fed 2 rows a step into 30
    // blocks are preempted while prefilling too, and a chunk's choice is dropped.
    for (temperature, pool_blocks, prefill_chunk) in
        [("1", "48", "none"), ("0.3", "48", "none"), ("1", "30", "2")]
    {
        let mut args = vec![
            "--device",
            "flex",
            "--temperature",
            temperature,
            "--pool-blocks",
            pool_blocks,
            "--arrival-ms",
            "0",
        ];
        if prefill_chunk != "none" {
            args.extend(["--prefill-chunk", prefill_chunk]);
        }
        let sampled = served(&args);
        assert!(sampled.preempted.0 > 0, "{:?}", sampled.preempted);
        assert!(
            sampled.first_line.ends_with(&format!(
                ", tokens sampled at temperature {temperature}, a seed per request"
            )),
            "{}",
            sampled.first_line
        );
        if prefill_chunk != "none" {
            assert!(sampled.preempted_prefilling > 0, "{:?}", sampled.preempted);
        }
    }
}

#[test]
fn bad_options_are_refused_with_the_usage() {
    for (args, error) in [
        (
            ["--window", "0"],
            "`--window` takes a number of positions (at least 1), not `0`",
        ),
        (
            ["--prefill-chunk", "0"],
            "`--prefill-chunk` takes a number of rows (at least 1), not `0`",
        ),
        (
            ["--temperature", "0"],
            "`--temperature` takes a positive number, not `0`",
        ),
        (
            ["--temperature", "inf"],
            "`--temperature` takes a positive number, not `inf`",
        ),
        (
            ["--temperature", "NaN"],
            "`--temperature` takes a positive number, not `NaN`",
        ),
        (
            ["--pool-blocks", "24"],
            "`--pool-blocks` takes a number of blocks that holds the longest request (at least \
             25), not `24`",
        ),
    ] {
        refused(
            "serve",
            &args,
            error,
            "usage: serve [--device flex|ndarray|wgpu] [--window N] [--pool-blocks N] \
             [--prefill-chunk N] [--arrival-ms N] [--temperature T]",
        );
    }
}
