//! What a step of a compressed [`KvCache`](super::KvCache) that the in-place kernel does not
//! take attends to, written in one pass on flex and ndarray: the stored positions widened to
//! f32 (f16, or i8 times its row's scale) with the step's own rows after them. The tensor ops
//! make it in two: a cast or dequantization of the whole cache into one tensor, then a
//! concatenation copying all of it again into another.

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::{DType, Int, Tensor};
use rayon::prelude::*;

use crate::cpu::matrix::HeadIndex;
use crate::cpu::simd;
use crate::cpu::storage::{CpuStorage, native_storage};
use crate::execution::FreshOutputs;

/// The fewest output elements for which the pass is spread over rayon's threads: below, waking
/// them costs about what the copy does (about 0.1 ms, `decoding` bench's `parallel_pair`).
const PARALLEL_ELEMENTS: usize = 1 << 20;

/// A compressed cache's stored positions of one side (keys or values), `[batch, heads, stored,
/// dim]` (an int8 side's scales `[batch, heads, stored, 1]`).
#[derive(Clone, Copy)]
pub(crate) enum Compressed<'a> {
    /// f16.
    Half(&'a Tensor<4>),
    /// i8 and its f32 scales.
    Int8 {
        values: &'a Tensor<4, Int>,
        scales: &'a Tensor<4>,
    },
}

/// Backends that widen a compressed cache in one pass.
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray")
)]
pub(crate) trait CacheWidenBackend: Backend {
    /// `stored` as f32, then `rows`, along the positions.
    ///
    /// # Shapes
    ///
    /// - stored: `[batch, heads, stored, dim]`, f16
    /// - rows: `[batch, heads, new, dim]`, f32
    /// - output: `[batch, heads, stored + new, dim]`, f32
    fn half_then_rows(stored: FloatTensor<Self>, rows: FloatTensor<Self>) -> FloatTensor<Self>;

