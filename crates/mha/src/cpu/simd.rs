//! Row kernels of the flex flash kernel — maximum, shifted exponential with its sum, dot
//! product, scaled copy, softmax gradient — written as fixed-width lane loops that the compiler vectorises,
//! compiled for AVX-512 and AVX2 + FMA and chosen at run time (as flex's GEMM is).

const LANES: usize = 16;

/// Runs `$body` (an expression over the function's arguments) in a copy compiled for the best
/// instruction set this CPU has. In the body, `FMA` says whether that copy has fused
/// multiply-adds ([`mul_add`]).
macro_rules! dispatch {
    (fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty $body:block) => {
        pub(crate) fn $name($($arg: $ty),*) -> $ret {
            #[inline(always)]
            fn portable<const FMA: bool>($($arg: $ty),*) -> $ret $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                fn avx512($($arg: $ty),*) -> $ret {
                    portable::<true>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) -> $ret {
                    portable::<true>($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has the features the function is compiled for.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: as above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            portable::<NATIVE_FMA>($($arg),*)
        }
    };
}

/// Whether the build's baseline instruction set has fused multiply-adds.
const NATIVE_FMA: bool = cfg!(any(target_feature = "fma", target_arch = "aarch64"));

/// `a · b + c`, fused where `FMA` (one instruction, one rounding), else a multiply and an add:
/// without the instruction `f32::mul_add` is a call into the maths library.
#[inline(always)]
fn mul_add<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

dispatch! {
    fn max(values: &[f32]) -> f32 {
        let mut lanes = [f32::NEG_INFINITY; LANES];
        let mut chunks = values.chunks_exact(LANES);
        for chunk in &mut chunks {
            for (lane, &value) in lanes.iter_mut().zip(chunk) {
                *lane = if value > *lane { value } else { *lane };
            }
        }
        let tail = chunks
            .remainder()
            .iter()
            .fold(f32::NEG_INFINITY, |max, &value| if value > max { value } else { max });
        lanes.iter().fold(tail, |max, &value| if value > max { value } else { max })
    }
}

/// Shifted exponentials below `e^FLUSH_BELOW` (2⁻⁵⁰ of the row's largest) are exactly 0 in
/// [`exp_shifted`].
///
/// Why: such a value, scaled by `1 / Σ` and multiplied in the kernels' GEMMs, makes subnormal
/// floats, on which x86 cores take a microcode assist per instruction. A one-thread `Pᵀ dO`
/// GEMM of `[4096, 128] · [128, 64]` ran 1.2x slower with 0.1% of `P` subnormal, 2.5x with 1%
/// and 17x with 10%; ALiBi's distant keys (a band of `87 / slope` keys per row) made a causal
/// training step at 4096 tokens 2.4x the plain one. What is dropped is at most `seq_k · 2⁻⁵⁰`
/// of a row's mass (its largest term is 1): below f32's resolution under 2²⁶ keys.
pub(crate) const FLUSH_BELOW: f32 = -34.65;

/// `values ← e^(values - shift)`, 0 below `e^FLUSH_BELOW` ([`FLUSH_BELOW`]), returning their
/// sum: on AVX-512 with its `scalef` and `roundscale` instructions ([`avx512::exp_shifted`]),
/// elsewhere the lane loop [`exp_shifted_lanes`]. Every score of a call goes through the same
/// one, so the backward's recomputed probabilities are the forward's to the last bit.
pub(crate) fn exp_shifted(values: &mut [f32], shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has the feature the function is compiled for.
        return unsafe { avx512::exp_shifted(values, shift) };
    }
    exp_shifted_lanes(values, shift)
}

dispatch! {
    fn exp_shifted_lanes(values: &mut [f32], shift: f32) -> f32 {
        let mut lanes = [0.0f32; LANES];
        let mut chunks = values.chunks_exact_mut(LANES);
        for chunk in &mut chunks {
            for (lane, value) in lanes.iter_mut().zip(chunk.iter_mut()) {
                *value = flushed_exp::<FMA>(*value - shift);
                *lane += *value;
            }
        }
        let mut sum = 0.0;
        for value in chunks.into_remainder() {
            *value = flushed_exp::<FMA>(*value - shift);
            sum += *value;
        }
        sum + lanes.iter().sum::<f32>()
    }
}

/// The exponential on AVX-512 registers.
///
/// Why not the lane loop: compiled for AVX-512 it spends about 25 instructions on 16
/// exponentials (the clamps, the exponent's bit arithmetic, the blend that zeroes
/// underflows), 7.6% of a forward at (8, 128, 256, 8); `vscalefps` builds `p · 2ⁿ` and
/// `vroundscaleps` rounds `n` in one instruction each, and a zeroing mask replaces the blend.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{EXP_POLYNOMIAL, LANES, LN_2_HI, LN_2_LO};

    /// [`super::exp_shifted`] on AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) fn exp_shifted(values: &mut [f32], shift: f32) -> f32 {
        let shift = _mm512_set1_ps(shift);
        let mut sums = _mm512_setzero_ps();
        let mut chunks = values.chunks_exact_mut(LANES);
        for chunk in &mut chunks {
            // SAFETY: `chunk` holds exactly `LANES` (16) floats, the 64 bytes read and written.
            unsafe {
                let exponentials = exp(_mm512_sub_ps(_mm512_loadu_ps(chunk.as_ptr()), shift));
                _mm512_storeu_ps(chunk.as_mut_ptr(), exponentials);
                sums = _mm512_add_ps(sums, exponentials);
            }
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            // The first `tail.len()` (< 16) lanes.
            let lanes: __mmask16 = (1u16 << tail.len()) - 1;
            // SAFETY: the masked load and store touch only the lanes in `lanes`, which are the
            // tail's elements; masked-off lanes are neither read nor written (no fault either).
            unsafe {
                let values = _mm512_maskz_loadu_ps(lanes, tail.as_ptr());
                let exponentials = _mm512_maskz_mov_ps(lanes, exp(_mm512_sub_ps(values, shift)));
                _mm512_mask_storeu_ps(tail.as_mut_ptr(), lanes, exponentials);
                sums = _mm512_add_ps(sums, exponentials);
            }
        }
        _mm512_reduce_add_ps(sums)
    }

    /// `e^x` per lane with the lane loop's polynomial and range reduction (so within the same
    /// few ulp), exactly 0 below [`super::FLUSH_BELOW`] (so `-inf` gives 0), saturating at
    /// `e^88`, NaN kept.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp(x: __m512) -> __m512 {
        const LOG2_E: f32 = std::f32::consts::LOG2_E;
        // Lanes not below the flush threshold, NaN included (unordered compares true).
        let kept = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, _mm512_set1_ps(super::FLUSH_BELOW));
        // `min` returns its second operand when one is NaN: NaN stays NaN.
        let x = _mm512_min_ps(_mm512_set1_ps(88.0), x);
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN_2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN_2_LO), r);
        let mut p = _mm512_set1_ps(EXP_POLYNOMIAL[0]);
        for coefficient in &EXP_POLYNOMIAL[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*coefficient));
        }
        let p = _mm512_add_ps(
            _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r),
            _mm512_set1_ps(1.0),
        );
        _mm512_maskz_scalef_ps(kept, p, n)
    }
}

