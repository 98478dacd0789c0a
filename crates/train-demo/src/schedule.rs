//! The learning-rate schedule, as a burn-train scheduler: linear warm-up over the first tenth
//! of the steps (at most 100), then cosine decay to 5% of the peak.

use burn::optim::LearningRate;
use burn::optim::lr_scheduler::{LrScheduler, LrSchedulerRecord};

/// Warm-up then cosine decay over `steps` optimizer steps; its record is the step count, so a
/// resumed run continues the schedule where the checkpoint left it.
#[derive(Debug, Clone)]
pub struct WarmupCosine {
    peak: LearningRate,
    steps: usize,
    /// Steps taken.
    step: usize,
}

impl WarmupCosine {
    pub fn new(peak: LearningRate, steps: usize) -> Self {
        Self {
            peak,
            steps,
            step: 0,
        }
    }

    /// The rate of step `step` (0-based).
    pub fn rate(&self, step: usize) -> LearningRate {
        let warmup = (self.steps / 10).clamp(1, 100);
        if step < warmup {
            return self.peak * (step + 1) as f64 / warmup as f64;
        }
        let progress = (step - warmup) as f64 / (self.steps - warmup).max(1) as f64;
        let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos());
        self.peak * (0.05 + 0.95 * cosine)
    }
}

const STEP: &str = "step";

impl LrScheduler for WarmupCosine {
    fn step(&mut self) -> LearningRate {
        let rate = self.rate(self.step);
        self.step += 1;
        rate
    }

    fn to_record(&self) -> LrSchedulerRecord {
        LrSchedulerRecord::new().with_scalar(STEP, self.step as u64)
    }

    fn load_record(&mut self, record: LrSchedulerRecord) {
        self.step = record
            .scalar::<u64>(STEP)
            .expect("a warm-up/cosine scheduler record holds its step")
            as usize;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warms_up_decays_and_resumes_where_it_stopped() {
        let mut schedule = WarmupCosine::new(1e-3, 1000);
        let rates: Vec<f64> = (0..1000).map(|_| schedule.step()).collect();
        assert!((rates[0] - 1e-5).abs() < 1e-12, "first warm-up step");
        assert!((rates[99] - 1e-3).abs() < 1e-12, "peak after 100 steps");
        assert!(
            (rates[999] - 5e-5).abs() < 1e-6,
            "5% of the peak at the end"
        );
        assert!(rates[100..].windows(2).all(|w| w[1] <= w[0]), "decays");

        let mut first = WarmupCosine::new(1e-3, 1000);
        (0..400).for_each(|_| {
            first.step();
        });
        let mut resumed = WarmupCosine::new(1e-3, 1000);
        resumed.load_record(first.to_record());
        assert_eq!(resumed.step(), rates[400]);
    }
}
