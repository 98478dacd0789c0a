//! burn-train data loaders over a task: training examples drawn afresh for every epoch, and the
//! fixed held-out examples.
//!
//! burn-train calls a loader's `iter` once per epoch. The training loader draws epoch `e`'s
//! examples from a generator seeded by `(seed, e, index)`, so that a run resumed at epoch `e`
//! sees exactly the data an uninterrupted run sees there, and a slice of it (one per device,
//! under burn-train's `MultiDevice` strategy) draws its own part of the same epoch.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::data::dataset::DatasetError;
use burn::tensor::Device;

use crate::data::{Batch, Scoring};
use crate::rng::Rng;
use crate::tasks::{Example, Task, sample_train};

/// Where a loader's examples come from.
#[derive(Clone)]
enum Examples {
    /// Drawn afresh for each epoch: `per_epoch` examples.
    Drawn {
        task: Arc<dyn Task>,
        seed: u64,
        /// The epoch the next `iter` call yields (burn-train numbers epochs from 1).
        next_epoch: Arc<AtomicUsize>,
    },
    /// The same every epoch.
    Fixed(Arc<Vec<Example>>),
}

/// Batches of a task's examples on one device.
#[derive(Clone)]
pub struct TaskLoader {
    examples: Examples,
    /// The examples of each epoch this loader yields (all of them, or a device's slice).
    range: Range<usize>,
    batch_size: usize,
    scoring: Scoring,
    device: Device,
}

impl TaskLoader {
    /// Training data: `batches_per_epoch` batches of `batch_size` fresh examples per epoch,
    /// starting at epoch `first_epoch`.
    pub fn training(
        task: Arc<dyn Task>,
        seed: u64,
        batch_size: usize,
        batches_per_epoch: usize,
        first_epoch: usize,
        device: &Device,
    ) -> Self {
        let scoring = Scoring::of(task.as_ref());
        Self {
            examples: Examples::Drawn {
                task,
                seed,
                next_epoch: Arc::new(AtomicUsize::new(first_epoch)),
            },
            range: 0..batch_size * batches_per_epoch,
            batch_size,
            scoring,
            device: device.clone(),
        }
    }

    /// Held-out data: `examples` in batches of `batch_size`, the same every epoch.
    pub fn held_out(
        task: &dyn Task,
        examples: Vec<Example>,
        batch_size: usize,
        device: &Device,
    ) -> Self {
        Self {
            range: 0..examples.len(),
            examples: Examples::Fixed(Arc::new(examples)),
            batch_size,
            scoring: Scoring::of(task),
            device: device.clone(),
        }
    }

    /// The examples of this epoch (advancing to the next for a drawn loader).
    fn epoch_examples(&self) -> Vec<Example> {
        match &self.examples {
            Examples::Drawn {
                task,
                seed,
                next_epoch,
            } => {
                let epoch = next_epoch.fetch_add(1, Ordering::SeqCst);
                self.range
                    .clone()
                    .map(|index| {
                        let mut rng = Rng::new(example_seed(*seed, epoch, index));
                        sample_train(task.as_ref(), &mut rng)
                    })
                    .collect()
            }
            Examples::Fixed(examples) => examples[self.range.clone()].to_vec(),
        }
    }
}

/// The generator seed of example `index` of `epoch`: SplitMix-mixed, so that neighbouring
/// indices and epochs get unrelated streams.
fn example_seed(seed: u64, epoch: usize, index: usize) -> u64 {
    let mut mix = Rng::new(seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let base = mix.next_u64();
    Rng::new(base ^ index as u64).next_u64()
}

impl DataLoader<Batch> for TaskLoader {
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<Batch> + 'a> {
        Box::new(BatchIterator {
            examples: self.epoch_examples(),
            position: 0,
            batch_size: self.batch_size,
            scoring: self.scoring,
            device: self.device.clone(),
        })
    }

    fn num_items(&self) -> usize {
        self.range.len()
    }

    fn to_device(&self, device: &Device) -> Arc<dyn DataLoader<Batch>> {
        let mut moved = self.clone();
        moved.device = device.clone();
        Arc::new(moved)
    }

    /// Items `start..end` of every epoch. A slice counts its own epochs from the epoch the
    /// loader is at, so that each device's slice of epoch `e` is drawn from epoch `e`.
    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<Batch>> {
        assert!(
            start <= end && end <= self.range.len(),
            "TaskLoader::slice: {start}..{end} is outside the loader's {} items",
            self.range.len()
        );
        let mut part = self.clone();
        part.range = self.range.start + start..self.range.start + end;
        if let Examples::Drawn { next_epoch, .. } = &mut part.examples {
            *next_epoch = Arc::new(AtomicUsize::new(next_epoch.load(Ordering::SeqCst)));
        }
        Arc::new(part)
    }
}

struct BatchIterator {
    examples: Vec<Example>,
    position: usize,
    batch_size: usize,
    scoring: Scoring,
    device: Device,
}

impl Iterator for BatchIterator {
    type Item = Result<Batch, DatasetError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.position >= self.examples.len() {
            return None;
        }
        let end = (self.position + self.batch_size).min(self.examples.len());
        let batch = Batch::new(
            &self.examples[self.position..end],
            self.scoring,
            &self.device,
        );
        self.position = end;
        Some(Ok(batch))
    }
}

impl DataLoaderIterator<Batch> for BatchIterator {
    fn progress(&self) -> Progress {
        Progress::new(self.position, self.examples.len(), Some("examples".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tasks::TaskKind;

    fn loader(first_epoch: usize) -> TaskLoader {
        let task: Arc<dyn Task> = TaskKind::Sort.build(6, 3).unwrap().into();
        TaskLoader::training(task, 7, 4, 3, first_epoch, &Device::flex())
    }

    fn targets(loader: &dyn DataLoader<Batch>) -> Vec<Vec<i64>> {
        loader.iter().map(|batch| batch.unwrap().targets).collect()
    }

    #[test]
    fn epochs_differ_and_a_resumed_loader_draws_the_same_epoch() {
        let whole = loader(1);
        let first = targets(&whole);
        let second = targets(&whole);
        assert_eq!(first.len(), 3, "three batches per epoch");
        assert_ne!(first, second, "every epoch draws new examples");
        assert_eq!(
            targets(&loader(2)),
            second,
            "resuming at epoch 2 draws epoch 2"
        );
    }

    #[test]
    fn slices_split_each_epoch_between_devices() {
        let whole = loader(1);
        let (left, right) = (whole.slice(0, 8), whole.slice(8, 12));
        assert_eq!((left.num_items(), right.num_items()), (8, 4));
        for _ in 0..2 {
            let expected: Vec<i64> = targets(&whole).concat();
            let parts = [
                targets(left.as_ref()).concat(),
                targets(right.as_ref()).concat(),
            ];
            assert_eq!(
                parts.concat(),
                expected,
                "the slices together are the epoch"
            );
        }
    }
}
