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

dispatch! {
    fn exp_shifted(values: &mut [f32], shift: f32) -> f32 {
        let mut lanes = [0.0f32; LANES];
        let mut chunks = values.chunks_exact_mut(LANES);
        for chunk in &mut chunks {
            for (lane, value) in lanes.iter_mut().zip(chunk.iter_mut()) {
                *value = exp::<FMA>(*value - shift);
                *lane += *value;
            }
        }
        let mut sum = 0.0;
        for value in chunks.into_remainder() {
            *value = exp::<FMA>(*value - shift);
            sum += *value;
        }
        sum + lanes.iter().sum::<f32>()
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

/// `e^x` to about 2 ulp (Cephes' `expf` polynomial after a base-2 range reduction), exactly 0
/// below `-87.3` (so `-inf` gives 0), saturating at `e^88`; branch-free and without a float to
/// integer cast (Rust's saturating `as` does not vectorise), so that it vectorises.
#[inline(always)]
fn exp<const FMA: bool>(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN_2_HI: f32 = 0.693_359_4;
    const LN_2_LO: f32 = -2.121_944_4e-4;
    // 1.5 · 2^23: adding it rounds to the nearest integer, which then sits in the low bits.
    const ROUND: f32 = 12_582_912.0;
    let clamped = x.clamp(-87.3, 88.0);
    let shifted = clamped * LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = clamped - n * LN_2_HI - n * LN_2_LO;
    let mut p = 1.987_569_1e-4;
    p = mul_add::<FMA>(p, r, 1.398_199_9e-3);
    p = mul_add::<FMA>(p, r, 8.333_452e-3);
    p = mul_add::<FMA>(p, r, 4.166_579_6e-2);
    p = mul_add::<FMA>(p, r, 1.666_666_5e-1);
    p = mul_add::<FMA>(p, r, 0.5);
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