    /// `values · scales` as f32, then `rows`, along the positions.
    ///
    /// # Shapes
    ///
    /// - values: `[batch, heads, stored, dim]`, i8; scales: `[batch, heads, stored, 1]`, f32
    /// - rows, output: as in [`CacheWidenBackend::half_then_rows`]
    fn int8_then_rows(
        values: IntTensor<Self>,
        scales: FloatTensor<Self>,
        rows: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

macro_rules! native_cache_widen_backend {
    ($backend:ty) => {
        impl CacheWidenBackend for $backend {
            fn half_then_rows(
                stored: FloatTensor<Self>,
                rows: FloatTensor<Self>,
            ) -> FloatTensor<Self> {
                let stored = Self::half_readable(&stored).expect("widen: f16 positions");
                let stored = Self::half_heads_view(&stored).expect("a readable layout");
                then_rows::<Self>(stored.shape(), &rows, |past, index, dim| {
                    let head = stored.head(index);
                    let mut scratch = Vec::new();
                    for (position, out) in past.chunks_exact_mut(dim).enumerate() {
                        simd::widen_half(out, head.row_or_copy(position, &mut scratch));
                    }
                })
            }

            fn int8_then_rows(
                values: IntTensor<Self>,
                scales: FloatTensor<Self>,
                rows: FloatTensor<Self>,
            ) -> FloatTensor<Self> {
                let values = Self::int8_readable(&values).expect("widen: i8 positions");
                let values = Self::int8_heads_view(&values).expect("a readable layout");
                let scales = Self::readable(&scales).expect("widen: f32 scales");
                let scales = Self::heads_view(&scales).expect("a readable layout");
                let shape = values.shape();
                assert_eq!(
                    scales.shape(),
                    [shape[0], shape[1], shape[2], 1],
                    "widen: one scale per stored position"
                );
                then_rows::<Self>(shape, &rows, |past, index, dim| {
                    let (head, scales) = (values.head(index), scales.head(index));
                    for (position, out) in past.chunks_exact_mut(dim).enumerate() {
                        let row = &head.values[position * head.row_stride..][..dim];
                        let scale = scales.values[position * scales.row_stride];
                        simd::dequantize_row(out, row, scale);
                    }
                })
            }
        }
    };
}

#[cfg(feature = "flex")]
native_cache_widen_backend!(burn::backend::Flex);
#[cfg(feature = "ndarray")]
native_cache_widen_backend!(burn::backend::NdArray);

/// `[batch, heads, stored + new, dim]` in f32: for each head, `widen_head` writes the stored
/// positions (`stored` rows of `dim`, given the head and `dim`), then `rows`' are copied after
/// them.
///
/// # Panics
///
/// If `rows` is not f32 with the stored positions' batch, heads and width.
fn then_rows<B: CpuStorage>(
    stored: [usize; 4],
    rows: &FloatTensor<B>,
    widen_head: impl Fn(&mut [f32], HeadIndex, usize) + Sync,
) -> FloatTensor<B> {
    let rows = B::readable(rows).expect("widen: f32 rows");
    let new = B::heads_view(&rows).expect("a readable layout");
    let [batch, heads, stored_positions, dim] = stored;
    let [new_batch, new_heads, new_positions, new_dim] = new.shape();
    assert_eq!(
        [new_batch, new_heads, new_dim],
        [batch, heads, dim],
        "widen: the new rows {:?} are not the stored positions' heads {stored:?}",
        new.shape()
    );
    let shape = [batch, heads, stored_positions + new_positions, dim];
    let per_head = shape[2] * dim;
    let mut output = B::output_buffer(shape.iter().product(), FreshOutputs::Unspecified);
    if per_head > 0 {
        let fill = |(task, out): (usize, &mut [f32])| {
            let index = HeadIndex {
                batch: task / heads,
                head: task % heads,
            };
            let (past, fresh) = out.split_at_mut(stored_positions * dim);
            widen_head(past, index, dim);
            let fresh_head = new.head(index);
            for (row, out) in fresh.chunks_exact_mut(dim).enumerate() {
                out.copy_from_slice(&fresh_head.values[row * fresh_head.row_stride..][..dim]);
            }
        };
        if output.len() >= PARALLEL_ELEMENTS {
            output.par_chunks_mut(per_head).enumerate().for_each(fill);
        } else {
            output.chunks_mut(per_head).enumerate().for_each(fill);
        }
    }
    B::contiguous(output, shape)
}

/// `stored` widened to f32 with `rows` (f32) after it along the positions, in one
/// pass where the device is flex or ndarray outside autodiff; `None` elsewhere (the caller uses
/// tensor ops).
pub(crate) fn widened_then_rows(stored: Compressed, rows: &Tensor<4>) -> Option<Tensor<4>> {
    let device = rows.device();
    let stored_as_expected = match stored {
        Compressed::Half(positions) => positions.dtype() == DType::F16,
        Compressed::Int8 { values, scales } => {
            values.dtype() == DType::I8 && scales.dtype() == DType::F32
        }
    };
    if !(native_storage(&device)
        && !device.is_autodiff()
        && rows.dtype() == DType::F32
        && stored_as_expected)
    {
        return None;
    }
    let rows = rows.clone().into_dispatch();
    let widened = match stored {
        Compressed::Half(positions) => {
            <Dispatch as CacheWidenBackend>::half_then_rows(positions.clone().into_dispatch(), rows)
        }
        Compressed::Int8 { values, scales } => <Dispatch as CacheWidenBackend>::int8_then_rows(
            values.clone().into_dispatch(),
            scales.clone().into_dispatch(),
            rows,
        ),
    };
    Some(Tensor::from_dispatch(widened))
}

// The tests run on both backends.
#[cfg(all(test, feature = "flex", feature = "ndarray"))]
mod tests {
    use burn::tensor::{Device, Distribution, Tensor};

    use super::*;
    use crate::cache::storage::{dequantize_int8, quantize_int8};

    /// Spare positions after the stored ones in the buffers the tests read.
    const SPARE: usize = 3;

    /// A buffer of `[batch, heads, stored + SPARE, dim]` (the caller converts it, then reads
    /// its first `stored` positions, as a cache with room to append does), and a step's rows in
    /// the heads layout the projections give (`[batch, new, heads, dim]` memory).
    fn buffer_and_rows(shape: [usize; 4], new: usize, device: &Device) -> (Tensor<4>, Tensor<4>) {
        let [batch, heads, stored, dim] = shape;
        let buffer = Tensor::random(
            [batch, heads, stored + SPARE, dim],
            Distribution::Normal(0.0, 1.0),
            device,
        );
        let rows = Tensor::<4>::random(
            [batch, new, heads, dim],
            Distribution::Normal(0.0, 1.0),
            device,
        );
        (buffer, rows.swap_dims(1, 2))
    }

    fn assert_same(actual: Tensor<4>, expected: Tensor<4>, what: &str) {
        assert_eq!(actual.dims(), expected.dims(), "{what}");
        let (actual, expected) = (actual.into_data(), expected.into_data());
        let (actual, expected) = (
            actual.as_slice::<f32>().unwrap(),
            expected.as_slice::<f32>().unwrap(),
        );
        let first_difference = actual
            .iter()
            .zip(expected)
            .position(|(a, e)| a.to_bits() != e.to_bits());
        assert_eq!(
            first_difference, None,
            "{what}: differs from the tensor ops"
        );
    }

    /// f16 positions (a view of a buffer with spare positions) widened with the step's rows
    /// after them equal the cast and the concatenation, bit for bit, below and above the size
    /// that goes parallel.
    #[test]
    fn half_positions_then_rows_equal_the_tensor_ops() {
        let device = Device::flex();
        for shape in [
            [2, 3, 5, 4],
            [2, 2, 2048, 128],
            [1, 1, 1, 8],
            [1, 2, 37, 16],
        ] {
            let (buffer, rows) = buffer_and_rows(shape, 2, &device);
            let stored = buffer.cast(DType::F16).narrow(2, 0, shape[2]);
            let actual = widened_then_rows(Compressed::Half(&stored), &rows)
                .expect("flex widens f16 positions");
            let expected = Tensor::cat(vec![stored.cast(DType::F32), rows], 2);
            assert_same(actual, expected, &format!("f16 {shape:?}"));
        }
    }

    /// i8 positions times their scales with the step's rows after them equal the dequantization
    /// and the concatenation, bit for bit, on flex and ndarray.
    #[test]
    fn int8_positions_then_rows_equal_the_tensor_ops() {
        // The deprecated backend is still one the crate supports.
        #[allow(deprecated)]
        let devices = [Device::flex(), Device::ndarray()];
        for device in devices {
            for shape in [[2, 3, 5, 4], [2, 2, 2048, 128], [1, 2, 37, 16]] {
                let (buffer, rows) = buffer_and_rows(shape, 3, &device);
                let quantized = quantize_int8(buffer);
                let values = quantized.values.narrow(2, 0, shape[2]);
                let scales = quantized.scales.narrow(2, 0, shape[2]);
                let held = Compressed::Int8 {
                    values: &values,
                    scales: &scales,
                };
                let actual = widened_then_rows(held, &rows).expect("the CPU backends widen int8");
                let dequantized = dequantize_int8(values, scales, DType::F32);
                let expected = Tensor::cat(vec![dequantized, rows], 2);
                assert_same(actual, expected, &format!("int8 {shape:?} on {device:?}"));
            }
        }
    }

    /// Under autodiff the step's rows may need their gradient: the tensor ops take the call.
    #[test]
    fn autodiff_devices_are_left_to_the_tensor_ops() {
        let device = Device::flex().autodiff();
        let (buffer, rows) = buffer_and_rows([1, 2, 3, 4], 1, &device);
        let stored = buffer.cast(DType::F16).narrow(2, 0, 3);
        assert!(widened_then_rows(Compressed::Half(&stored), &rows).is_none());
    }
}
