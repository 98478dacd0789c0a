//! Each request's decoding: a beam search, greedy with one beam.

use std::hash::{DefaultHasher, Hash, Hasher};

use burn_mha::serving::{Beam, Decision, best_continuations};

/// A request's beam search as it goes: its beams, best first, and the decisions that kept them.
pub(crate) struct Search {
    pub(crate) width: usize,
    pub(crate) beams: Vec<Beam>,
    /// Each step's: the set of beams it kept, by the margin of its
    /// [`Survivors`](burn_mha::serving::Survivors).
    pub(crate) decisions: Vec<Decision>,
}

impl Search {
    pub(crate) fn new(width: usize) -> Self {
        Self {
            width,
            beams: vec![Beam::start()],
            decisions: Vec::new(),
        }
    }

    /// Every beam's next token from its row of `log_probs`; returns each survivor's parent.
    pub(crate) fn step(&mut self, log_probs: &[f32]) -> Vec<usize> {
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
    /// one beam, which beam is best, by its lead over the next.
    pub(crate) fn result(self) -> (Vec<i64>, Vec<Decision>) {
        let Self {
            width,
            mut beams,
            mut decisions,
        } = self;
        if width > 1 {
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
