//! A step's new keys or values written into a pool's blocks in place on flex and ndarray: one
//! pass over the step's rows, converted to the pool's storage (f32, f16, or int8 quantized as
//! [`quantize_int8`](crate::cache::quantize_int8) does), where the tensor ops wrote each
//! sequence's rows with assignments of their own (two per sequence and step, 0.15-0.23 ms for
//! a step of 32 sequences in f32 and 0.2-0.3 ms more in f16 and int8, whose rows they convert
//! too, on one thread between the parallel projections and attention; off this writer a
//! step's short writes now go in one scatter per side, `BlockStore::written_all`).

use std::sync::Arc;

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, Dispatch, TensorMetadata, backend_extension};
use burn::tensor::{DType, Int, Tensor, f16};

use super::super::store::BlockLayout;
use crate::cache::{int8_scale, int8_value};
use crate::cpu::matrix::{HeadIndex, HeadsView, StridedMut};
use crate::cpu::storage::{CpuStorage, native_storage, rank_4};

/// Where one row of a step goes: row `row` of the step's keys or values, to position `offset`
/// of block `block`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slot {
    pub row: usize,
    pub block: usize,
    pub offset: usize,
}

/// What a write puts where, besides its tensors.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct WriteParams {
    pub slots: Arc<[Slot]>,
    /// The pool's layout: values position-major, keys feature-major.
    pub layout: BlockLayout,
}

/// Backends whose pool the step writes in place.
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray")
)]
pub(crate) trait PagedWriteBackend: Backend {
    /// `pool` (f32, or f16 where the backend has f16 tensors) with row `slot.row` of every
    /// head of `rows` written at position `slot.offset` of block `slot.block`, for each slot.
    ///
    /// # Shapes
    ///
    /// - pool: `[blocks, n_kv_heads, block_size, dim]` position-major, `[blocks, n_kv_heads,
    ///   dim, block_size]` feature-major
    /// - rows: `[1, n_kv_heads, step rows, dim]`
    fn paged_write(
        pool: FloatTensor<Self>,
        rows: FloatTensor<Self>,
        params: WriteParams,
    ) -> FloatTensor<Self>;

    /// [`PagedWriteBackend::paged_write`] into an int8 pool: each row quantized as
    /// [`quantize_int8`](crate::cache::quantize_int8) does, its i8 values into `values` and its scale into `scales`.
    ///
    /// # Shapes
    ///
    /// - values: as `pool` of [`PagedWriteBackend::paged_write`], i8
    /// - scales: `[blocks, n_kv_heads, block_size, 1]` position-major, `[blocks, n_kv_heads,
    ///   1, block_size]` feature-major, f32
    /// - rows: `[1, n_kv_heads, step rows, dim]`
    fn paged_write_int8(
        values: IntTensor<Self>,
        scales: FloatTensor<Self>,
        rows: FloatTensor<Self>,
        params: WriteParams,
    ) -> (IntTensor<Self>, FloatTensor<Self>);
}

macro_rules! native_paged_write_backend {
    ($backend:ty) => {
        impl PagedWriteBackend for $backend {
            fn paged_write(
                pool: FloatTensor<Self>,
                rows: FloatTensor<Self>,
                params: WriteParams,
            ) -> FloatTensor<Self> {
                paged_write::<Self>(pool, &rows, &params)
            }

            fn paged_write_int8(
                values: IntTensor<Self>,
                scales: FloatTensor<Self>,
                rows: FloatTensor<Self>,
                params: WriteParams,
            ) -> (IntTensor<Self>, FloatTensor<Self>) {
                paged_write_int8::<Self>(values, scales, &rows, &params)
            }
        }
    };
}

#[cfg(feature = "flex")]
native_paged_write_backend!(burn::backend::Flex);
#[cfg(feature = "ndarray")]
native_paged_write_backend!(burn::backend::NdArray);

