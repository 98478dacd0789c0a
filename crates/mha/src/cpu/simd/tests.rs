//! The row kernels against scalar references.

use super::*;

#[test]
fn exp_shifted_is_within_a_few_ulp_of_std_on_every_copy_and_tail_length() {
    type ExpShifted = fn(&mut [f32], f32) -> f32;
    // On an AVX-512 machine the first is the `scalef` kernel, the second the lane loop.
    let copies: [(&str, ExpShifted); 2] =
        [("dispatched", exp_shifted), ("lanes", exp_shifted_lanes)];
    let shift = 0.5;
    let grid: Vec<f32> = (-87_000..=87_999)
        .map(|i| i as f32 * 1e-3 + shift)
        .collect();
    for (copy, exp_shifted) in copies {
        let mut values = grid.clone();
        let sum = exp_shifted(&mut values, shift);
        let mut worst: f32 = 0.0;
        for (&ours, &x) in values.iter().zip(&grid) {
            if x - shift < FLUSH_BELOW {
                assert_eq!(ours, 0.0, "{copy}: e^{} is flushed", x - shift);
                continue;
            }
            assert!(ours.is_normal(), "{copy}: e^{} gave {ours}", x - shift);
            let reference = (x - shift).exp();
            worst = worst.max(((ours - reference) / reference).abs());
        }
        assert!(worst < 3e-7, "{copy}: relative error {worst}");
        assert_eq!(sum, f32::INFINITY, "{copy}: the sum of e^87 and more");
        let mut softmax_row: Vec<f32> = (-20_000..=0).map(|i| i as f32 * 1e-3).collect();
        let sum = exp_shifted(&mut softmax_row, 0.0);
        let expected_sum: f64 = softmax_row.iter().map(|&v| v as f64).sum();
        assert!(
            ((sum as f64 - expected_sum) / expected_sum).abs() < 1e-6,
            "{copy}: sum"
        );
        // Every tail length, with what must be exactly 0 or stay NaN in each lane.
        for length in 0..=2 * LANES + 1 {
            let specials = [f32::NEG_INFINITY, -100.0, f32::NAN, 0.0, 1.5, -34.7, -34.6];
            let row: Vec<f32> = (0..length).map(|i| specials[i % specials.len()]).collect();
            let mut out = row.clone();
            let sum = exp_shifted(&mut out, 0.0);
            for (&x, &y) in row.iter().zip(&out) {
                match x {
                    x if x.is_nan() => assert!(y.is_nan(), "{copy}: NaN gave {y}"),
                    x if x < FLUSH_BELOW => assert_eq!(y, 0.0, "{copy}: e^{x}"),
                    x => assert!((y - x.exp()).abs() <= 1e-6 * x.exp(), "{copy}: e^{x}"),
                }
            }
            assert_eq!(sum.is_nan(), length > 2, "{copy}: sum of {length}");
        }
    }
}

#[test]
fn distance_penalty_equals_the_scalar_alibi_formula_for_every_tail_length() {
    for length in 0..=2 * LANES + 3 {
        let row: Vec<f32> = (0..length).map(|i| ((i * 37) % 11) as f32 - 5.0).collect();
        for first in [-20i64, 0, 7, 100] {
            let mut ours = row.clone();
            add_distance_penalty(&mut ours, first as f32, -0.25);
            for (key, (&ours, &score)) in ours.iter().zip(&row).enumerate() {
                let distance = (first - key as i64).abs();
                assert_eq!(
                    ours,
                    score + -0.25 * distance as f32,
                    "key {key} of {length}"
                );
            }
        }
    }
}

#[test]
fn soft_cap_is_within_a_few_ulp_of_std_tanh_with_its_derivative() {
    let specials = [
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        1e-30,
        -3e-5,
        2000.0,
    ];
    let grid: Vec<f32> = (-4000..=4000)
        .map(|i| i as f32 * 0.05)
        .chain(specials)
        .collect();
    for cap in [30.0f32, 1.0] {
        let mut capped = grid.clone();
        soft_cap(&mut capped, cap);
        let mut with_derivatives = grid.clone();
        let mut derivatives = vec![f32::NAN; grid.len()];
        soft_cap_with_derivatives(&mut with_derivatives, &mut derivatives, cap);
        for (i, &x) in grid.iter().enumerate() {
            let tanh = (x as f64 / cap as f64).tanh();
            let reference = cap as f64 * tanh;
            let error = (capped[i] as f64 - reference).abs();
            assert!(
                error <= 5e-7 * reference.abs(),
                "cap {cap}: {x} gave {}",
                capped[i]
            );
            assert_eq!(capped[i].to_bits(), with_derivatives[i].to_bits(), "{x}");
            let derivative_error = (derivatives[i] as f64 - (1.0 - tanh * tanh)).abs();
            assert!(derivative_error <= 1e-6, "cap {cap}: derivative at {x}");
        }
        let mut nan = [f32::NAN; 3];
        soft_cap(&mut nan, cap);
        assert!(nan.iter().all(|x| x.is_nan()), "NaN kept");
    }
}

