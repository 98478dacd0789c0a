//! A seeded generator of the tests' own (SplitMix64), apart from Burn's: what a test draws from
//! it replays from its seed alone, whatever other tests draw.

use burn::tensor::{Device, Tensor, TensorData};

/// SplitMix64.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// One of `choices`.
    pub fn pick<T: Copy>(&mut self, choices: &[T]) -> T {
        choices[self.below(choices.len())]
    }

    pub fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u = ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let v = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    }

    pub fn tensor<const D: usize>(
        &mut self,
        shape: [usize; D],
        scale: f32,
        device: &Device,
    ) -> Tensor<D> {
        let count = shape.iter().product();
        let values: Vec<f32> = (0..count).map(|_| scale * self.normal()).collect();
        Tensor::from_data(TensorData::new(values, shape), device)
    }
}
