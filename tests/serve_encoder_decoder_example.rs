//! The `serve_encoder_decoder` example end to end on flex: continuous batching through a
//! `PagedTransformerDecoderCache`, static batches of a `TransformerDecoderCache` and one request
//! at a time give every request the same tokens, but where two ways part at a near tie (the
//! example exits 1 otherwise; a few at most), with the default pool and with one too small for
//! the stream, whose requests then wait for blocks, with one request joining a step, with beam
//! search (beams forked in the pool, sharing blocks) and with sampled tokens; each way reports
//! its peak cache memory, stored within allocated; bad options are refused.

mod common;

use common::served::{PeakMib, numbers_after, peak_mib, refused, same_tokens, stdout_of};

/// What a run of the example reported.
#[derive(Debug)]
struct Report {
    /// Continuous batching's peak cache memory, stored and allocated, in MiB.
    batched_peak_mib: PeakMib,
    /// Static batching's.
    static_peak_mib: PeakMib,
    /// The static batches: how many, and the most requests in one.
    static_batches: (usize, usize),
    /// The first tokens continuous batching gave request 0.
    first_tokens: Vec<usize>,
    /// The most requests continuous batching held at once.
    most_in_flight: usize,
    /// The most blocks they reserved, of the pool's.
    most_reserved: usize,
    /// Steps that ran while a request that had arrived waited for blocks.
    steps_with_a_request_waiting: usize,
    /// The most requests that joined in one step.
    most_joined_in_a_step: usize,
    /// The pool's blocks per layer at its fullest, and what its sequences would have taken
    /// then without shared blocks.
    fullest_pool: (usize, usize),
}

/// The example's output with `args`, checked: every request the same tokens each batching way
/// as alone, or parted at a near tie (the example fails otherwise), and each way's peak cache
/// memory stored within allocated.
fn served(args: &[&str]) -> Report {
    let stdout = stdout_of("serve_encoder_decoder", args);
    same_tokens(&stdout, "continuously batched as alone");
    same_tokens(&stdout, "in static batches as alone");
    let [batched_peak_mib, static_peak_mib, _] =
        ["continuous batching", "static batches", "one at a time"]
            .map(|way| peak_mib(&stdout, way));
    let admission = numbers_after(&stdout, "continuous batching held at most ");
    let fullest = numbers_after(&stdout, "at its fullest the pool held ");
    let batches = numbers_after(&stdout, "static batching ran ");
    Report {
        fullest_pool: (fullest[0], fullest[1]),
        batched_peak_mib,
        static_peak_mib,
        static_batches: (batches[0], batches[1]),
        first_tokens: numbers_after(&stdout, "request 0's first tokens: "),
        most_in_flight: admission[0],
        most_reserved: admission[1],
        steps_with_a_request_waiting: admission[3],
        most_joined_in_a_step: admission[4],
    }
}

/// The checks every report passes: the pool at its fullest within what the requests in flight
/// had reserved (each beam's whole target, so that no step lacks a block).
fn within_reservations(report: &Report) {
    let (in_use, unshared) = report.fullest_pool;
    assert!(
        0 < in_use && in_use <= unshared && in_use <= report.most_reserved,
        "{report:?}"
    );
}

#[test]
fn continuous_batching_serves_every_request_the_tokens_of_serving_it_alone() {
    // Requests one every 2 ms (the default): how many overlap depends on the machine's speed,
    // so only the tokens and the pool are checked here.
    let report = served(&["--device", "flex"]);
    within_reservations(&report);
    // Greedy decoding forks nothing: every block is one sequence's.
    assert_eq!(report.fullest_pool.0, report.fullest_pool.1, "{report:?}");
    // All 32 at once: all join at the first step, their reservations (139 blocks per layer)
    // within the default pool's 512.
    let burst = served(&["--device", "flex", "--arrival-ms", "0"]);
    within_reservations(&burst);
    assert_eq!(
        (burst.most_joined_in_a_step, burst.most_in_flight),
        (32, 32),
        "{burst:?}"
    );
    assert_eq!(burst.steps_with_a_request_waiting, 0, "{burst:?}");
    // Static batching: one batch of all 32, every row holding the longest source and forced
    // start; the paged cache holds each request's own (5235 source positions in all, against
    // 32 times the longest, 311: 9952).
    assert_eq!(burst.static_batches, (1, 32), "{burst:?}");
    assert!(
        burst.static_peak_mib.stored > 1.5 * burst.batched_peak_mib.stored,
        "{burst:?}"
    );
    // One joining a step: the others keep decoding while the queue's sources are encoded one
    // a step; each request decodes for 16 steps or more, so 16 or more are in flight at once.
    let one_a_step = served(&[
        "--device",
        "flex",
        "--arrival-ms",
        "0",
        "--joins-per-step",
        "1",
    ]);
    within_reservations(&one_a_step);
    assert_eq!(one_a_step.most_joined_in_a_step, 1, "{one_a_step:?}");
    assert!(one_a_step.most_in_flight >= 16, "{one_a_step:?}");
}

