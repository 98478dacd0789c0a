//! Rotary position embeddings (RoPE, Su et al. 2021) applied to query and key heads.

use burn::config::Config;
use burn::tensor::{DType, Device, Tensor, TensorData};

/// Which features of a head form the rotated pairs.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Adjacent features `(x[2i], x[2i+1])`: RoFormer, GPT-J, Meta's LLaMA code and Burn's
    /// `RotaryEncoding`.
    Interleaved,
    /// The two halves `(x[i], x[i + d/2])`: GPT-NeoX and Hugging Face's Llama (`rotate_half`).
    /// Weights from a Hugging Face checkpoint use this layout.
    HalfSplit,
}

/// Rotary position embeddings for [`MultiHeadAttentionConfig::rope`](crate::MultiHeadAttentionConfig::rope).
///
/// Pair `i` of a head at position `p` is rotated by the angle `p · theta^(-2i / head_dim)`,
/// in queries and keys alike, after projection and before the scores; the score of a query at
/// `m` and a key at `n` then depends on their positions only through `m - n`.
#[derive(Config, Debug, PartialEq)]
pub struct RopeConfig {
    /// Base of the rotation frequencies. Default: 10000.
    #[config(default = 10000.0)]
    pub theta: f64,
    /// The pair layout. Default: [`RopeLayout::Interleaved`].
    #[config(default = "RopeLayout::Interleaved")]
    pub layout: RopeLayout,
}

/// `cos` and `sin` of the angles of `positions` (`[seq, head_dim / 2]` each), in `dtype`.
fn angles(
    theta: f64,
    head_dim: usize,
    start: usize,
    seq: usize,
    (device, dtype): (&Device, DType),
) -> (Tensor<2>, Tensor<2>) {
    let half = head_dim / 2;
    let mut cos = Vec::with_capacity(seq * half);
    let mut sin = Vec::with_capacity(seq * half);
    for position in start..start + seq {
        for pair in 0..half {
            let frequency = theta.powf(-2.0 * pair as f64 / head_dim as f64);
            let angle = position as f64 * frequency;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    (
        Tensor::from_data(TensorData::new(cos, [seq, half]), (device, dtype)),
        Tensor::from_data(TensorData::new(sin, [seq, half]), (device, dtype)),
    )
}

impl RopeConfig {
    /// Rotates `x` (`[batch, heads, seq, head_dim]`) whose first position is `start`.
    ///
    /// # Panics
    ///
    /// Panics if `head_dim` is odd (the configuration refuses that earlier).
    pub fn apply(&self, x: Tensor<4>, start: usize) -> Tensor<4> {
        let [batch, heads, seq, head_dim] = x.dims();
        assert!(
            head_dim.is_multiple_of(2),
            "RoPE needs an even head_dim, got {head_dim}"
        );
        let half = head_dim / 2;
        let (cos, sin) = angles(self.theta, head_dim, start, seq, (&x.device(), x.dtype()));
        let cos = cos.reshape([1, 1, seq, half]);
        let sin = sin.reshape([1, 1, seq, half]);
        match self.layout {
            RopeLayout::Interleaved => {
                let pairs = x.reshape([batch, heads, seq, half, 2]);
                let even = pairs
                    .clone()
                    .narrow(4, 0, 1)
                    .reshape([batch, heads, seq, half]);
                let odd = pairs.narrow(4, 1, 1).reshape([batch, heads, seq, half]);
                let rotated_even = even.clone() * cos.clone() - odd.clone() * sin.clone();
                let rotated_odd = odd * cos + even * sin;
                Tensor::stack::<5>(vec![rotated_even, rotated_odd], 4)
                    .reshape([batch, heads, seq, head_dim])
            }
            RopeLayout::HalfSplit => {
                let first = x.clone().narrow(3, 0, half);
                let second = x.narrow(3, half, half);
                let rotated_first = first.clone() * cos.clone() - second.clone() * sin.clone();
                let rotated_second = second * cos + first * sin;
                Tensor::cat(vec![rotated_first, rotated_second], 3)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Tolerance;

    fn x(device: &Device) -> Tensor<4> {
        Tensor::<1>::from_data([5.0, 6.0, 7.0, 8.0], device).reshape([1, 1, 1, 4])
    }

    #[test]
    fn interleaved_matches_burns_rotary_encoding_reference() {
        // Burn's RotaryEncoding test: position 1 of [5, 6, 7, 8] is
        // [5cos1 - 6sin1, 6cos1 + 5sin1, 7cos(0.01) - 8sin(0.01), 8cos(0.01) + 7sin(0.01)].
        let device = Device::flex();
        let rotated = RopeConfig::new().apply(x(&device), 1);
        let (c1, s1, c2, s2) = (1f32.cos(), 1f32.sin(), 0.01f32.cos(), 0.01f32.sin());
        let expected = [[[[
            5.0 * c1 - 6.0 * s1,
            6.0 * c1 + 5.0 * s1,
            7.0 * c2 - 8.0 * s2,
            8.0 * c2 + 7.0 * s2,
        ]]]];
        rotated
            .into_data()
            .assert_approx_eq::<f32>(&expected.into(), Tolerance::absolute(1e-5));
    }

    /// The interleaved layout is Burn's `RotaryEncoding`, run as Burn runs it, at every offset.
    #[test]
    fn interleaved_equals_burns_rotary_encoding_module() {
        use burn::nn::RotaryEncodingConfig;
        use burn::tensor::Distribution;
        let device = Device::flex();
        let x = Tensor::<4>::random([2, 3, 5, 8], Distribution::Normal(0.0, 1.0), &device);
        let burns = RotaryEncodingConfig::new(32, 8).init(&device);
        for start in [0, 1, 7, 20] {
            let ours = RopeConfig::new().apply(x.clone(), start);
            ours.into_data().assert_approx_eq::<f32>(
                &burns.apply(x.clone(), start).into_data(),
                Tolerance::absolute(1e-5),
            );
        }
    }

    #[test]
    fn half_split_rotates_the_two_halves_together() {
        let device = Device::flex();
        let rotated = RopeConfig::new()
            .with_layout(RopeLayout::HalfSplit)
            .apply(x(&device), 1);
        let (c1, s1, c2, s2) = (1f32.cos(), 1f32.sin(), 0.01f32.cos(), 0.01f32.sin());
        // Pairs (x0, x2) at frequency 1 and (x1, x3) at frequency 0.01.
        let expected = [[[[
            5.0 * c1 - 7.0 * s1,
            6.0 * c2 - 8.0 * s2,
            7.0 * c1 + 5.0 * s1,
            8.0 * c2 + 6.0 * s2,
        ]]]];
        rotated
            .into_data()
            .assert_approx_eq::<f32>(&expected.into(), Tolerance::absolute(1e-5));
    }

    #[test]
    fn position_zero_is_the_identity() {
        let device = Device::flex();
        for layout in [RopeLayout::Interleaved, RopeLayout::HalfSplit] {
            let rotated = RopeConfig::new().with_layout(layout).apply(x(&device), 0);
            rotated
                .into_data()
                .assert_approx_eq::<f32>(&x(&device).into_data(), Tolerance::absolute(1e-6));
        }
    }
}
