//! Early stopping on held-out exact match, as a burn-train strategy.

use burn::train::EarlyStoppingStrategy;
use burn::train::metric::store::{Aggregate, EventStoreClient, Split};

use crate::step::EXACT_MATCH;

/// Stops once an epoch's held-out exact match reaches `target` percent, or after `limit`
/// epochs in this process (`--stop-after-epochs`: the epoch is checkpointed first).
#[derive(Debug, Clone)]
pub struct ExactMatchReached {
    /// Percent; above 100, never.
    pub target: f64,
    pub limit: Option<usize>,
    epochs_run: usize,
}

impl ExactMatchReached {
    pub fn new(target: f64, limit: Option<usize>) -> Self {
        Self {
            target,
            limit,
            epochs_run: 0,
        }
    }

    /// Whether an epoch with this exact match (percent) ends the run.
    fn reached(&mut self, exact_match: Option<f64>) -> bool {
        self.epochs_run += 1;
        self.limit.is_some_and(|limit| self.epochs_run >= limit)
            || exact_match.is_some_and(|value| value >= self.target)
    }
}

impl EarlyStoppingStrategy for ExactMatchReached {
    fn should_stop(&mut self, epoch: usize, store: &EventStoreClient) -> bool {
        let exact_match = store.find_metric(EXACT_MATCH, epoch, Aggregate::Mean, &Split::Valid);
        self.reached(exact_match)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stops_at_the_target_or_the_epoch_limit() {
        let mut strategy = ExactMatchReached::new(99.0, None);
        assert!(!strategy.reached(Some(98.9)));
        assert!(!strategy.reached(None), "no value: keep going");
        assert!(strategy.reached(Some(99.0)));
        let mut limited = ExactMatchReached::new(101.0, Some(2));
        assert!(
            !limited.reached(Some(100.0)),
            "a target above 100 is never reached"
        );
        assert!(limited.reached(Some(0.0)), "second epoch of two");
    }
}
