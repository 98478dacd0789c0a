//! A step's new keys or values written into a float pool's blocks in place on flex and
//! ndarray: one pass over the step's rows, where the tensor ops write each sequence's rows with
//! an assignment of their own (two per sequence and step, 0.15-0.23 ms for a step of 32
//! sequences, on one thread between the parallel projections and attention).

use std::sync::Arc;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::{DType, Tensor};

use super::super::store::BlockLayout;
use crate::cpu::matrix::{HeadIndex, StridedMut};
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

/// Backends whose float pool the step writes in place.
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray")
)]
pub(crate) trait PagedWriteBackend: Backend {
    /// `pool` with row `slot.row` of every head of `rows` written at position `slot.offset` of
    /// block `slot.block`, for each slot.
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
        }
    };
}

#[cfg(feature = "flex")]
native_paged_write_backend!(burn::backend::Flex);
#[cfg(feature = "ndarray")]
native_paged_write_backend!(burn::backend::NdArray);

/// What [`native_write`] did with the pool.
pub(crate) enum PoolWrite {
    /// The pool with the rows written.
    Written(Tensor<4>),
    /// The pool untouched: the writer does not take it (the caller writes with tensor ops).
    Declined(Tensor<4>),
}

/// `pool` with `rows` written at `slots` in place, where the pool and the rows are f32 on flex
/// or ndarray outside autodiff; declined elsewhere.
pub(crate) fn native_write(
    pool: Tensor<4>,
    rows: &Tensor<4>,
    slots: Vec<Slot>,
    layout: BlockLayout,
) -> PoolWrite {
    let device = pool.device();
    let native = native_storage(&device)
        && !device.is_autodiff()
        && pool.dtype() == DType::F32
        && rows.dtype() == DType::F32;
    if !native {
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

/// [`PagedWriteBackend::paged_write`] on a CPU backend's storage.
///
/// # Panics
///
/// If the pool and the rows are not f32 of the documented shapes, or a slot lies outside them.
fn paged_write<B: CpuStorage>(
    mut pool: FloatTensor<B>,
    rows: &FloatTensor<B>,
    params: &WriteParams,
) -> FloatTensor<B> {
    let rows = B::readable(rows).expect("paged write: f32 rows");
    let rows = B::heads_view(&rows).expect("a readable layout");
    let [_, heads, count, dim] = rows.shape();
    let shape = rank_4(&pool);
    let (block_size, pool_dim) = match params.layout {
        BlockLayout::PositionMajor => (shape[2], shape[3]),
        BlockLayout::FeatureMajor => (shape[3], shape[2]),
    };
    assert!(
        shape[1] == heads
            && pool_dim == dim
            && params
                .slots
                .iter()
                .all(|slot| slot.row < count && slot.block < shape[0] && slot.offset < block_size),
        "paged write: rows {:?} at slots {:?} do not fit a pool of {shape:?} ({:?})",
        rows.shape(),
        params.slots,
        params.layout
    );
    let StridedMut { values, strides } = B::writable(&mut pool).expect("paged write: an f32 pool");
    for slot in params.slots.iter() {
        for head in 0..heads {
            let source = rows.row(HeadIndex { batch: 0, head }, slot.row);
            let base = slot.block * strides[0] + head * strides[1];
            match params.layout {
                BlockLayout::PositionMajor => {
                    let start = base + slot.offset * strides[2];
                    values[start..start + dim].copy_from_slice(source);
                }
                BlockLayout::FeatureMajor => {
                    for (feature, &value) in source.iter().enumerate() {
                        values[base + feature * strides[2] + slot.offset * strides[3]] = value;
                    }
                }
            }
        }
    }
    pool
}

#[cfg(all(test, feature = "flex", feature = "ndarray"))]
mod tests;
