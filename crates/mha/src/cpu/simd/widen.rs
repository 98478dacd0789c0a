//! Stored elements widened to f32 a row at a time: f16 and i8 with its row's scale, for the
//! caches that store keys and values in them. Loops the compiler vectorises (the f16 conversion
//! in integer operations, where `f16::to_f32` is a call per element that checks the CPU).

use burn::tensor::f16;

use super::NATIVE_FMA;

/// The f32 of f16 `bits`, exactly `f16::to_f32`'s (a NaN stays a NaN, its payload aside), in
/// operations without branches: the exponent rebiased, infinities and NaNs moved to f32's
/// largest exponent, subnormals normalised by one subtraction (exact: the result is an f32).
#[inline(always)]
pub(crate) fn half_bits_to_f32(bits: u16) -> f32 {
    /// 2⁻¹⁴, f16's smallest normal.
    const MAGIC: f32 = f32::from_bits(113 << 23);
    /// f16's exponent field where the shift below puts it.
    const SHIFTED_EXPONENT: u32 = 0x7c00 << 13;
    let half = u32::from(bits);
    let shifted = (half & 0x7fff) << 13;
    let exponent = shifted & SHIFTED_EXPONENT;
    let rebiased = shifted + ((127 - 15) << 23);
    let magnitude = if exponent == SHIFTED_EXPONENT {
        f32::from_bits(rebiased + ((128 - 16) << 23))
    } else if exponent == 0 {
        f32::from_bits(rebiased + (1 << 23)) - MAGIC
    } else {
        f32::from_bits(rebiased)
    };
    f32::from_bits(magnitude.to_bits() | ((half & 0x8000) << 16))
}

dispatch! {
    fn widen_half(destination: &mut [f32], source: &[f16]) -> () {
        assert_eq!(destination.len(), source.len(), "widen_half: lengths differ");
        for (out, half) in destination.iter_mut().zip(source) {
            *out = half_bits_to_f32(half.to_bits());
        }
    }
}

dispatch! {
    fn dequantize_row(destination: &mut [f32], source: &[i8], scale: f32) -> () {
        assert_eq!(destination.len(), source.len(), "dequantize_row: lengths differ");
        for (out, &value) in destination.iter_mut().zip(source) {
            *out = f32::from(value) * scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every f16, normal, subnormal, zero, infinite and NaN, widened as `f16::to_f32` does.
    #[test]
    fn every_half_widens_as_the_half_crate_does() {
        let halves: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let mut widened = vec![0.0f32; halves.len()];
        widen_half(&mut widened, &halves);
        for (half, value) in halves.iter().zip(&widened) {
            let expected = half.to_f32();
            if expected.is_nan() {
                assert!(value.is_nan(), "{:#06x}: {value}", half.to_bits());
            } else {
                assert_eq!(
                    value.to_bits(),
                    expected.to_bits(),
                    "{:#06x}: {value} against {expected}",
                    half.to_bits()
                );
            }
        }
    }

    /// Each i8 times the scale, as the tensor ops' cast and multiply give it.
    #[test]
    fn int8_rows_are_their_values_times_the_scale() {
        let values: Vec<i8> = (i8::MIN..=i8::MAX).collect();
        let scale = 0.037_f32;
        let mut widened = vec![0.0f32; values.len()];
        dequantize_row(&mut widened, &values, scale);
        for (&value, &out) in values.iter().zip(&widened) {
            assert_eq!(
                out.to_bits(),
                (f32::from(value) * scale).to_bits(),
                "{value}"
            );
        }
    }
}