dispatch! {
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        let mut lanes = [0.0f32; LANES];
        let mut chunks_a = a.chunks_exact(LANES);
        let mut chunks_b = b.chunks_exact(LANES);
        for (chunk_a, chunk_b) in (&mut chunks_a).zip(&mut chunks_b) {
            for ((lane, x), y) in lanes.iter_mut().zip(chunk_a).zip(chunk_b) {
                *lane += x * y;
            }
        }
        let tail: f32 = chunks_a
            .remainder()
            .iter()
            .zip(chunks_b.remainder())
            .map(|(x, y)| x * y)
            .sum();
        tail + lanes.iter().sum::<f32>()
    }
}

dispatch! {
    fn scaled_copy(destination: &mut [f32], source: &[f32], factor: f32) -> () {
        for (out, &value) in destination.iter_mut().zip(source) {
            *out = value * factor;
        }
    }
}

dispatch! {
    fn softmax_grad(probability_grads: &mut [f32], probabilities: &[f32], row_dot: f32) -> () {
        for (grad, &p) in probability_grads.iter_mut().zip(probabilities) {
            *grad = p * (*grad - row_dot);
        }
    }
}

dispatch! {
    fn add_distance_penalty(scores: &mut [f32], first_distance: f32, negative_slope: f32) -> () {
        // Lane `i` of chunk `c` is key `16c + i`, at distance `first_distance - (16c + i)`;
        // every term is an integer below 2²⁴, so exact in f32, as the scalar rule's `as f32`.
        let mut offsets = [0.0f32; LANES];
        for (lane, offset) in offsets.iter_mut().enumerate() {
            *offset = lane as f32;
        }
        let mut chunks = scores.chunks_exact_mut(LANES);
        let mut first = first_distance;
        for chunk in &mut chunks {
            for (score, offset) in chunk.iter_mut().zip(offsets) {
                *score += negative_slope * (first - offset).abs();
            }
            first -= LANES as f32;
        }
        for (score, offset) in chunks.into_remainder().iter_mut().zip(offsets) {
            *score += negative_slope * (first - offset).abs();
        }
    }
}