#[test]
fn exp_is_within_a_few_ulp_of_std_and_zero_at_minus_infinity() {
    type Exp = fn(f32) -> f32;
    let copies: [(&str, Exp); 2] = [("plain", exp::<false>), ("fused", exp::<true>)];
    for (copy, exp) in copies {
        let mut worst: f32 = 0.0;
        for i in -87_000..=87_999 {
            let x = i as f32 * 1e-3;
            let (ours, reference) = (exp(x), x.exp());
            worst = worst.max(((ours - reference) / reference).abs());
        }
        assert!(worst < 3e-7, "{copy}: relative error {worst}");
        assert_eq!(exp(f32::NEG_INFINITY), 0.0, "{copy}");
        assert_eq!(exp(-100.0), 0.0, "{copy}");
    }
}

/// Every row count around the four-row block, widths around the 64-column chunk, a value
/// stride wider than the rows, and no weights at all, against an f64 sum.
#[test]
fn weighted_row_sums_match_a_scalar_sum() {
    for rows in [1, 3, 4, 5, 9] {
        for width in [1, 17, 64, 80, 130] {
            for count in [0, 1, 7, 33] {
                let stride = width + 3;
                let values: Vec<f32> = (0..count * stride)
                    .map(|i| ((i * 7919) % 113) as f32 * 0.05 - 2.0)
                    .collect();
                let weights: Vec<Vec<f32>> = (0..rows)
                    .map(|r| {
                        (0..count)
                            .map(|k| ((r * 31 + k * 17) % 23) as f32 * 0.1)
                            .collect()
                    })
                    .collect();
                let weight_rows: Vec<&[f32]> = weights.iter().map(Vec::as_slice).collect();
                let mut outputs = vec![f32::NAN; rows * width];
                weighted_row_sums(&mut outputs, &weight_rows, &values, stride);
                for (r, row) in outputs.chunks_exact(width).enumerate() {
                    for (c, &ours) in row.iter().enumerate() {
                        let expected: f64 = (0..count)
                            .map(|k| weights[r][k] as f64 * values[k * stride + c] as f64)
                            .sum();
                        assert!(
                            (ours as f64 - expected).abs() <= 1e-4 * (1.0 + expected.abs()),
                            "rows {rows}, width {width}, count {count}: [{r}][{c}] {ours} \
                             against {expected}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
#[should_panic(expected = "value rows")]
fn weighted_row_sums_refuse_too_few_value_rows() {
    let weights = [1.0f32; 4];
    weighted_row_sums(&mut [0.0; 8], &[&weights, &weights], &[0.0; 15], 4);
}

#[test]
fn row_kernels_match_scalar_loops() {
    let values: Vec<f32> = (0..37)
        .map(|i| ((i * 7919) % 101) as f32 * 0.1 - 5.0)
        .collect();
    let expected_max = values.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    assert_eq!(max(&values), expected_max);
    let mut shifted = values.clone();
    let sum = exp_shifted(&mut shifted, expected_max);
    let expected: Vec<f32> = values.iter().map(|v| (v - expected_max).exp()).collect();
    for (a, b) in shifted.iter().zip(&expected) {
        assert!((a - b).abs() <= 1e-6 * b.abs().max(1e-30), "{a} vs {b}");
    }
    assert!((sum - expected.iter().sum::<f32>()).abs() < 1e-5);
    let dot_expected: f32 = values.iter().zip(&expected).map(|(a, b)| a * b).sum();
    assert!((dot(&values, &expected) - dot_expected).abs() < 1e-4);
    let mut copied = vec![0.0; values.len() + 3];
    scaled_copy(&mut copied[1..], &values, 0.25);
    assert_eq!(copied[0], 0.0);
    for (c, v) in copied[1..].iter().zip(&values) {
        assert_eq!(*c, v * 0.25);
    }
    let mut grads = values.clone();
    softmax_grad(&mut grads, &expected, 0.5);
    for ((g, v), p) in grads.iter().zip(&values).zip(&expected) {
        assert_eq!(*g, p * (v - 0.5));
    }
}
