//! A [`KvCache`](super::KvCache)'s keys or values as it stores them ([`Stored`]): float (f32 or
//! f16) or int8 buffers with room to append in place, and what a step reads of them.

use burn::tensor::kind::Basic;
use burn::tensor::{DType, Int, Tensor};

use super::picked;
use super::storage::{CacheStorage, Quantized, dequantize_int8, in_dtype, quantize_int8};
#[cfg(any(feature = "flex", feature = "ndarray"))]
use super::widen;
use crate::cpu::storage::native_storage;
use crate::paged::StoredBlocks;

/// Stored keys or values, `[batch, heads, capacity, dim]` (or, [`Layout::FeatureMajor`],
/// `[batch, heads, dim, capacity]`), of which the first [`Stored::len`] positions are held.
#[derive(Debug, Clone)]
pub(super) struct Stored {
    data: StoredData,
    layout: Layout,
}

/// How a [`Stored`]'s buffers lie: which axis holds the positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layout {
    /// `[batch, heads, positions, dim]`: a position's features adjacent.
    PositionMajor,
    /// `[batch, heads, dim, positions]` (an int8 buffer's scales `[batch, heads, 1,
    /// positions]`): a feature's positions adjacent, as the paged kernel reads keys (16
    /// positions of a feature per vector), so that a decoding step reads a compressed cache's
    /// keys in place (`paged::native_cached_attention`).
    FeatureMajor,
}

impl Layout {
    /// The layout of a side's positions in `storage`, for steps like `tensor`'s: a compressed
    /// cache's keys feature-major where the in-place decoding kernel reads them (f32 on flex or
    /// ndarray, outside autodiff), everything else position-major, as the other kernels read
    /// them.
    fn of(side: Side, storage: CacheStorage, tensor: &Tensor<4>) -> Self {
        let device = tensor.device();
        let read_in_place =
            native_storage(&device) && !device.is_autodiff() && tensor.dtype() == DType::F32;
        match (side, storage) {
            (Side::Key, CacheStorage::Half | CacheStorage::Int8) if read_in_place => {
                Self::FeatureMajor
            }
            _ => Self::PositionMajor,
        }
    }

    /// The axis of the positions.
    fn axis(self) -> usize {
        match self {
            Self::PositionMajor => 2,
            Self::FeatureMajor => 3,
        }
    }

    /// `tensor` moved between `[batch, heads, positions, dim]` and this layout (either way:
    /// feature-major is the transpose of the last two axes).
    fn arranged<K: Basic>(self, tensor: Tensor<4, K>) -> Tensor<4, K> {
        match self {
            Self::PositionMajor => tensor,
            Self::FeatureMajor => tensor.swap_dims(2, 3),
        }
    }
}

/// Whether a [`Stored`] holds keys or values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Side {
    Key,
    Value,
}

/// A [`Stored`]'s buffers in its [`Layout`].
#[derive(Debug, Clone)]
// The int8 variant holds two tensors; the enum lives in a cache, two per layer, never in bulk.
#[allow(clippy::large_enum_variant)]
enum StoredData {
    /// Positions `0..len` of `buffer`, whose positions axis has room for more: appending
    /// writes into the spare positions in place ([`appended`]).
    Float { buffer: Tensor<4>, len: usize },
    /// Positions `0..len` of values in i8 and of one scale per position and head, both with
    /// room for more, appended to in place as `Float` is.
    Int8 {
        values: Tensor<4, Int>,
        scales: Tensor<4>,
        len: usize,
    },
}

impl Stored {
    /// `tensor` (`[batch, heads, positions, dim]`) stored as `storage` says, in the layout of
    /// `side` ([`Layout::of`]).
    pub(super) fn new(tensor: Tensor<4>, storage: CacheStorage, side: Side) -> Self {
        let layout = Layout::of(side, storage, &tensor);
        let len = tensor.dims()[2];
        let data = match storage {
            CacheStorage::Float => StoredData::Float {
                buffer: tensor,
                len,
            },
            CacheStorage::Int8 => {
                // One scale per position, over its features, before the transpose.
                let Quantized { values, scales } = quantize_int8(tensor);
                StoredData::Int8 {
                    values: layout.arranged(values),
                    scales: layout.arranged(scales),
                    len,
                }
            }
            CacheStorage::Half => StoredData::Float {
                buffer: layout.arranged(in_dtype(tensor, DType::F16)),
                len,
            },
        };
        Self { data, layout }
    }