/// What [`native_write`] or [`native_write_int8`] did with the pool.
pub(crate) enum PoolWrite<T = Tensor<4>> {
    /// The pool with the rows written.
    Written(T),
    /// The pool untouched: the writer does not take it (the caller writes with tensor ops).
    Declined(T),
}

/// An int8 pool's tensors: i8 values and their f32 scales (a feature axis of 1).
pub(crate) struct Int8Blocks {
    pub values: Tensor<4, Int>,
    pub scales: Tensor<4>,
}

/// Whether the writer takes a pool on `device` with f32 `rows`: flex or ndarray outside
/// autodiff.
fn writes_natively(device: &burn::tensor::Device, rows: &Tensor<4>) -> bool {
    native_storage(device) && !device.is_autodiff() && rows.dtype() == DType::F32
}

/// `pool` with `rows` written at `slots` in place, where the rows are f32 and the pool f32 (or
/// f16 on flex), on flex or ndarray outside autodiff; declined elsewhere.
pub(crate) fn native_write(
    pool: Tensor<4>,
    rows: &Tensor<4>,
    slots: Vec<Slot>,
    layout: BlockLayout,
) -> PoolWrite {
    let device = pool.device();
    let takes_pool = match pool.dtype() {
        DType::F32 => true,
        // flex's; ndarray has no f16 tensors (it refuses `CacheStorage::Half`).
        DType::F16 => device.supports_dtype(DType::F16),
        _ => false,
    };
    if !(takes_pool && writes_natively(&device, rows)) {
        return PoolWrite::Declined(pool);
    }
    let params = WriteParams {
        slots: slots.into(),
        layout,
    };
    let written = <Dispatch as PagedWriteBackend>::paged_write(
        pool.into_dispatch(),
        rows.clone().into_dispatch(),
        params,
    );
    PoolWrite::Written(Tensor::from_dispatch(written))
}

/// `pool` with `rows` quantized and written at `slots` in place, where the rows and the scales
/// are f32, on flex or ndarray outside autodiff; declined elsewhere.
pub(crate) fn native_write_int8(
    pool: Int8Blocks,
    rows: &Tensor<4>,
    slots: Vec<Slot>,
    layout: BlockLayout,
) -> PoolWrite<Int8Blocks> {
    let device = pool.values.device();
    let takes_pool = pool.values.dtype() == DType::I8 && pool.scales.dtype() == DType::F32;
    if !(takes_pool && writes_natively(&device, rows)) {
        return PoolWrite::Declined(pool);
    }
    let params = WriteParams {
        slots: slots.into(),
        layout,
    };
    let (values, scales) = <Dispatch as PagedWriteBackend>::paged_write_int8(
        pool.values.into_dispatch(),
        pool.scales.into_dispatch(),
        rows.clone().into_dispatch(),
        params,
    );
    PoolWrite::Written(Int8Blocks {
        values: Tensor::from_dispatch(values),
        scales: Tensor::from_dispatch(scales),
    })
}

/// [`PagedWriteBackend::paged_write`] on a CPU backend's storage.
///
/// # Panics
///
/// If the pool is not f32 (or f16 where the backend has f16 tensors) and the rows f32 of the
/// documented shapes, or a slot lies outside them.
fn paged_write<B: CpuStorage>(
    mut pool: FloatTensor<B>,
    rows: &FloatTensor<B>,
    params: &WriteParams,
) -> FloatTensor<B> {
    let rows = B::readable(rows).expect("paged write: f32 rows");
    let rows = B::heads_view(&rows).expect("a readable layout");
    let (shape, dim) = (rank_4(&pool), rows.shape()[3]);
    if pool.dtype() == DType::F16 {
        let elements = B::half_writable(&mut pool).expect("paged write: an f16 pool");
        write_rows(elements, (shape, dim), &rows, params, |source, row| {
            for (place, &value) in row.iter_mut().zip(source) {
                *place = f16::from_f32(value);
            }
        });
    } else {
        let elements = B::writable(&mut pool).expect("paged write: an f32 pool");
        write_rows(elements, (shape, dim), &rows, params, |source, row| {
            row.copy_from_slice(source)
        });
    }
    pool
}

