//! What the serving examples (`serve`, `serve_encoder_decoder`) share: a deterministic stream
//! of numbers for their requests, greedy and sampled choices with the margin that tells a near
//! tie, what serving a stream one way measured and its table row, and the check that two ways
//! gave every request the same tokens.

use std::time::Duration;

use burn::nn::Embedding;
use burn::tensor::{Device, Int, Tensor, TensorData};

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

/// A choice of the next token, and the margin it was chosen by: two ways that compute the same
/// logits to within rounding may choose apart only where this margin is about as small as the
/// rounding.
#[derive(Debug, Clone, Copy)]
pub struct Choice {
    /// The token chosen.
    pub token: i64,
    /// Greedy ([`greedy`]): its logit less the runner-up's. Sampled ([`sample`]): how far the
    /// uniform number lay from the nearest boundary of two tokens' cumulative probabilities,
    /// in the same units.
    pub margin: f32,
}

impl Choice {
    /// The decision it is: the token, by the margin.
    pub fn decision(&self) -> Decision {
        Decision {
            chosen: self.token as u64,
            margin: self.margin,
        }
    }
}

/// One decision of a request's decoding, as two ways that should decide alike are compared: a
/// fingerprint of what was chosen (a greedy or sampled step's token, the set of beams a beam
/// step kept) and the margin it was chosen by (the score of the last candidate chosen less the
/// best one left out; a sampled token's as [`sample`] gives it). Two ways that compute the same
/// scores to within rounding may decide apart only where that margin is about as small as the
/// rounding.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// What was chosen; equal for equal choices.
    pub chosen: u64,
    /// The score of the last candidate chosen less the best one's left out, or a sampled
    /// choice's margin ([`sample`]).
    pub margin: f32,
}

/// Each row's greedy choice of `logits` (`[rows, vocab]`).
///
/// # Panics
///
/// If the logits are not f32.
pub fn greedy(logits: Tensor<2>) -> Vec<Choice> {
    let [_, vocab] = logits.dims();
    let logits = logits.into_data().try_to_vec::<f32>().expect("f32 logits");
    logits
        .chunks_exact(vocab)
        .map(|row| {
            let (mut best, mut second) = ((0, f32::NEG_INFINITY), f32::NEG_INFINITY);
            for (token, &logit) in row.iter().enumerate() {
                if logit > best.1 {
                    second = best.1;
                    best = (token, logit);
                } else if logit > second {
                    second = logit;
                }
            }
            Choice {
                token: best.0 as i64,
                margin: best.1 - second,
            }
        })
        .collect()
}

/// How a serving example picks each next token: greedily, or by sampling at a temperature
/// with a seed of its own per request, so that a request's tokens do not depend on which other
/// requests it was batched with (vLLM's per-request seed).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decoding {
    /// The largest logit's token ([`greedy`]).
    Greedy,
    /// A token drawn from `softmax(logits / temperature)` with the uniform number [`draw`]
    /// gives the request and the token's place in its answer.
    Sampled {
        /// Divides the logits: below 1 sharper than the model's distribution, above 1 flatter.
        temperature: f32,
        /// The stream's seed, mixed with each request's index.
        seed: u64,
    },
}

/// Which token of which request a row of logits decides: what [`Decoding::Sampled`] draws
/// for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenSlot {
    /// The request, by its index in the stream.
    pub request: usize,
    /// The token's place in the request's answer (0: its first).
    pub index: usize,
}

impl Decoding {
    /// Each row's choice of `logits` (`[rows, vocab]`), row `i` deciding `slots[i]`.
    ///
    /// # Panics
    ///
    /// If the logits are not f32, or `slots` does not name one slot per row.
    pub fn choose(&self, logits: Tensor<2>, slots: &[TokenSlot]) -> Vec<Choice> {
        let [rows, vocab] = logits.dims();
        assert_eq!(
            slots.len(),
            rows,
            "Decoding::choose: `slots` must name one slot per row of `logits`"
        );
        match *self {
            Decoding::Greedy => greedy(logits),
            Decoding::Sampled { temperature, seed } => {
                let logits = logits.into_data().try_to_vec::<f32>().expect("f32 logits");
                logits
                    .chunks_exact(vocab)
                    .zip(slots)
                    .map(|(row, &slot)| sample(row, temperature, draw(seed, slot)))
                    .collect()
            }
        }
    }
}

