//! Each request's decoding: a beam search (greedy with one beam), or sampling.

use std::hash::{DefaultHasher, Hash, Hasher};

use burn_mha::serving::{Beam, Decision, Decoding, TokenSlot, best_continuations, draw, sample};

/// A request's decoding as it goes: its beams, best first, and the decisions that kept them.
pub(crate) struct Search {
    /// The request, by its index in the stream: what a sampled token's draw is for.
    request: usize,
    width: usize,
    decoding: Decoding,
    pub(crate) beams: Vec<Beam>,
    /// Each step's: the set of beams it kept, by the margin of its
    /// [`Survivors`](burn_mha::serving::Survivors), or the token sampled.
    decisions: Vec<Decision>,
}

impl Search {
    /// Request `request`'s search of `width` beams, each step keeping the best continuations
    /// (greedy with one beam); or, with `Decoding::Sampled`, its one beam's tokens sampled.
    ///
    /// # Panics
    ///
    /// If `width` is 0, or above 1 with sampling.
    pub(crate) fn new(request: usize, width: usize, decoding: Decoding) -> Self {
        assert!(
            width == 1 || (width > 1 && decoding == Decoding::Greedy),
            "Search::new: a search samples one beam, and keeps at least one"
        );
        Self {
            request,
            width,
            decoding,
            beams: vec![Beam::start()],
            decisions: Vec::new(),
        }
    }

    /// Every beam's next token from its row of `log_probs`; returns each survivor's parent.
    pub(crate) fn step(&mut self, log_probs: &[f32]) -> Vec<usize> {
        if let Decoding::Sampled { temperature, seed } = self.decoding {
            // The draw depends on the request and the token's place only, not on the batch:
            // the log-probabilities are the logits less one number, so the same softmax.
            let slot = TokenSlot {
                request: self.request,
                index: self.generated(),
            };
            let choice = sample(log_probs, temperature, draw(seed, slot));
            let beam = &mut self.beams[0];
            beam.tokens.push(choice.token);
            beam.score += log_probs[choice.token as usize];
            self.decisions.push(choice.decision());
            return vec![0];
        }
        let survivors = best_continuations(&self.beams, log_probs, self.width);
        self.beams = survivors.beams;
        // The set kept, not its order: two ways may order beams of about equal scores apart
        // and still keep the same ones (which is best is the last decision's).
        let mut kept: Vec<&[i64]> = self.beams.iter().map(|b| b.tokens.as_slice()).collect();
        kept.sort_unstable();
        self.decisions.push(Decision {
            chosen: fingerprint(&kept),
            margin: survivors.margin,
        });
        survivors.parents
    }

    /// Tokens generated so far by each beam.
    pub(crate) fn generated(&self) -> usize {
        self.beams[0].tokens.len()
    }

    /// The best beam's tokens, and the search's decisions: each step's, then, with more than
    /// one beam, which beam is best, by its lead over the next. Leaves the search empty.
    pub(crate) fn result(&mut self) -> (Vec<i64>, Vec<Decision>) {
        let mut beams = std::mem::take(&mut self.beams);
        let mut decisions = std::mem::take(&mut self.decisions);
        if self.width > 1 {
            let lead = beams
                .get(1)
                .map_or(f32::INFINITY, |next| beams[0].score - next.score);
            decisions.push(Decision {
                chosen: fingerprint(&beams[0].tokens),
                margin: lead,
            });
        }
        (beams.swap_remove(0).tokens, decisions)
    }
}

/// A fingerprint of `value`, equal for equal values: what a [`Decision`] chose.
pub(crate) fn fingerprint(value: &impl Hash) -> u64 {
    let mut hasher = DefaultHasher::new();
    value.hash(&mut hasher);
    hasher.finish()
}