/// [`PagedWriteBackend::paged_write_int8`] on a CPU backend's storage.
///
/// # Panics
///
/// If the pool is not i8 values and f32 scales and the rows f32 of the documented shapes, or
/// a slot lies outside them.
fn paged_write_int8<B: CpuStorage>(
    mut values: IntTensor<B>,
    mut scales: FloatTensor<B>,
    rows: &FloatTensor<B>,
    params: &WriteParams,
) -> (IntTensor<B>, FloatTensor<B>) {
    let rows = B::readable(rows).expect("paged write: f32 rows");
    let rows = B::heads_view(&rows).expect("a readable layout");
    let (values_shape, scales_shape) = (rank_4(&values), rank_4(&scales));
    let dim = rows.shape()[3];
    // Each written row's scale, computed once: both passes visit the slots and heads in the
    // same order, so the values' pass takes the scales in the order the scales' pass made them.
    let mut row_scales = Vec::with_capacity(params.slots.len() * rows.shape()[1]);
    let scale_elements = B::writable(&mut scales).expect("paged write: f32 scales");
    write_rows(
        scale_elements,
        (scales_shape, 1),
        &rows,
        params,
        |source, row| {
            let scale = int8_scale(source);
            row_scales.push(scale);
            row.fill(scale);
        },
    );
    let mut row_scales = row_scales.into_iter();
    let value_elements = B::int8_writable(&mut values).expect("paged write: an i8 pool");
    write_rows(
        value_elements,
        (values_shape, dim),
        &rows,
        params,
        |source, row| {
            let scale = row_scales.next().expect("a scale per row written");
            for (place, &value) in row.iter_mut().zip(source) {
                *place = int8_value(value, scale);
            }
        },
    );
    (values, scales)
}

/// Writes row `slot.row` of every head of `rows` at each slot of a pool of `shape` (laid out
/// as `params.layout` says; `elements` its elements), as `convert` turns the row's features
/// into the pool's row of `pool_dim` elements (the rows' feature count, or one: an int8
/// pool's scales). `convert` is called slot by slot, head by head within a slot.
///
/// # Panics
///
/// If the pool's head count is not the rows', its feature count not `pool_dim`, or a slot
/// lies outside the rows or the pool.
fn write_rows<E: Copy + Default>(
    elements: StridedMut<E>,
    (shape, pool_dim): ([usize; 4], usize),
    rows: &HeadsView,
    params: &WriteParams,
    mut convert: impl FnMut(&[f32], &mut [E]),
) {
    let [_, heads, count, _] = rows.shape();
    let (position_axis, feature_axis) = match params.layout {
        BlockLayout::PositionMajor => (2, 3),
        BlockLayout::FeatureMajor => (3, 2),
    };
    let block_size = shape[position_axis];
    assert!(
        shape[1] == heads
            && shape[feature_axis] == pool_dim
            && params
                .slots
                .iter()
                .all(|slot| slot.row < count && slot.block < shape[0] && slot.offset < block_size),
        "paged write: rows {:?} at slots {:?} do not fit a pool of {shape:?} ({:?})",
        rows.shape(),
        params.slots,
        params.layout
    );
    let StridedMut { values, strides } = elements;
    let mut row = vec![E::default(); pool_dim];
    for slot in params.slots.iter() {
        for head in 0..heads {
            convert(rows.row(HeadIndex { batch: 0, head }, slot.row), &mut row);
            let start =
                slot.block * strides[0] + head * strides[1] + slot.offset * strides[position_axis];
            for (feature, &value) in row.iter().enumerate() {
                values[start + feature * strides[feature_axis]] = value;
            }
        }
    }
}

#[cfg(all(test, feature = "flex", feature = "ndarray"))]
mod tests;