/// The uniform number in `[0, 1)` that [`Decoding::Sampled`] with `seed` draws for `slot`: a
/// hash of the three (SplitMix64's finaliser), not a stream's next number, so that it does not
/// depend on the order in which a way decides its requests' tokens.
pub fn draw(seed: u64, slot: TokenSlot) -> f64 {
    let mut mixed = seed;
    for part in [slot.request as u64, slot.index as u64] {
        mixed = mixed.wrapping_add(part).wrapping_add(0x9e37_79b9_7f4a_7c15);
        mixed = (mixed ^ (mixed >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        mixed ^= mixed >> 31;
    }
    // The top 53 bits: every double in [0, 1) a multiple of 2⁻⁵³ is as likely.
    (mixed >> 11) as f64 / (1u64 << 53) as f64
}

/// The token of `logits` that `uniform` picks from `softmax(logits / temperature)`: the first
/// whose cumulative probability passes it.
///
/// The choice's margin is in the greedy margin's units, so that [`NEAR_TIE`] means the same
/// for both: where `uniform` lies a distance `d` from a boundary of cumulative probability `C`
/// between two tokens' shares of `[0, 1)`, moving every logit by at most `δ` moves that
/// boundary by at most `C (1 - C) · 2δ / temperature`, so the choice can change only if `δ` is
/// at least half of `d · temperature / (C (1 - C))`, the margin (the nearer boundary's), as a
/// greedy choice changes only if `δ` is at least half of its two logits' difference. The ends
/// of `[0, 1)` are no boundaries: rounding does not move them (an infinite margin there).
///
/// # Panics
///
/// If `temperature` is not positive and finite, `logits` holds no finite logit, or `uniform`
/// is not in `[0, 1)`.
pub fn sample(logits: &[f32], temperature: f32, uniform: f64) -> Choice {
    assert!(
        temperature > 0.0 && temperature.is_finite(),
        "sample: `temperature` must be positive and finite, not {temperature}"
    );
    assert!(
        (0.0..1.0).contains(&uniform),
        "sample: `uniform` must be in [0, 1), not {uniform}"
    );
    let largest = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    assert!(
        largest.is_finite(),
        "sample: `logits` must hold a finite logit"
    );
    let temperature = f64::from(temperature);
    let weights: Vec<f64> = logits
        .iter()
        .map(|&logit| ((f64::from(logit) - f64::from(largest)) / temperature).exp())
        .collect();
    // Summed in the loop's order: the last share with any weight ends exactly at `total`, past
    // `uniform · total` for every `uniform` below 1.
    let total: f64 = weights.iter().sum();
    let target = uniform * total;
    let margin_to = |boundary: f64| {
        let cumulative = boundary / total;
        let spread = cumulative * (1.0 - cumulative);
        if spread > 0.0 {
            (target - boundary).abs() / total * temperature / spread
        } else {
            f64::INFINITY
        }
    };
    let mut below = 0.0;
    for (token, &weight) in weights.iter().enumerate() {
        let above = below + weight;
        if target < above {
            return Choice {
                token: token as i64,
                margin: margin_to(below).min(margin_to(above)) as f32,
            };
        }
        below = above;
    }
    unreachable!("the last share with any weight ends at the sum of the weights")
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

/// One hypothesis of a beam search: its tokens so far and the sum of their log-probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct Beam {
    /// The tokens it generated.
    pub tokens: Vec<i64>,
    /// Their log-probabilities, summed.
    pub score: f32,
}

impl Beam {
    /// A search's one beam before its first token.
    pub fn start() -> Self {
        Self {
            tokens: Vec::new(),
            score: 0.0,
        }
    }
}

/// The beams that survive a step of beam search, best first.
#[derive(Debug, Clone, PartialEq)]
pub struct Survivors {
    /// Each survivor's parent: its index among the beams the step continued.
    pub parents: Vec<usize>,
    /// The survivors, each its parent's tokens and one more.
    pub beams: Vec<Beam>,
    /// The last survivor's score less the best score left out (infinite when none was): two
    /// ways that compute the same log-probabilities to within rounding may keep different beams
    /// only where this is about as small as the rounding. With one beam, greedy decoding's
    /// margin between the two largest logits.
    pub margin: f32,
}

/// One step of beam search: the `width` best continuations of `beams` by the sum of their
/// log-probabilities, `log_probs` holding each beam's next-token log-probabilities (`[beams,
/// vocab]`, row by row). Of equal scores, the earlier beam's, then the lower token, goes first.
///
/// # Panics
///
/// If `width` is 0, `beams` is empty, or `log_probs` is not a whole row per beam.
pub fn best_continuations(beams: &[Beam], log_probs: &[f32], width: usize) -> Survivors {
    assert!(width > 0, "best_continuations: `width` must be at least 1");
    assert!(
        !beams.is_empty() && log_probs.len().is_multiple_of(beams.len()),
        "best_continuations: `log_probs` holds {} values, not a row per beam of {}",
        log_probs.len(),
        beams.len()
    );
    let vocab = log_probs.len() / beams.len();
    let mut candidates: Vec<(usize, usize, f32)> = log_probs
        .iter()
        .enumerate()
        .map(|(i, &log_prob)| (i / vocab, i % vocab, beams[i / vocab].score + log_prob))
        .collect();
    // A stable sort: equal scores keep the beam-then-token order.
    candidates.sort_by(|a, b| b.2.total_cmp(&a.2));
    let kept = width.min(candidates.len());
    let margin = candidates.get(kept).map_or(f32::INFINITY, |left_out| {
        candidates[kept - 1].2 - left_out.2
    });
    let (parents, beams) = candidates[..kept]
        .iter()
        .map(|&(parent, token, score)| {
            let mut tokens = beams[parent].tokens.clone();
            tokens.push(token as i64);
            (parent, Beam { tokens, score })
        })
        .unzip();
    Survivors {
        parents,
        beams,
        margin,
    }
}

/// A [`Decision::margin`] below which two ways that compute the same scores to within rounding
/// may decide apart: two logits, or two beams' sums of up to a few hundred log-probabilities,
/// each about 1e-5 apart between the two ways (a sampled choice's margin is in the same
/// units, [`sample`]).
pub const NEAR_TIE: f32 = 1e-3;

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
    fn sampled_tokens_come_as_often_as_their_probabilities() {
        let logits = [0.0f32, 1.0, 2.0, -1.0];
        let temperature = 0.7;
        let draws = 40_000;
        let mut counts = [0usize; 4];
        for index in 0..draws {
            let uniform = draw(5, TokenSlot { request: 3, index });
            counts[sample(&logits, temperature, uniform).token as usize] += 1;
        }
        let weights: Vec<f64> = logits
            .iter()
            .map(|&logit| (f64::from(logit) / f64::from(temperature)).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        for (token, (&count, weight)) in counts.iter().zip(&weights).enumerate() {
            let expected = weight / total * draws as f64;
            // Five standard deviations of a binomial count.
            let spread = 5.0 * (expected * (1.0 - weight / total)).sqrt();
            assert!(
                (count as f64 - expected).abs() < spread,
                "token {token}: {count} draws, {expected:.0} expected"
            );
        }
    }

    #[test]
    fn a_sampled_choice_is_by_the_uniform_number_and_its_margin_the_distance_to_a_boundary() {
        // Probabilities 1/4, 1/4, 1/2: boundaries at 0.25 (C (1 - C) = 3/16) and 0.5 (1/4); the
        // ends 0 and 1 are none. A margin: the distance to the nearer boundary · T / C (1 - C).
        let logits = [0.0f32, 0.0, std::f32::consts::LN_2];
        for (uniform, token, margin) in [
            (0.0, 0, 0.25 / (3.0 / 16.0)),
            (0.24, 0, 0.01 / (3.0 / 16.0)),
            (0.3, 1, 0.05 / (3.0 / 16.0)),
            (0.49, 1, 0.01 / 0.25),
            (0.9, 2, 0.4 / 0.25),
        ] {
            let choice = sample(&logits, 1.0, uniform);
            assert_eq!(choice.token, token, "{uniform}");
            assert!(
                (f64::from(choice.margin) - margin).abs() < 1e-5,
                "{uniform}: {choice:?}, {margin}"
            );
        }
        // The same draw at twice the temperature: the same logits halved, the margin in the
        // logits' units.
        let halved = logits.map(|logit| logit / 2.0);
        let choice = sample(&halved, 0.5, 0.49);
        assert!((f64::from(choice.margin) - 0.02).abs() < 1e-5, "{choice:?}");
        // A token of no probability is never chosen, and the first and last with any are
        // not near a boundary at the ends.
        let gaps = [
            f32::NEG_INFINITY,
            0.0,
            f32::NEG_INFINITY,
            0.0,
            f32::NEG_INFINITY,
        ];
        let first = sample(&gaps, 1.0, 0.0);
        assert_eq!((first.token, first.margin), (1, 2.0));
        let last = sample(&gaps, 1.0, 1.0 - f64::EPSILON);
        assert_eq!(last.token, 3);
        assert!((last.margin - 2.0).abs() < 1e-6, "{last:?}");
        // A low temperature picks the largest logit whatever the draw.
        assert_eq!(sample(&[0.0, 3.0, 1.0], 0.05, 0.999).token, 1);
    }

    #[test]
    fn draws_depend_on_the_slot_alone_and_lie_in_the_unit_interval() {
        let slot = TokenSlot {
            request: 7,
            index: 2,
        };
        assert_eq!(draw(1, slot), draw(1, slot));
        let others = [
            draw(2, slot),
            draw(
                1,
                TokenSlot {
                    request: 2,
                    index: 7,
                },
            ),
            draw(
                1,
                TokenSlot {
                    request: 7,
                    index: 3,
                },
            ),
        ];
        assert!(others.iter().all(|&other| other != draw(1, slot)));
        let mean = (0..10_000)
            .map(|index| draw(9, TokenSlot { request: 0, index }))
            .inspect(|uniform| assert!((0.0..1.0).contains(uniform)))
            .sum::<f64>()
            / 10_000.0;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
    }

    #[test]
    fn greedy_decoding_chooses_as_greedy_and_sampling_by_the_slot() {
        let device = Device::flex();
        // The same three logits in 64 rows, each row another request's slot.
        let row = [0.0f32, 1.0, 0.5];
        let logits = Tensor::<2>::from_data(TensorData::new(row.repeat(64), [64, 3]), &device);
        let slots: Vec<TokenSlot> = (0..64)
            .map(|request| TokenSlot { request, index: 4 })
            .collect();
        let tokens = |choices: Vec<Choice>| choices.iter().map(|c| c.token).collect::<Vec<_>>();
        assert_eq!(
            tokens(Decoding::Greedy.choose(logits.clone(), &slots)),
            vec![1; 64]
        );
        let sampled = tokens(
            Decoding::Sampled {
                temperature: 1.5,
                seed: 11,
            }
            .choose(logits, &slots),
        );
        let expected: Vec<i64> = slots
            .iter()
            .map(|&slot| sample(&row, 1.5, draw(11, slot)).token)
            .collect();
        assert_eq!(sampled, expected);
        // Each token's probability is at least 0.23: every one is drawn.
        assert!((0..3).all(|token| sampled.contains(&token)), "{sampled:?}");
    }

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

    #[test]
    fn greedy_takes_each_rows_largest_logit_and_its_margin() {
        let logits = Tensor::<2>::from_floats([[1.0, 3.0, 2.0], [5.0, 4.0, 4.5]], &Device::flex());
        let choices = greedy(logits);
        assert_eq!(choices.iter().map(|c| c.token).collect::<Vec<_>>(), [1, 0]);
        assert_eq!(
            choices.iter().map(|c| c.margin).collect::<Vec<_>>(),
            [1.0, 0.5]
        );
    }

    #[test]
    fn beam_steps_keep_the_best_continuations_of_every_beam() {
        let first = best_continuations(&[Beam::start()], &[-1.0, -0.5, -3.0], 2);
        assert_eq!(first.parents, [0, 0]);
        assert_eq!(
            first.beams,
            [
                Beam {
                    tokens: vec![1],
                    score: -0.5
                },
                Beam {
                    tokens: vec![0],
                    score: -1.0
                }
            ]
        );
        assert_eq!(first.margin, 2.0);
        // Beam 1's best continuation (-1.0 - 0.25) beats beam 0's best (-0.5 - 1.0); three
        // continuations tie at -1.5 (beam 0's tokens 0 and 2, beam 1's token 0): the earlier
        // beam's go first, lower token first, and the one left out ties the last kept.
        let log_probs = [-1.0, -2.0, -1.0, -0.5, -0.25, -3.0];
        let second = best_continuations(&first.beams, &log_probs, 3);
        assert_eq!(second.parents, [1, 0, 0]);
        let tokens: Vec<_> = second.beams.iter().map(|b| b.tokens.clone()).collect();
        assert_eq!(tokens, [vec![0, 1], vec![1, 0], vec![1, 2]]);
        assert_eq!(second.margin, 0.0);
        // One beam is greedy decoding: the largest logit's token, its margin over the next.
        let greedy = best_continuations(&[Beam::start()], &[-2.0, -0.5, -1.25], 1);
        assert_eq!(
            (greedy.beams[0].tokens.clone(), greedy.margin),
            (vec![1], 0.75)
        );
        // All kept: nothing left out.
        assert_eq!(
            best_continuations(&[Beam::start()], &[-1.0], 2).margin,
            f32::INFINITY
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