#[test]
fn beam_search_forks_beams_that_share_blocks_and_gives_each_request_its_best_beam() {
    // Four beams a request: every request's best beam the same both ways (a batch of beams in
    // a `TransformerDecoderCache`, kept by `select_batch`, against forks in the pool).
    let report = served(&["--device", "flex", "--beams", "4", "--arrival-ms", "0"]);
    within_reservations(&report);
    // Four beams' reservations (556 blocks per layer for the 32) overflow the default pool.
    assert!(report.steps_with_a_request_waiting > 0, "{report:?}");
    // Beams forked from one another share their blocks up to where they part (their forced
    // start and common tokens): the pool holds fewer blocks than its sequences would alone.
    let (in_use, unshared) = report.fullest_pool;
    assert!(in_use < unshared, "{report:?}");
}

#[test]
fn sampled_tokens_do_not_depend_on_the_batch() {
    // Each token drawn with a number of its request and place alone: the same tokens all three
    // ways, whatever the batch, the pool, or when a request joined.
    let greedy = served(&["--device", "flex", "--arrival-ms", "0"]);
    let sampled = served(&[
        "--device",
        "flex",
        "--arrival-ms",
        "0",
        "--temperature",
        "1",
    ]);
    let small_pool = served(&[
        "--device",
        "flex",
        "--temperature",
        "1",
        "--pool-blocks",
        "24",
    ]);
    let sharper = served(&["--device", "flex", "--temperature", "0.3"]);
    assert_eq!(sampled.first_tokens.len(), 16, "{sampled:?}");
    // Sampling at temperature 1 from an untrained model's almost flat distribution over 256
    // tokens, a seed per request: the same tokens at any schedule, not greedy's.
    assert_eq!(sampled.first_tokens, small_pool.first_tokens);
    assert_ne!(sampled.first_tokens, greedy.first_tokens);
    assert_ne!(sampled.first_tokens, sharper.first_tokens);
    assert!(
        small_pool.steps_with_a_request_waiting > 0,
        "{small_pool:?}"
    );
}

#[test]
fn a_pool_too_small_for_the_stream_makes_requests_wait_for_blocks() {
    // 24 blocks per layer hold a few requests' reservations (2 to 9 blocks each) at once.
    let report = served(&[
        "--device",
        "flex",
        "--pool-blocks",
        "24",
        "--arrival-ms",
        "0",
    ]);
    within_reservations(&report);
    assert!(report.steps_with_a_request_waiting > 0, "{report:?}");
    assert!((2..32).contains(&report.most_in_flight), "{report:?}");
    // The pool's bound, 24 blocks of 16 positions of two key/value heads of 32 f32 values, keys
    // and values, in each of the two layers, beside the sources of the requests in flight as
    // every layer projected them (at most 320 positions each).
    let position_bytes = 2 * 32 * 4 * 2;
    let bound_bytes =
        24 * 16 * position_bytes * 2 + report.most_in_flight * 320 * position_bytes * 2;
    let PeakMib { stored, allocated } = report.batched_peak_mib;
    assert!(
        allocated <= bound_bytes as f64 / (1 << 20) as f64,
        "{stored} / {allocated} MiB"
    );
}

#[test]
fn bad_options_are_refused_with_the_usage() {
    for (args, error) in [
        (
            &["--pool-blocks", "8"][..],
            "`--pool-blocks` takes a number of blocks that holds the longest request (at least \
             9), not `8`",
        ),
        (
            &["--pool-blocks", "many"][..],
            "`--pool-blocks` takes a number of blocks that holds the longest request (at least \
             9), not `many`",
        ),
        (
            &["--beams", "0"][..],
            "`--beams` takes a number of beams (1 to 16), not `0`",
        ),
        (
            &["--beams", "17"][..],
            "`--beams` takes a number of beams (1 to 16), not `17`",
        ),
        (
            &["--beams", "4", "--pool-blocks", "35"][..],
            "`--pool-blocks` takes a number of blocks that holds the longest request (at least \
             36), not `35`",
        ),
        (
            &["--joins-per-step", "0"][..],
            "`--joins-per-step` takes a number of requests (at least 1), not `0`",
        ),
        (
            &["--arrival-ms", "-1"][..],
            "`--arrival-ms` takes a number of milliseconds, not `-1`",
        ),
        (
            &["--temperature", "0"][..],
            "`--temperature` takes a positive number, not `0`",
        ),
        (
            &["--temperature", "inf"][..],
            "`--temperature` takes a positive number, not `inf`",
        ),
        (
            &["--beams", "2", "--temperature", "1"][..],
            "`--temperature` samples one beam: leave out `--beams` or give it 1",
        ),
    ] {
        refused(
            "serve_encoder_decoder",
            args,
            error,
            "usage: serve_encoder_decoder [--device flex|ndarray|wgpu] [--beams N] \
             [--pool-blocks N] [--joins-per-step N] [--arrival-ms N] [--temperature T]",
        );
    }
}
