//! What the serving examples (`serve`, `serve_encoder_decoder`) share: a deterministic stream
//! of numbers for their requests, greedy, sampled and beam-search choices with the margin that
//! tells a near tie ([`choosing`]), what serving a stream one way measured and its table row,
//! and the check that two ways gave every request the same tokens.

mod choosing;

use std::ops::Range;
use std::time::{Duration, Instant};

use burn::nn::Embedding;
use burn::tensor::{Device, Int, Tensor, TensorData};

pub use choosing::{
    Beam, Choice, Decision, Decoding, NEAR_TIE, Survivors, TokenSlot, best_continuations, draw,
    greedy, sample,
};

/// A deterministic stream of numbers (a 64-bit linear congruential generator's high bits): the
/// same requests at every run, on every machine.
pub struct Numbers {
    state: u64,
}

impl Numbers {
    /// The stream from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next number, below `bound`.
    ///
    /// # Panics
    ///
    /// If `bound` is 0.
    pub fn below(&mut self, bound: u64) -> u64 {
        assert!(bound > 0, "Numbers::below: `bound` must be at least 1");
        self.state = self
            .state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        (self.state >> 33) % bound
    }
}

/// The next static batch of a stream whose requests arrive at `arrivals` (from `started`),
/// `next` the first not yet served: waits for that one, then takes every request arrived by
/// then, in order.
///
/// # Panics
///
/// If `next` is past the stream.
pub fn next_static_batch(arrivals: &[Duration], next: usize, started: Instant) -> Range<usize> {
    std::thread::sleep(arrivals[next].saturating_sub(started.elapsed()));
    let now = started.elapsed();
    let arrived = arrivals[next..]
        .iter()
        .take_while(|&&arrival| arrival <= now)
        .count();
    next..next + arrived
}

/// Sets `arrivals`, in order, one every `interval_ms` milliseconds from 0 (0: all at once);
/// returns that rule in words.
pub fn space_arrivals<'a>(
    arrivals: impl IntoIterator<Item = &'a mut Duration>,
    interval_ms: u64,
) -> String {
    for (index, arrival) in arrivals.into_iter().enumerate() {
        *arrival = Duration::from_millis((index as u64).saturating_mul(interval_ms));
    }
    match interval_ms {
        0 => "all at once".to_string(),
        interval => format!("one every {interval} ms"),
    }
}

/// `tokens` as one sequence through `embedding`: `[1, tokens, d_model]`.
pub fn embed(embedding: &Embedding, tokens: &[i64], device: &Device) -> Tensor<3> {
    let tokens =
        Tensor::<2, Int>::from_data(TensorData::new(tokens.to_vec(), [1, tokens.len()]), device);
    embedding.forward(tokens)
}

/// The rows of a paged step's `output` (`[rows, d_model]`, row `i` of `sequences[i]`, each
/// sequence's rows consecutive) that give the sequences' next tokens: each run's last,
/// `[runs, d_model]`.
pub fn last_rows<T: PartialEq>(output: Tensor<2>, sequences: &[T]) -> Tensor<2> {
    let rows = last_row_indices(sequences);
    let count = rows.len();
    let rows = Tensor::<1, Int>::from_data(TensorData::new(rows, [count]), &output.device());
    output.select(0, rows)
}

/// The index of the last row of each run of equal ids in `sequences`.
fn last_row_indices<T: PartialEq>(sequences: &[T]) -> Vec<i64> {
    (0..sequences.len())
        .filter(|&row| row + 1 == sequences.len() || sequences[row + 1] != sequences[row])
        .map(|row| row as i64)
        .collect()
}

/// A cache's memory when it stored the most: what the sequences in flight stored, and what the
/// caches had allocated then (not necessarily the most they ever allocated).
#[derive(Debug, Clone, Copy, Default)]
pub struct CacheBytes {
    /// Bytes the sequences in flight store.
    pub stored: usize,
    /// Bytes the caches had allocated.
    pub allocated: usize,
}

impl CacheBytes {
    /// The larger of `self` and `now` by the bytes stored.
    pub fn peak(self, now: CacheBytes) -> CacheBytes {
        if now.stored > self.stored { now } else { self }
    }
}

/// What serving a stream of requests one way measured.
pub struct Served {
    /// Each request's tokens.
    pub tokens: Vec<Vec<i64>>,
    /// Each request's decisions, in order ([`check_same_tokens`] compares them).
    pub decisions: Vec<Vec<Decision>>,
    /// The whole stream's time.
    pub wall: Duration,
    /// When each token came out, from the start of serving.
    pub token_times: Vec<Vec<Duration>>,
    /// When each request arrived, likewise.
    pub arrivals: Vec<Duration>,
    /// The caches' memory at its peak.
    pub peak_cache: CacheBytes,
}

