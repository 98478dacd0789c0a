//! A [`KvCache`](super::KvCache)'s keys or values as it stores them ([`Stored`]): float (f32 or
//! f16) or int8 buffers with room to append in place, and what a step reads of them.

use burn::tensor::kind::Basic;
use burn::tensor::{DType, Int, Tensor};

use super::picked;
use super::storage::{CacheStorage, Quantized, dequantize_int8, in_dtype, quantize_int8};
#[cfg(any(feature = "flex", feature = "ndarray"))]
use super::widen;

/// Stored keys or values, `[batch, heads, stored, dim]`.
#[derive(Debug, Clone)]
// The int8 variant holds two tensors; the enum lives in a cache, two per layer, never in bulk.
#[allow(clippy::large_enum_variant)]
pub(super) enum Stored {
    /// Positions `0..len` of `buffer`, whose axis 2 has room for more: appending writes into
    /// the spare positions in place ([`appended`]).
    Float { buffer: Tensor<4>, len: usize },
    /// Positions `0..len` of values in i8 and of one scale per position and head (`[batch,
    /// heads, stored, 1]`), both with room for more, appended to in place as `Float` is.
    Int8 {
        values: Tensor<4, Int>,
        scales: Tensor<4>,
        len: usize,
    },
}

impl Stored {
    pub(super) fn new(tensor: Tensor<4>, storage: CacheStorage) -> Self {
        match storage {
            CacheStorage::Float => Self::Float {
                len: tensor.dims()[2],
                buffer: tensor,
            },
            CacheStorage::Int8 => {
                let Quantized { values, scales } = quantize_int8(tensor);
                Self::Int8 {
                    len: scales.dims()[2],
                    values,
                    scales,
                }
            }
            CacheStorage::Half => Self::Float {
                len: tensor.dims()[2],
                buffer: in_dtype(tensor, DType::F16),
            },
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Self::Float { len, .. } | Self::Int8 { len, .. } => *len,
        }
    }

    /// Whether the positions are stored as floats of `dtype` (what [`Stored::read`] returns
    /// without a conversion).
    pub(super) fn is_float_in(&self, dtype: DType) -> bool {
        matches!(self, Self::Float { buffer, .. } if buffer.dtype() == dtype)
    }

    /// The stored positions as floats, in `dtype`.
    pub(super) fn read(&self, dtype: DType) -> Tensor<4> {
        match self {
            Self::Float { buffer, len } => in_dtype(stored_part(buffer, *len), dtype),
            Self::Int8 {
                values,
                scales,
                len,
            } => dequantize_int8(stored_part(values, *len), stored_part(scales, *len), dtype),
        }
    }

    /// The stored positions in `dtype` with `new` (in `dtype`) after them: where f16 or int8
    /// are widened to f32 on flex or ndarray, in one pass (`widen.rs`); elsewhere a conversion,
    /// then a concatenation.
    pub(super) fn read_then(&self, new: &Tensor<4>, dtype: DType) -> Tensor<4> {
        #[cfg(any(feature = "flex", feature = "ndarray"))]
        {
            let (half, int8_values, int8_scales);
            let compressed = match self {
                Self::Float { buffer, len } if buffer.dtype() == DType::F16 => {
                    half = stored_part(buffer, *len);
                    Some(widen::Compressed::Half(&half))
                }
                Self::Float { .. } => None,
                Self::Int8 {
                    values,
                    scales,
                    len,
                } => {
                    (int8_values, int8_scales) =
                        (stored_part(values, *len), stored_part(scales, *len));
                    Some(widen::Compressed::Int8 {
                        values: &int8_values,
                        scales: &int8_scales,
                    })
                }
            };
            if let Some(widened) =
                compressed.and_then(|stored| widen::widened_then_rows(stored, new))
            {
                return widened;
            }
        }
        Tensor::cat(vec![self.read(dtype), new.clone()], 2)
    }