    pub(super) fn len(&self) -> usize {
        match &self.data {
            StoredData::Float { len, .. } | StoredData::Int8 { len, .. } => *len,
        }
    }

    pub(crate) fn layout(&self) -> Layout {
        self.layout
    }

    /// Whether the positions are stored as floats of `dtype` (what [`Stored::read`] returns
    /// without a conversion).
    pub(super) fn is_float_in(&self, dtype: DType) -> bool {
        matches!(&self.data, StoredData::Float { buffer, .. } if buffer.dtype() == dtype)
    }

    /// The f16 or int8 buffers, whole (spare positions included), as the in-place kernel reads
    /// a paged pool's (each batch element one block); `None` for f32 storage.
    pub(crate) fn compressed(&self) -> Option<StoredBlocks<'_>> {
        match &self.data {
            StoredData::Float { buffer, .. } if buffer.dtype() == DType::F16 => {
                Some(StoredBlocks::Float(buffer))
            }
            StoredData::Float { .. } => None,
            StoredData::Int8 { values, scales, .. } => Some(StoredBlocks::Int8 { values, scales }),
        }
    }

    /// Positions `0..len` of `buffer` (in this layout) as `[batch, heads, len, dim]`.
    fn positions<K: Basic>(&self, buffer: &Tensor<4, K>, len: usize) -> Tensor<4, K> {
        let axis = self.layout.axis();
        let part = if buffer.dims()[axis] == len {
            buffer.clone()
        } else {
            buffer.clone().narrow(axis, 0, len)
        };
        self.layout.arranged(part)
    }

    /// The stored positions as floats, in `dtype`.
    pub(super) fn read(&self, dtype: DType) -> Tensor<4> {
        match &self.data {
            StoredData::Float { buffer, len } => in_dtype(self.positions(buffer, *len), dtype),
            StoredData::Int8 {
                values,
                scales,
                len,
            } => dequantize_int8(
                self.positions(values, *len),
                self.positions(scales, *len),
                dtype,
            ),
        }
    }

    /// The stored positions in `dtype` with `new` (in `dtype`) after them: where f16 or int8
    /// are widened to f32 on flex or ndarray, in one pass (`widen.rs`); elsewhere a conversion,
    /// then a concatenation.
    pub(super) fn read_then(&self, new: &Tensor<4>, dtype: DType) -> Tensor<4> {
        #[cfg(any(feature = "flex", feature = "ndarray"))]
        {
            let axis = self.layout.axis();
            let (half, int8_values, int8_scales);
            let compressed = match &self.data {
                StoredData::Float { buffer, len } if buffer.dtype() == DType::F16 => {
                    half = stored_part(buffer, axis, *len);
                    Some(widen::Compressed::Half(&half))
                }
                StoredData::Float { .. } => None,
                StoredData::Int8 {
                    values,
                    scales,
                    len,
                } => {
                    (int8_values, int8_scales) = (
                        stored_part(values, axis, *len),
                        stored_part(scales, axis, *len),
                    );
                    Some(widen::Compressed::Int8 {
                        values: &int8_values,
                        scales: &int8_scales,
                    })
                }
            };
            if let Some(widened) =
                compressed.and_then(|stored| widen::widened_then_rows(stored, self.layout, new))
            {
                return widened;
            }
        }
        Tensor::cat(vec![self.read(dtype), new.clone()], 2)
    }

    /// These positions, then `other`'s ([`appended`]), in this layout.
    ///
    /// # Panics
    ///
    /// If `other` is not of this storage (f32 or f16 against int8).
    pub(super) fn cat(self, other: Self, max_positions: usize) -> Self {
        let (layout, axis) = (self.layout, self.layout.axis());
        let other = other.in_layout(layout);
        let data = match (self.data, other.data) {
            (
                StoredData::Float { buffer, len },
                StoredData::Float {
                    buffer: new,
                    len: new_len,
                },
            ) => StoredData::Float {
                buffer: appended(
                    buffer,
                    len,
                    stored_part(&new, axis, new_len),
                    axis,
                    max_positions,
                ),
                len: len + new_len,
            },
            (
                StoredData::Int8 {
                    values,
                    scales,
                    len,
                },
                StoredData::Int8 {
                    values: new_values,
                    scales: new_scales,
                    len: new_len,
                },
            ) => StoredData::Int8 {
                values: appended(
                    values,
                    len,
                    stored_part(&new_values, axis, new_len),
                    axis,
                    max_positions,
                ),
                scales: appended(
                    scales,
                    len,
                    stored_part(&new_scales, axis, new_len),
                    axis,
                    max_positions,
                ),
                len: len + new_len,
            },
            _ => unreachable!("one cache has one storage"),
        };
        Self { data, layout }
    }

    /// These positions in `layout` (a step of another device or float type than the cache's
    /// earlier ones asks for another).
    fn in_layout(self, layout: Layout) -> Self {
        if layout == self.layout {
            return self;
        }
        // Either way the transpose of the last two axes.
        let data = match self.data {
            StoredData::Float { buffer, len } => StoredData::Float {
                buffer: buffer.swap_dims(2, 3),
                len,
            },
            StoredData::Int8 {
                values,
                scales,
                len,
            } => StoredData::Int8 {
                values: values.swap_dims(2, 3),
                scales: scales.swap_dims(2, 3),
                len,
            },
        };
        Self { data, layout }
    }

    /// The first `len` positions (positions past them stay in the buffer as spare room).
    ///
    /// # Panics
    ///
    /// If more positions than are held are asked for.
    pub(super) fn truncated(self, len: usize) -> Self {
        assert!(
            len <= self.len(),
            "Stored::truncated: {len} > {}",
            self.len()
        );
        let data = match self.data {
            StoredData::Float { buffer, .. } => StoredData::Float { buffer, len },
            StoredData::Int8 { values, scales, .. } => StoredData::Int8 {
                values,
                scales,
                len,
            },
        };
        Self { data, ..self }
    }

    /// Positions `ranges` (in order), concatenated.
    pub(super) fn select(self, ranges: &[(usize, usize)]) -> Self {
        let kept = ranges.iter().map(|&(_, len)| len).sum();
        let axis = self.layout.axis();
        let data = match self.data {
            StoredData::Float { buffer, .. } => StoredData::Float {
                buffer: picked(&buffer, axis, ranges),
                len: kept,
            },
            StoredData::Int8 { values, scales, .. } => StoredData::Int8 {
                values: picked(&values, axis, ranges),
                scales: picked(&scales, axis, ranges),
                len: kept,
            },
        };
        Self { data, ..self }
    }

    /// Bytes the stored tensors take.
    pub(super) fn bytes(&self) -> usize {
        let size = |dims: [usize; 4], dtype: DType| dims.iter().product::<usize>() * dtype.size();
        match &self.data {
            StoredData::Float { buffer, .. } => size(buffer.dims(), buffer.dtype()),
            StoredData::Int8 { values, scales, .. } => {
                size(values.dims(), values.dtype()) + size(scales.dims(), scales.dtype())
            }
        }
    }
}

