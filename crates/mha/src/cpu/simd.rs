//! Row kernels of the flex flash kernel — maximum, shifted exponential with its sum, dot
//! product, scaled copy, softmax gradient — written as fixed-width lane loops that the compiler vectorises,
//! compiled for AVX-512 and AVX2 + FMA and chosen at run time (as flex's GEMM is), by
//! [`cpu_capability`](super::cpu_capability) (which `MHA_CPU_CAPABILITY` can cap).

const LANES: usize = 16;

/// Runs `$body` (an expression over the function's arguments) in the copy compiled for the
/// instruction set [`cpu_capability`](super::cpu_capability) says. In the body, `FMA` says
/// whether that copy has fused multiply-adds ([`mul_add`]).
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
                // F16C too (every AVX2 CPU has it), for the f16 conversions inlined here.
                #[target_feature(enable = "avx2,fma,f16c")]
                fn avx2($($arg: $ty),*) -> $ret {
                    portable::<true>($($arg),*)
                }
                match $crate::cpu::cpu_capability() {
                    // SAFETY: `cpu_capability` says AVX-512 only where the CPU has AVX-512F.
                    $crate::cpu::CpuCapability::Avx512 => return unsafe { avx512($($arg),*) },
                    // SAFETY: and AVX2 only where it has AVX2, FMA and F16C.
                    $crate::cpu::CpuCapability::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::cpu::CpuCapability::Default => {}
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
    if super::cpu_capability() == super::CpuCapability::Avx512 {
        // SAFETY: `cpu_capability` says AVX-512 only where the CPU has AVX-512F.
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
    pub(super) fn exp(x: __m512) -> __m512 {
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

/// The sum of `lanes` by halving (8 + 8, 4 + 4, …): four vector adds where a left-to-right sum
/// is fifteen dependent scalar ones, which made the score loops latency-bound.
#[inline(always)]
fn lane_sum(mut lanes: [f32; LANES]) -> f32 {
    let mut half = LANES / 2;
    while half > 0 {
        for lane in 0..half {
            lanes[lane] += lanes[lane + half];
        }
        half /= 2;
    }
    lanes[0]
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

dispatch! {
    fn gelu(values: &mut [f32], tanh_approximation: bool) -> () {
        if tanh_approximation {
            for value in values.iter_mut() {
                *value *= tanh_gate::<FMA>(*value).gate;
            }
        } else {
            for value in values.iter_mut() {
                *value *= normal_cdf::<FMA>(*value);
            }
        }
    }
}

dispatch! {
    fn gelu_grad(grads: &mut [f32], inputs: &[f32], tanh_approximation: bool) -> () {
        const INV_SQRT_2PI: f32 = 0.398_942_3;
        if tanh_approximation {
            for (grad, &x) in grads.iter_mut().zip(inputs) {
                let TanhGate { gate, slope } = tanh_gate::<FMA>(x);
                // d/dx [x · σ(2u)] = σ + x · σ (1 - σ) · 2u'.
                *grad *= mul_add::<FMA>(x * gate * (1.0 - gate), 2.0 * slope, gate);
            }
        } else {
            for (grad, &x) in grads.iter_mut().zip(inputs) {
                let density = INV_SQRT_2PI * exp::<FMA>(-0.5 * x * x);
                *grad *= mul_add::<FMA>(x, density, normal_cdf::<FMA>(x));
            }
        }
    }
}

/// The tanh approximation's gate `(1 + tanh u) / 2 = σ(2u)`, `u = √(2/π) (x + 0.044715 x³)`,
/// and `u'`.
struct TanhGate {
    gate: f32,
    slope: f32,
}

/// [`TanhGate`] of `x`, the gate as `1 / (1 + e^(-2u))` (no `1 + tanh` to lose the small values'
/// digits for `x < 0`).
#[inline(always)]
fn tanh_gate<const FMA: bool>(x: f32) -> TanhGate {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const CUBIC: f32 = 0.044_715;
    let squared = x * x;
    let u = SQRT_2_OVER_PI * mul_add::<FMA>(CUBIC * squared, x, x);
    TanhGate {
        gate: 1.0 / (1.0 + exp::<FMA>(-2.0 * u)),
        slope: SQRT_2_OVER_PI * mul_add::<FMA>(3.0 * CUBIC, squared, 1.0),
    }
}

/// Φ(x), the standard normal distribution function, `erfc(-x/√2) / 2`, through Numerical
/// Recipes' `erfcc` (fractional error below 1.2e-7 in exact arithmetic): for `x < 0` it is
/// computed directly, not as `1 + erf` (whose sum loses the small values' digits).
#[inline(always)]
fn normal_cdf<const FMA: bool>(x: f32) -> f32 {
    const COEFFICIENTS: [f32; 10] = [
        0.170_872_77,
        -0.822_152_23,
        1.488_515_9,
        -1.135_204,
        0.278_868_07,
        -0.186_288_06,
        0.096_784_18,
        0.374_091_96,
        1.000_023_7,
        -1.265_512_2,
    ];
    let z = (x * std::f32::consts::FRAC_1_SQRT_2).abs();
    let t = 1.0 / mul_add::<FMA>(0.5, z, 1.0);
    let mut p = COEFFICIENTS[0];
    for coefficient in &COEFFICIENTS[1..] {
        p = mul_add::<FMA>(p, t, *coefficient);
    }
    // Φ(-|x|) = erfc(|x|/√2) / 2.
    let tail = 0.5 * t * exp::<FMA>(mul_add::<FMA>(-z, z, p));
    if x < 0.0 { tail } else { 1.0 - tail }
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

/// Asks the CPU to bring the first `len` elements of `values` (or all, if fewer) into its
/// caches: a hint, with no effect on results.
pub(crate) fn prefetch<T>(values: &[T], len: usize) {
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (values, len);
    #[cfg(target_arch = "x86_64")]
    {
        // One request per 64-byte cache line.
        let per_line = (64 / std::mem::size_of::<T>().max(1)).max(1);
        for line in values[..len.min(values.len())].chunks(per_line) {
            // SAFETY: prefetching never faults and reads no value; the address is in `values`.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    line.as_ptr().cast(),
                )
            };
        }
    }
}

/// Bytes in a cache line: what [`prefetch_line`] asks for, and where the caches' buffers on flex
/// start (`cpu/aligned.rs`).
pub(crate) const CACHE_LINE: usize = 64;

/// Asks the CPU for the cache line at `address`, into L2: a request for L1 holds one of the
/// few L1 fill buffers until its line arrives, and the loads of the work under way wait for
/// them (a tile streamed from memory through [`Ahead`] took 10-25% longer with L1 requests on
/// an Intel Xeon).
#[inline(always)]
pub(crate) fn prefetch_line(address: *const u8) {
    #[cfg(not(target_arch = "x86_64"))]
    let _ = address;
    // SAFETY: a prefetch reads no value and never faults, whatever the address.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(address.cast())
    };
}

mod key_dots;
mod online;
mod widen;
pub(crate) use key_dots::{key_dots, takes as key_dots_take};
pub(crate) use online::{
    Ahead, KeyTile, LogitRule, OnlineRow, RUN_BLOCK_POSITIONS, RUN_BLOCKS, TileScales,
    attend_half_run, attend_half_tile, attend_int8_run, attend_int8_tile, attend_run, attend_tile,
    runs_read_whole,
};
pub(crate) use widen::{dequantize_row, widen_half};

#[cfg(test)]
mod tests;