dispatch! {
    fn soft_cap(scores: &mut [f32], cap: f32) -> () {
        for score in scores.iter_mut() {
            *score = cap * tanh::<FMA>(*score / cap);
        }
    }
}

dispatch! {
    fn soft_cap_with_derivatives(scores: &mut [f32], derivatives: &mut [f32], cap: f32) -> () {
        for (score, derivative) in scores.iter_mut().zip(derivatives.iter_mut()) {
            let tanh = tanh::<FMA>(*score / cap);
            *score = cap * tanh;
            *derivative = 1.0 - tanh * tanh;
        }
    }
}

/// Rows of [`weighted_row_sums`] summed in one pass over the value rows: their accumulators
/// for [`VALUE_COLUMNS`] columns fill 16 of AVX-512's 32 registers.
const WEIGHTED_ROWS: usize = 4;
/// Columns of the value rows one pass of [`weighted_row_sums`] reads.
const VALUE_COLUMNS: usize = 4 * LANES;

/// `outputs` row `r` ← `Σ_k weights[r][k] · values[k · value_stride..][..width]`, with `width =
/// outputs.len() / weights.len()`: the `P V` of several query rows that share their value rows
/// (the query heads of a key/value head in a decoding step), reading each value row once for
/// four of them where a matrix product per query head reads all of them per head.
///
/// # Panics
///
/// If `outputs` is not `weights.len()` rows, the weight rows differ in length, or `values`
/// holds fewer rows than there are weights per row.
pub(crate) fn weighted_row_sums(
    outputs: &mut [f32],
    weights: &[&[f32]],
    values: &[f32],
    value_stride: usize,
) {
    let Some(first) = weights.first() else {
        assert!(
            outputs.is_empty(),
            "weighted_row_sums: outputs without weights"
        );
        return;
    };
    let (count, width) = (first.len(), outputs.len() / weights.len());
    assert!(
        outputs.len() == weights.len() * width && weights.iter().all(|w| w.len() == count),
        "weighted_row_sums: {} outputs for {} weight rows of {count}",
        outputs.len(),
        weights.len()
    );
    assert!(
        count == 0 || width == 0 || (count - 1) * value_stride + width <= values.len(),
        "weighted_row_sums: {count} value rows of {width} (stride {value_stride}) need more \
         than {} values",
        values.len()
    );
    weighted_row_sums_checked(outputs, weights, values, value_stride, width);
}