/// Positions `0..len` along `axis` of a buffer with room for more (the whole buffer when it
/// has none).
fn stored_part<K: Basic>(buffer: &Tensor<4, K>, axis: usize, len: usize) -> Tensor<4, K> {
    if buffer.dims()[axis] == len {
        buffer.clone()
    } else {
        buffer.clone().narrow(axis, 0, len)
    }
}

/// `buffer`'s positions `0..len`, then `new`'s, along `axis`: written into the buffer's spare
/// positions in place where they fit (a uniquely held buffer on flex), so that a decoding step
/// copies only its own keys, not the whole cache; else into a new buffer with room for up to as
/// many positions again, but never more than `max_positions` in all.
fn appended<K: Basic>(
    buffer: Tensor<4, K>,
    len: usize,
    new: Tensor<4, K>,
    axis: usize,
    max_positions: usize,
) -> Tensor<4, K> {
    let dims = buffer.dims();
    let capacity = dims[axis];
    let total = len + new.dims()[axis];
    if total <= capacity {
        let mut ranges = dims.map(|size| 0..size);
        ranges[axis] = len..total;
        return buffer.slice_assign(ranges, new);
    }
    let spare = (2 * capacity).min(max_positions).max(total) - total;
    let mut parts = vec![buffer.narrow(axis, 0, len), new];
    if spare > 0 {
        let mut shape = dims;
        shape[axis] = spare;
        let zeros = Tensor::zeros(shape, (&parts[0].device(), parts[0].dtype()));
        parts.push(zeros);
    }
    Tensor::cat(parts, axis)
}
