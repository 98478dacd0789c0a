//! ALiBi (Press et al. 2022, "Train Short, Test Long"): a per-head linear penalty on the
//! distance between query and key, added to the scores instead of position embeddings. The
//! kernels compute the penalty from the slopes ([`crate::rules::ScoreRules::bias`]).

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

/// [`alibi_slopes`] in f32, as the kernels add the penalty to f32 scores.
pub(crate) fn alibi_slopes_f32(n_heads: usize) -> Vec<f32> {
    alibi_slopes(n_heads)
        .into_iter()
        .map(|slope| slope as f32)
        .collect()
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
}
