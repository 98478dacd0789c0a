//! A small seeded random generator (SplitMix64): the training loader seeds one per example from
//! `(seed, epoch, index)`, so a resumed run draws the same data as an uninterrupted one.

use serde::{Deserialize, Serialize};

/// SplitMix64.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rng {
    state: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Fisher-Yates.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_roughly_uniform() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        let draws: Vec<usize> = (0..1000).map(|_| a.below(10)).collect();
        assert_eq!(draws, (0..1000).map(|_| b.below(10)).collect::<Vec<_>>());
        for digit in 0..10 {
            let count = draws.iter().filter(|&&d| d == digit).count();
            assert!((60..140).contains(&count), "digit {digit}: {count}");
        }
    }
}
