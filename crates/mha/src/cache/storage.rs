//! How a cache holds keys and values ([`CacheStorage`]): f16's range check, int8's
//! quantization, and the conversions back to the module's float type. Shared by
//! [`KvCache`](super::KvCache) and the paged cache's block stores.

use burn::tensor::{DType, Device, FloatDType, Int, IntDType, Tensor};

/// How a [`KvCache`](super::KvCache) stores keys and values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CacheStorage {
    /// In the module's float type (the default).
    #[default]
    Float,
    /// int8, with one f32 scale per position and head (`max |x| / 127`): 1 + 4 / head_dim
    /// bytes per element instead of 4 (3.76 times as many positions in the same memory at a
    /// head width of 64). The step's own new keys are used unquantized.
    ///
    /// On flex and ndarray (an f32 module, outside autodiff) a decoding step of a `KvCache`
    /// (at most 32 new rows, causal or one row; no attention mask; padding only at the front
    /// of each batch element; no `add_bias_kv`/`add_zero_attn`; no pinned sinks; `Auto` path,
    /// no weights) reads the i8 keys and values where they lie, converted as they are read;
    /// other steps and backends dequantize the cache for the step (on flex and ndarray in one
    /// pass with the step's rows). `PagedKvCache` reads its blocks in place likewise.
    Int8,
    /// f16 (IEEE half precision): half the bytes of f32, a relative rounding of at most
    /// 2^-11 per element. A step whose new keys or values reach beyond f16's range (±65504)
    /// is refused ([`CacheError::BeyondHalfRange`](super::CacheError::BeyondHalfRange)), not
    /// stored as infinities. Read in place where [`CacheStorage::Int8`] is (flex only),
    /// widened to the module's type for the step elsewhere.
    /// Where the module's float type is f16 already, the same as [`CacheStorage::Float`].
    /// Backends without f16 tensors (ndarray) refuse it.
    Half,
}

/// The largest magnitude f16 holds.
pub(crate) const HALF_MAX: f32 = 65504.0;

/// The largest finite magnitude among `tensors` if it is beyond f16's range: what
/// [`CacheStorage::Half`] refuses to store (as an infinity). `None` when f16 holds every
/// finite element. Elements already infinite or NaN are left out (f16 keeps them as they are,
/// and the attention propagates them, as in f32), so that they cannot hide a finite one
/// beyond the range elsewhere in the step.
pub(crate) fn beyond_half_range(tensors: [&Tensor<4>; 2]) -> Option<f32> {
    tensors
        .into_iter()
        .map(|tensor| {
            let magnitudes = tensor.clone().abs();
            let finite = magnitudes.clone().is_finite();
            magnitudes
                .mask_fill(finite.bool_not(), 0.0)
                .max()
                .into_scalar::<f32>()
        })
        .find(|largest| *largest > HALF_MAX)
}

/// Whether `device` holds tensors stored as `storage` says (i8 for int8, f16 for half), and
/// if not, why.
pub(crate) fn storage_unsupported(storage: CacheStorage, device: &Device) -> Option<String> {
    let (dtype, name) = match storage {
        CacheStorage::Float => return None,
        CacheStorage::Int8 => (DType::I8, "i8"),
        CacheStorage::Half => (DType::F16, "f16"),
    };
    (!device.supports_dtype(dtype))
        .then(|| format!("{device:?} has no {name} tensors; use CacheStorage::Float"))
}

/// `tensor` in `dtype`, converted only if it is in another.
pub(crate) fn in_dtype(tensor: Tensor<4>, dtype: DType) -> Tensor<4> {
    if tensor.dtype() == dtype {
        tensor
    } else {
        tensor.cast(dtype)
    }
}

/// Keys or values in int8: `values` in i8 and one scale per position and head.
pub(crate) struct Quantized {
    /// `[batch, heads, positions, dim]`, i8.
    pub values: Tensor<4, Int>,
    /// `[batch, heads, positions, 1]`: `max |x| / 127` of each position's row, in f32.
    pub scales: Tensor<4>,
}

/// `tensor` (`[batch, heads, positions, dim]`, detached) in int8, each row scaled by its own
/// `max |x| / 127`: what [`CacheStorage::Int8`] stores.
///
/// Computed in f32 whatever the input's type: in f16 the scale's floor (`f32::MIN_POSITIVE`)
/// is 0, and a row of zeros would divide 0 by 0.
pub(crate) fn quantize_int8(tensor: Tensor<4>) -> Quantized {
    let tensor = in_dtype(tensor.detach(), DType::F32);
    let scales = tensor
        .clone()
        .abs()
        .max_dim(3)
        .div_scalar(127.0)
        .clamp_min(f32::MIN_POSITIVE);
    let values = (tensor / scales.clone())
        .round()
        .clamp(-127.0, 127.0)
        .cast(IntDType::I8);
    Quantized { values, scales }
}

/// The scale [`quantize_int8`] gives a row of f32 features: its largest magnitude / 127, at
/// least the smallest positive normal f32 (NaN if the row holds one), for the in-place
/// writers, which quantize a row at a time.
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) fn int8_scale(row: &[f32]) -> f32 {
    let largest = row.iter().fold(0.0f32, |largest, &value| {
        let magnitude = value.abs();
        if magnitude > largest || magnitude.is_nan() {
            magnitude
        } else {
            largest
        }
    });
    let scale = largest / 127.0;
    if scale < f32::MIN_POSITIVE {
        f32::MIN_POSITIVE
    } else {
        scale
    }
}

/// `value` in int8 under `scale` as [`quantize_int8`] stores it: divided, rounded half to
/// even, clamped to ±127.
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) fn int8_value(value: f32, scale: f32) -> i8 {
    // The clamp keeps the cast exact; a NaN becomes 0, as flex's tensor cast makes it (ndarray's
    // refuses a NaN), beside a NaN scale.
    (value / scale).round_ties_even().clamp(-127.0, 127.0) as i8
}

/// `quantized` back in floats of `dtype`.
pub(crate) fn dequantize_int8(
    values: Tensor<4, Int>,
    scales: Tensor<4>,
    dtype: DType,
) -> Tensor<4> {
    values.cast(FloatDType::from(dtype)) * scales.cast(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An f16 row of zeros (a padding token's keys, say) quantizes to zeros with a positive f32
    /// scale, where f16 scales floored at 0 divided 0 by 0.
    #[test]
    fn f16_rows_quantize_in_f32_and_zeros_stay_zeros() {
        let device = Device::flex();
        let rows = Tensor::<4>::from_data(
            burn::tensor::TensorData::new(
                vec![0.0f32, 0.0, 0.0, 0.0, 1.0, -2.0, 0.5, 4.0],
                [1, 1, 2, 4],
            ),
            &device,
        )
        .cast(DType::F16);
        let Quantized { values, scales } = quantize_int8(rows);
        assert_eq!(scales.dtype(), DType::F32);
        let scales: Vec<f32> = scales.into_data().convert::<f32>().try_to_vec().unwrap();
        assert!(scales.iter().all(|&scale| scale > 0.0), "{scales:?}");
        let values: Vec<i64> = values.into_data().convert::<i64>().try_to_vec().unwrap();
        assert_eq!(values, [0, 0, 0, 0, 32, -64, 16, 127]);
    }
}