impl Served {
    /// Nothing served yet of requests arriving at `arrivals`: no tokens, no time, no memory.
    pub fn nothing_yet(arrivals: Vec<Duration>) -> Self {
        let requests = arrivals.len();
        Self {
            tokens: vec![Vec::new(); requests],
            decisions: vec![Vec::new(); requests],
            wall: Duration::ZERO,
            token_times: vec![Vec::new(); requests],
            arrivals,
            peak_cache: CacheBytes::default(),
        }
    }

    /// Each request's time to its first token, ms.
    fn first_token_ms(&self) -> Vec<f64> {
        self.token_times
            .iter()
            .zip(&self.arrivals)
            .map(|(times, &arrival)| (times[0] - arrival).as_secs_f64() * 1e3)
            .collect()
    }

    /// The time between each two tokens of a request that follow each other, ms, every
    /// request's.
    fn between_tokens_ms(&self) -> Vec<f64> {
        self.token_times
            .iter()
            .flat_map(|times| {
                times
                    .windows(2)
                    .map(|pair| (pair[1] - pair[0]).as_secs_f64() * 1e3)
            })
            .collect()
    }

    /// Each request's tokens and decisions.
    fn runs(&self) -> impl Iterator<Item = (&[i64], &[Decision])> {
        self.tokens
            .iter()
            .zip(&self.decisions)
            .map(|(tokens, decisions)| (tokens.as_slice(), decisions.as_slice()))
    }
}

/// The mean, median, 99th percentile and largest of `values`.
fn summary(mut values: Vec<f64>) -> [f64; 4] {
    values.sort_by(f64::total_cmp);
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let at = |fraction: f64| values[((values.len() - 1) as f64 * fraction).round() as usize];
    [mean, at(0.5), at(0.99), at(1.0)]
}

/// The header of the table [`report`] writes rows of.
pub const TABLE_HEADER: &str = "| way | tokens/s | wall s | time to first token, ms (mean / median / max) | time between tokens, ms (median / p99 / max) | cache memory when it stored the most: stored / allocated |\n|---|---|---|---|---|---|";

/// Prints `served`'s row of the table ([`TABLE_HEADER`]), named `way`.
pub fn report(way: &str, served: &Served) {
    let generated: usize = served.tokens.iter().map(Vec::len).sum();
    let [first_mean, first_median, _, first_max] = summary(served.first_token_ms());
    let [_, between_median, between_p99, between_max] = summary(served.between_tokens_ms());
    let mib = |bytes: usize| bytes as f64 / (1 << 20) as f64;
    println!(
        "| {way} | {:.0} | {:.2} | {first_mean:.0} / {first_median:.0} / {first_max:.0} | \
         {between_median:.2} / {between_p99:.2} / {between_max:.2} | {:.2} MiB / {:.2} MiB |",
        generated as f64 / served.wall.as_secs_f64(),
        served.wall.as_secs_f64(),
        mib(served.peak_cache.stored),
        mib(served.peak_cache.allocated)
    );
}

/// Where two ways of serving the same requests parted: each request whose tokens differ, with
/// the first decision where the two ways differ and its margin (the smaller of the two ways').
#[derive(Debug, Clone, PartialEq)]
pub struct Parting {
    /// The request, by its index.
    pub request: usize,
    /// The first decision that differs (past both ways' decisions if none does).
    pub decision: usize,
    /// Its margin; infinite where no decision differs.
    pub margin: f32,
}

impl Parting {
    /// Whether the decision was a near tie ([`NEAR_TIE`]), which rounding may decide apart.
    pub fn at_a_near_tie(&self) -> bool {
        self.margin < NEAR_TIE
    }
}

/// Each request whose tokens differ between `first` and `second`, where they part.
pub fn partings(first: &Served, second: &Served) -> Vec<Parting> {
    // The two ways compute the same scores to within float rounding, so their decisions may
    // differ only where a decision's margin is about that small: the first decision that
    // differs must be a near tie in one way or the other (all that follows it may differ
    // anyway); anywhere else a difference is a bug.
    first
        .runs()
        .zip(second.runs())
        .enumerate()
        .filter(|(_, ((first_tokens, _), (second_tokens, _)))| first_tokens != second_tokens)
        .map(|(request, ((_, first_decisions), (_, second_decisions)))| {
            let decision = first_decisions
                .iter()
                .zip(second_decisions)
                .position(|(a, b)| a.chosen != b.chosen)
                .unwrap_or(first_decisions.len().max(second_decisions.len()));
            let margin_of = |decisions: &[Decision]| {
                decisions
                    .get(decision)
                    .map_or(f32::INFINITY, |decided| decided.margin)
            };
            Parting {
                request,
                decision,
                margin: margin_of(first_decisions).min(margin_of(second_decisions)),
            }
        })
        .collect()
}

