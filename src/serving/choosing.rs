//! How a serving example chooses each next token: greedily, by sampling, or by beam search,
//! each choice with the margin that tells a near tie.

use burn::tensor::Tensor;

use crate::ProgramOptions;

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
    /// Greedy decoding, or with `--temperature T` (positive and finite) tokens sampled at `T`
    /// with `seed`; another value exits with the usage.
    pub fn from_options(options: &ProgramOptions, seed: u64) -> Self {
        options
            .value("--temperature")
            .map_or(Decoding::Greedy, |value| match value.parse::<f32>() {
                Ok(temperature) if temperature > 0.0 && temperature.is_finite() => {
                    Decoding::Sampled { temperature, seed }
                }
                _ => options.fail(&format!(
                    "`--temperature` takes a positive number, not `{value}`"
                )),
            })
    }

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

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, TensorData};

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
}
