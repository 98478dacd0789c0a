//! The `causal_generation` example end to end on flex: greedy decoding with and without the
//! KV cache gives the same tokens, each beam search's score equals its tokens' log-probability
//! recomputed without a cache (its caches reordered by `select_batch`), and speculative decoding
//! (its caches cut back by `truncate`) gives greedy decoding's tokens; the example exits 1 if
//! any of these fails.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{example_binary, output_within};

/// Far more than the example takes (a few seconds); a run that loops fails here.
const EXAMPLE_LIMIT: Duration = Duration::from_secs(300);

#[test]
fn cached_beam_and_speculative_generation_agree_with_recomputation() {
    let run = output_within(
        Command::new(example_binary("causal_generation")).args(["--device", "flex"]),
        EXAMPLE_LIMIT,
    );
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    for line in [
        "same tokens both ways: true",
        "beam search:     4 beams, 24 tokens",
    ] {
        assert!(stdout.contains(line), "no `{line}` in: {stdout}");
    }
    // Greedy's tokens, or parted where the model's two largest logits were within rounding.
    assert!(
        stdout.contains("speculative decoding gave greedy decoding's tokens")
            || stdout.contains("a near tie"),
        "{stdout}"
    );
}