/// Prints how many requests got the same tokens from `first` and `second`, served the two ways
/// `ways` names ("both ways", say), and exits with status 1, naming the requests and where
/// their decisions part, if one parted but at a near tie ([`partings`]).
pub fn check_same_tokens(ways: &str, first: &Served, second: &Served) {
    let (ties, parted): (Vec<Parting>, Vec<Parting>) = partings(first, second)
        .into_iter()
        .partition(Parting::at_a_near_tie);
    let describe = |partings: &[Parting]| {
        partings
            .iter()
            .map(|parting| {
                format!(
                    "request {} from decision {} (margin {:.1e})",
                    parting.request, parting.decision, parting.margin
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let requests = first.tokens.len();
    let same = requests - ties.len() - parted.len();
    println!("{same} of {requests} requests got the same tokens {ways}");
    if !ties.is_empty() {
        println!(
            "parted at a near tie (a margin within {NEAR_TIE:.0e}): {}",
            describe(&ties)
        );
    }
    if !parted.is_empty() {
        eprintln!(
            "error: requests served {ways} got different tokens: {}",
            describe(&parted)
        );
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_rows_are_each_runs_last() {
        assert_eq!(last_row_indices(&[3, 3, 5, 7, 7, 7]), vec![1, 2, 5]);
        assert_eq!(last_row_indices::<u8>(&[]), Vec::<i64>::new());
        let output = Tensor::<2>::from_floats([[0.0], [1.0], [2.0], [3.0]], &Device::flex());
        let last = last_rows(output, &['a', 'b', 'b', 'c']);
        assert_eq!(
            last.into_data().try_to_vec::<f32>().unwrap(),
            [0.0, 2.0, 3.0]
        );
    }

    /// A stream served with `tokens`, each request's decisions choosing its tokens by
    /// `margins`.
    fn served_as(tokens: &[&[i64]], margins: &[&[f32]]) -> Served {
        Served {
            tokens: tokens.iter().map(|run| run.to_vec()).collect(),
            decisions: tokens
                .iter()
                .zip(margins)
                .map(|(run, margins)| {
                    run.iter()
                        .zip(*margins)
                        .map(|(&token, &margin)| Decision {
                            chosen: token as u64,
                            margin,
                        })
                        .collect()
                })
                .collect(),
            wall: Duration::ZERO,
            token_times: Vec::new(),
            arrivals: Vec::new(),
            peak_cache: CacheBytes::default(),
        }
    }

    #[test]
    fn ways_part_only_where_a_decision_differs_and_by_its_margin() {
        let first = served_as(
            &[&[1, 2, 3], &[4, 5], &[6, 7]],
            &[&[1.0; 3], &[1.0, 1e-4], &[1.0; 2]],
        );
        // Request 0 the same; request 1 parts at its second token, a near tie in the first
        // way; request 2 parts at its first, by a wide margin in both.
        let second = served_as(
            &[&[1, 2, 3], &[4, 9], &[8, 7]],
            &[&[1.0; 3], &[1.0, 0.5], &[2.0; 2]],
        );
        let parted = partings(&first, &second);
        assert_eq!(
            parted,
            [
                Parting {
                    request: 1,
                    decision: 1,
                    margin: 1e-4
                },
                Parting {
                    request: 2,
                    decision: 0,
                    margin: 1.0
                }
            ]
        );
        assert!(parted[0].at_a_near_tie() && !parted[1].at_a_near_tie());
        // Tokens that differ where no decision does (a bug in what the tokens are made of)
        // part by no margin at all.
        let mut odd = served_as(&[&[1, 2, 3]], &[&[1e-6; 3]]);
        odd.tokens[0][2] = 5;
        let same_decisions = served_as(&[&[1, 2, 3]], &[&[1e-6; 3]]);
        let parting = &partings(&odd, &same_decisions)[0];
        assert_eq!((parting.decision, parting.margin), (3, f32::INFINITY));
        // One way's decisions a prefix of the other's: past both, no margin either (the
        // longer one's next decision, a near tie, does not excuse it).
        let short = served_as(&[&[1, 2]], &[&[1e-6; 2]]);
        let long = served_as(&[&[1, 2, 3]], &[&[1e-6; 3]]);
        let parting = &partings(&short, &long)[0];
        assert_eq!((parting.decision, parting.margin), (3, f32::INFINITY));
    }

    #[test]
    fn summary_gives_mean_median_p99_and_max() {
        let values: Vec<f64> = (1..=101).map(f64::from).collect();
        assert_eq!(summary(values), [51.0, 51.0, 100.0, 101.0]);
    }

    #[test]
    fn numbers_repeat_from_a_seed_and_stay_below_the_bound() {
        let draw = |seed| {
            let mut numbers = Numbers::new(seed);
            (0..100).map(|_| numbers.below(7)).collect::<Vec<_>>()
        };
        assert_eq!(draw(1), draw(1));
        assert_ne!(draw(1), draw(2));
        assert!(draw(1).iter().all(|&n| n < 7));
    }
}