    /// These positions, then `other`'s ([`appended`]).
    pub(super) fn cat(self, other: Self, max_positions: usize) -> Self {
        match (self, other) {
            (
                Self::Float { buffer, len },
                Self::Float {
                    buffer: new,
                    len: new_len,
                },
            ) => Self::Float {
                buffer: appended(buffer, len, stored_part(&new, new_len), max_positions),
                len: len + new_len,
            },
            (
                Self::Int8 {
                    values,
                    scales,
                    len,
                },
                Self::Int8 {
                    values: new_values,
                    scales: new_scales,
                    len: new_len,
                },
            ) => Self::Int8 {
                values: appended(
                    values,
                    len,
                    stored_part(&new_values, new_len),
                    max_positions,
                ),
                scales: appended(
                    scales,
                    len,
                    stored_part(&new_scales, new_len),
                    max_positions,
                ),
                len: len + new_len,
            },
            _ => unreachable!("one cache has one storage"),
        }
    }

    /// The first `len` positions (positions past them stay in the buffer as spare room).
    pub(super) fn truncated(self, len: usize) -> Self {
        assert!(
            len <= self.len(),
            "Stored::truncated: {len} > {}",
            self.len()
        );
        match self {
            Self::Float { buffer, .. } => Self::Float { buffer, len },
            Self::Int8 { values, scales, .. } => Self::Int8 {
                values,
                scales,
                len,
            },
        }
    }

    /// Positions `ranges` (in order), concatenated.
    pub(super) fn select(self, ranges: &[(usize, usize)]) -> Self {
        let kept = ranges.iter().map(|&(_, len)| len).sum();
        match self {
            Self::Float { buffer, .. } => Self::Float {
                buffer: picked(&buffer, 2, ranges),
                len: kept,
            },
            Self::Int8 { values, scales, .. } => Self::Int8 {
                values: picked(&values, 2, ranges),
                scales: picked(&scales, 2, ranges),
                len: kept,
            },
        }
    }

    /// Bytes the stored tensors take.
    pub(super) fn bytes(&self) -> usize {
        let size = |dims: [usize; 4], dtype: DType| dims.iter().product::<usize>() * dtype.size();
        match self {
            Self::Float { buffer, .. } => size(buffer.dims(), buffer.dtype()),
            Self::Int8 { values, scales, .. } => {
                size(values.dims(), values.dtype()) + size(scales.dims(), scales.dtype())
            }
        }
    }
}

/// Positions `0..len` of a buffer with room for more (the whole buffer when it has none).
fn stored_part<K: Basic>(buffer: &Tensor<4, K>, len: usize) -> Tensor<4, K> {
    if buffer.dims()[2] == len {
        buffer.clone()
    } else {
        buffer.clone().narrow(2, 0, len)
    }
}

/// `buffer`'s positions `0..len`, then `new`'s, along axis 2: written into the buffer's spare
/// positions in place where they fit (a uniquely held buffer on flex), so that a decoding step
/// copies only its own keys, not the whole cache; else into a new buffer with room for up to as
/// many positions again, but never more than `max_positions` in all.
fn appended<K: Basic>(
    buffer: Tensor<4, K>,
    len: usize,
    new: Tensor<4, K>,
    max_positions: usize,
) -> Tensor<4, K> {
    let [batch, heads, capacity, dim] = buffer.dims();
    let total = len + new.dims()[2];
    if total <= capacity {
        return buffer.slice_assign([0..batch, 0..heads, len..total, 0..dim], new);
    }
    let spare = (2 * capacity).min(max_positions).max(total) - total;
    let mut parts = vec![buffer.narrow(2, 0, len), new];
    if spare > 0 {
        let zeros = Tensor::zeros(
            [batch, heads, spare, dim],
            (&parts[0].device(), parts[0].dtype()),
        );
        parts.push(zeros);
    }
    Tensor::cat(parts, 2)
}