dispatch! {
    fn weighted_row_sums_checked(
        outputs: &mut [f32],
        weights: &[&[f32]],
        values: &[f32],
        value_stride: usize,
        width: usize
    ) -> () {
        for (block, block_weights) in outputs
            .chunks_mut(WEIGHTED_ROWS * width)
            .zip(weights.chunks(WEIGHTED_ROWS))
        {
            let mut start = 0;
            while start < width {
                let columns = VALUE_COLUMNS.min(width - start);
                let value_row = |key: usize| &values[key * value_stride + start..][..columns];
                let mut sums = [[0.0f32; VALUE_COLUMNS]; WEIGHTED_ROWS];
                if columns == VALUE_COLUMNS {
                    // Fixed-length rows, so that the sums stay in registers.
                    for key in 0..block_weights[0].len() {
                        let value: &[f32; VALUE_COLUMNS] =
                            value_row(key).try_into().expect("a whole chunk");
                        for (row, sums) in sums.iter_mut().enumerate() {
                            if let Some(weights) = block_weights.get(row) {
                                let weight = weights[key];
                                for (sum, &value) in sums.iter_mut().zip(value) {
                                    *sum = mul_add::<FMA>(weight, value, *sum);
                                }
                            }
                        }
                    }
                } else {
                    for key in 0..block_weights[0].len() {
                        let value = value_row(key);
                        for (sums, weights) in sums.iter_mut().zip(block_weights) {
                            let weight = weights[key];
                            for (sum, &value) in sums.iter_mut().zip(value) {
                                *sum = mul_add::<FMA>(weight, value, *sum);
                            }
                        }
                    }
                }
                for (row, sums) in block.chunks_exact_mut(width).zip(&sums) {
                    row[start..start + columns].copy_from_slice(&sums[..columns]);
                }
                start += columns;
            }
        }
    }
}

/// `tanh x` to a few ulp, ±1 at ±∞, NaN kept: Cephes' `tanhf` (an odd polynomial below
/// `|x| = 0.625`, `1 - 2 / (e^{2|x|} + 1)` above), branch-free so that it vectorises, where
/// `f32::tanh` is a call into the maths library per element.
#[inline(always)]
fn tanh<const FMA: bool>(x: f32) -> f32 {
    let magnitude = x.abs();
    let squared = x * x;
    let mut p = -5.704_988_7e-3;
    p = mul_add::<FMA>(p, squared, 2.063_909e-2);
    p = mul_add::<FMA>(p, squared, -5.373_971_6e-2);
    p = mul_add::<FMA>(p, squared, 1.333_144_2e-1);
    p = mul_add::<FMA>(p, squared, -3.333_328e-1);
    let small = mul_add::<FMA>(p * squared, x, x);
    let large = (1.0 - 2.0 / (exp::<FMA>(2.0 * magnitude) + 1.0)).copysign(x);
    if magnitude < 0.625 { small } else { large }
}

/// `e^x`, 0 below `e^FLUSH_BELOW` ([`FLUSH_BELOW`]), NaN kept.
#[inline(always)]
fn flushed_exp<const FMA: bool>(x: f32) -> f32 {
    if x < FLUSH_BELOW { 0.0 } else { exp::<FMA>(x) }
}

/// `ln 2` split in two (Cephes' `expf`): `n · LN_2_HI` is exact for the `n` an `f32` exponential
/// reaches, so `x - n · ln 2` keeps its low bits.
const LN_2_HI: f32 = 0.693_359_4;
const LN_2_LO: f32 = -2.121_944_4e-4;
/// Cephes' `expf` polynomial, highest degree first: `e^r ≈ 1 + r + r² · P(r)` on `|r| ≤ ln 2 / 2`.
const EXP_POLYNOMIAL: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `e^x` to about 2 ulp (Cephes' `expf` polynomial after a base-2 range reduction), exactly 0
/// below `-87.3` (so `-inf` gives 0), saturating at `e^88`; branch-free and without a float to
/// integer cast (Rust's saturating `as` does not vectorise), so that it vectorises.
#[inline(always)]
fn exp<const FMA: bool>(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // 1.5 · 2^23: adding it rounds to the nearest integer, which then sits in the low bits.
    const ROUND: f32 = 12_582_912.0;
    let clamped = x.clamp(-87.3, 88.0);
    let shifted = clamped * LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = clamped - n * LN_2_HI - n * LN_2_LO;
    let mut p = EXP_POLYNOMIAL[0];
    for coefficient in &EXP_POLYNOMIAL[1..] {
        p = mul_add::<FMA>(p, r, *coefficient);
    }
    let p = mul_add::<FMA>(p, r * r, r) + 1.0;
    // 2^n from n's bits: (n + 127) << 23, with n = bits(shifted) - bits(ROUND).
    let exponent = shifted
        .to_bits()
        .wrapping_sub(ROUND.to_bits())
        .wrapping_add(127)
        << 23;
    let two_to_n = f32::from_bits(exponent);
    if x < -87.3 { 0.0 } else { p * two_to_n }
}

#[cfg(test)]
mod tests {
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
}
