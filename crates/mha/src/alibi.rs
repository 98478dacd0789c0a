//! ALiBi (Press et al. 2022, "Train Short, Test Long"): a per-head linear penalty on the
//! distance between query and key, added to the scores instead of position embeddings.

use burn::tensor::{DType, Device, Tensor, TensorData};

use crate::mask::Positions;

/// The paper's head slopes: for `n` a power of two, the geometric sequence
/// `2^(-8/n), 2^(-16/n), …, 2^(-8)`; otherwise the slopes of the nearest lower power of two
/// followed by every other slope of the next power of two.
pub fn alibi_slopes(n_heads: usize) -> Vec<f64> {
    fn power_of_two_slopes(n: usize) -> Vec<f64> {
        let start = 2f64.powf(-8.0 / n as f64);
        (1..=n).map(|i| start.powi(i as i32)).collect()
    }
    if n_heads.is_power_of_two() {
        return power_of_two_slopes(n_heads);
    }
    let lower = 1usize << n_heads.ilog2();
    let mut slopes = power_of_two_slopes(lower);
    slopes.extend(
        power_of_two_slopes(2 * lower)
            .into_iter()
            .step_by(2)
            .take(n_heads - lower),
    );
    slopes
}

/// The additive bias `-slope_h · |query_position - key_position|`, `[1, n_heads, seq_q, seq_k]`,
/// for queries and keys from `positions` on (absolute positions, so that it holds under a
/// cache).
pub(crate) fn alibi_bias(
    n_heads: usize,
    positions: Positions,
    seq_q: usize,
    seq_k: usize,
    (device, dtype): (&Device, DType),
) -> Tensor<4> {
    let slopes = alibi_slopes(n_heads);
    let mut values = Vec::with_capacity(n_heads * seq_q * seq_k);
    for slope in &slopes {
        for q in 0..seq_q {
            for k in 0..seq_k {
                let distance = (positions.query + q).abs_diff(positions.key + k) as f64;
                values.push(-slope * distance);
            }
        }
    }
    Tensor::from_data(
        TensorData::new(values, [1, n_heads, seq_q, seq_k]),
        (device, dtype),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slopes_follow_the_paper() {
        let eight = alibi_slopes(8);
        let expected: Vec<f64> = (1..=8).map(|i| 0.5f64.powi(i)).collect();
        assert_eq!(eight, expected);
        // 6 heads: the 4-head slopes, then 2^-1 ... of the 8-head sequence at odd places.
        let six = alibi_slopes(6);
        assert_eq!(six.len(), 6);
        assert_eq!(&six[..4], &[0.25, 0.0625, 0.015625, 0.00390625]);
        assert_eq!(&six[4..], &[0.5, 0.125]);
    }

    #[test]
    fn bias_penalises_distance_per_head() {
        let positions = Positions { query: 3, key: 0 };
        let bias = alibi_bias(2, positions, 1, 4, (&Device::flex(), DType::F32));
        let values = bias.into_data().try_into_vec_as::<f32>().unwrap();
        // Head 0 slope 1/16... for 2 heads: 2^-4 and 2^-8.
        let (s0, s1) = (2f32.powi(-4), 2f32.powi(-8));
        assert_eq!(
            values,
            vec![
                -3.0 * s0,
                -2.0 * s0,
                -s0,
                0.0,
                -3.0 * s1,
                -2.0 * s1,
                -s1,
                0.0
            ]
        );
    }
}
