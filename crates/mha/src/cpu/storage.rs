//! Flex's and ndarray's f32 storage (and i8 and f16, for int8 and half caches) as the CPU kernels read it
//! (strided slices, no copy where the layout allows) and write it (a kernel's buffer handed
//! over as the tensor's storage).

#[cfg(feature = "flex")]
use burn::backend::DType;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, DispatchDevice, TensorMetadata};
use burn::tensor::{Device, f16};

use super::buffers::{self, BufferSource};
use super::matrix::{HeadsView, Strided, StridedMut, kernel_strides};
use crate::execution::FreshOutputs;

/// A CPU backend whose float tensors the native kernels read and write in place.
pub(crate) trait CpuStorage: Backend {
    /// Where the backend's output buffers come from: the pool where its tensors give them back.
    const BUFFERS: BufferSource;

    /// `tensor` itself, or a copy in a layout [`CpuStorage::strided`] reads, for f32.
    fn readable(tensor: &FloatTensor<Self>) -> Option<FloatTensor<Self>>;

    /// The f32 elements from the tensor's first one on, and its four strides, if all are
    /// non-negative and the last is 1.
    fn strided(tensor: &FloatTensor<Self>) -> Option<Strided<'_>>;

    /// The f32 elements of a rank-4 `tensor` for writing, from its first one on, and its four
    /// strides, the last 1 (or that of an axis of length 1); `None` for other dtypes. A tensor in another layout is made
    /// contiguous first, and one that shares its buffer with another tensor is copied
    /// (copy-on-write), so that the other keeps its values.
    fn writable(tensor: &mut FloatTensor<Self>) -> Option<StridedMut<'_>>;

    /// [`CpuStorage::writable`] for i8.
    fn int8_writable(tensor: &mut IntTensor<Self>) -> Option<StridedMut<'_, i8>>;

    /// [`CpuStorage::writable`] for f16; `None` where the backend has no f16 tensors (ndarray).
    fn half_writable(tensor: &mut FloatTensor<Self>) -> Option<StridedMut<'_, f16>> {
        let _ = tensor;
        None
    }

    /// `tensor` itself, or a copy in a layout [`CpuStorage::int8_strided`] reads, for i8.
    fn int8_readable(tensor: &IntTensor<Self>) -> Option<IntTensor<Self>>;

    /// The i8 elements from the tensor's first one on, and its four strides, if all are
    /// non-negative and the last is 1.
    fn int8_strided(tensor: &IntTensor<Self>) -> Option<Strided<'_, i8>>;

    /// `tensor` itself, or a copy in a layout [`CpuStorage::half_strided`] reads, for f16;
    /// `None` where the backend has no f16 tensors (ndarray).
    fn half_readable(tensor: &FloatTensor<Self>) -> Option<FloatTensor<Self>> {
        let _ = tensor;
        None
    }

    /// The f16 elements from the tensor's first one on, and its four strides, if all are
    /// non-negative and the last is 1.
    fn half_strided(tensor: &FloatTensor<Self>) -> Option<Strided<'_, f16>> {
        let _ = tensor;
        None
    }

    /// A tensor of logical shape `[batch, heads, seq, dim]` over `values` laid out
    /// `[batch, seq, heads, dim]`, without a copy: an output handed over to the caller.
    fn sequence_major(values: Vec<f32>, shape: [usize; 4]) -> FloatTensor<Self>;

    /// A contiguous tensor of `shape` over `values`, without a copy: an output handed over to
    /// the caller.
    fn contiguous(values: Vec<f32>, shape: [usize; 4]) -> FloatTensor<Self>;

    /// A buffer for an output of `length` elements, every one of which the caller writes (its
    /// values are unspecified, or NaN where `fresh` asks for that).
    fn output_buffer(length: usize, fresh: FreshOutputs) -> Vec<f32> {
        buffers::buffer(length, Self::BUFFERS, fresh)
    }

    /// A buffer of `length` elements, each `value`.
    fn filled_buffer(length: usize, value: f32) -> Vec<f32> {
        buffers::filled(length, value, Self::BUFFERS)
    }

    /// A rank-4 f32 tensor as a [`HeadsView`], if [`CpuStorage::strided`] reads it.
    ///
    /// # Panics
    ///
    /// If the tensor is not of rank 4.
    fn heads_view(tensor: &FloatTensor<Self>) -> Option<HeadsView<'_>> {
        let strided = Self::strided(tensor)?;
        Some(HeadsView::new(strided, rank_4(tensor)))
    }

    /// A rank-4 f16 tensor as a [`HeadsView`], if [`CpuStorage::half_strided`] reads it.
    ///
    /// # Panics
    ///
    /// If the tensor is not of rank 4.
    fn half_heads_view(tensor: &FloatTensor<Self>) -> Option<HeadsView<'_, f16>> {
        let strided = Self::half_strided(tensor)?;
        Some(HeadsView::new(strided, rank_4(tensor)))
    }

    /// A rank-4 i8 tensor as a [`HeadsView`], if [`CpuStorage::int8_strided`] reads it.
    ///
    /// # Panics
    ///
    /// If the tensor is not of rank 4.
    fn int8_heads_view(tensor: &IntTensor<Self>) -> Option<HeadsView<'_, i8>> {
        let strided = Self::int8_strided(tensor)?;
        Some(HeadsView::new(strided, rank_4(tensor)))
    }
}

/// The four sizes of a rank-4 tensor.
///
/// # Panics
///
/// If it is not of rank 4.
pub(crate) fn rank_4(tensor: &impl TensorMetadata) -> [usize; 4] {
    let shape = tensor.shape();
    assert_eq!(
        shape.num_dims(),
        4,
        "CPU kernel: tensors must have rank 4, got shape {shape:?}"
    );
    [shape[0], shape[1], shape[2], shape[3]]
}

/// Whether `device` (autodiff or not) stores its tensors in a backend [`CpuStorage`] covers:
/// flex and ndarray, where this crate's features of those names are on.
pub(crate) fn native_storage(device: &Device) -> bool {
    fn native(device: &DispatchDevice) -> bool {
        match device {
            #[cfg(feature = "flex")]
            DispatchDevice::Flex(_) => true,
            #[cfg(feature = "ndarray")]
            DispatchDevice::NdArray(_) => true,
            DispatchDevice::Autodiff(inner) => native(inner),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
    native(device.as_dispatch())
}

#[cfg(feature = "flex")]
impl CpuStorage for burn::backend::Flex {
    /// Flex's storage of an output gives its buffer back to the pool ([`buffers::into_bytes`]).
    const BUFFERS: BufferSource = BufferSource::Pool;

    fn readable(tensor: &FloatTensor<Self>) -> Option<FloatTensor<Self>> {
        if tensor.dtype() != DType::F32 {
            return None;
        }
        Some(match Self::strided(tensor) {
            Some(_) => tensor.clone(),
            None => tensor.to_contiguous(),
        })
    }

    fn strided(tensor: &FloatTensor<Self>) -> Option<Strided<'_>> {
        let (start, strides) = flex_strides(tensor, DType::F32)?;
        let values = tensor.storage::<f32>().get(start..)?;
        Some(Strided { values, strides })
    }

    fn writable(tensor: &mut FloatTensor<Self>) -> Option<StridedMut<'_>> {
        flex_writable(tensor, DType::F32, |tensor| tensor.storage_mut::<f32>())
    }

    fn int8_writable(tensor: &mut IntTensor<Self>) -> Option<StridedMut<'_, i8>> {
        flex_writable(tensor, DType::I8, |tensor| tensor.storage_mut::<i8>())
    }

    fn half_writable(tensor: &mut FloatTensor<Self>) -> Option<StridedMut<'_, f16>> {
        flex_writable(tensor, DType::F16, |tensor| tensor.storage_mut::<f16>())
    }

    fn int8_readable(tensor: &IntTensor<Self>) -> Option<IntTensor<Self>> {
        if tensor.dtype() != DType::I8 {
            return None;
        }
        Some(match Self::int8_strided(tensor) {
            Some(_) => tensor.clone(),
            None => tensor.to_contiguous(),
        })
    }

    fn int8_strided(tensor: &IntTensor<Self>) -> Option<Strided<'_, i8>> {
        let (start, strides) = flex_strides(tensor, DType::I8)?;
        let values = tensor.storage::<i8>().get(start..)?;
        Some(Strided { values, strides })
    }

    fn half_readable(tensor: &FloatTensor<Self>) -> Option<FloatTensor<Self>> {
        if tensor.dtype() != DType::F16 {
            return None;
        }
        Some(match Self::half_strided(tensor) {
            Some(_) => tensor.clone(),
            None => tensor.to_contiguous(),
        })
    }

    fn half_strided(tensor: &FloatTensor<Self>) -> Option<Strided<'_, f16>> {
        let (start, strides) = flex_strides(tensor, DType::F16)?;
        let values = tensor.storage::<f16>().get(start..)?;
        Some(Strided { values, strides })
    }

    fn sequence_major(values: Vec<f32>, shape: [usize; 4]) -> FloatTensor<Self> {
        use burn::backend::flex::{FlexTensor, Layout};
        let [_, heads, seq, dim] = shape;
        let strides = [seq * heads * dim, dim, heads * dim, 1].map(|s| s as isize);
        FlexTensor::new(
            buffers::into_bytes(values),
            Layout::new(burn::backend::Shape::new(shape), strides.to_vec(), 0),
            DType::F32,
        )
    }

    fn contiguous(values: Vec<f32>, shape: [usize; 4]) -> FloatTensor<Self> {
        use burn::backend::flex::{FlexTensor, Layout};
        FlexTensor::new(
            buffers::into_bytes(values),
            Layout::contiguous(burn::backend::Shape::new(shape)),
            DType::F32,
        )
    }
}

/// Where a flex tensor of `dtype` starts in its storage and its strides, if they are
/// non-negative and the last is 1.
#[cfg(feature = "flex")]
fn flex_strides(
    tensor: &burn::backend::flex::FlexTensor,
    dtype: DType,
) -> Option<(usize, [usize; 4])> {
    if tensor.dtype() != dtype {
        return None;
    }
    let layout = tensor.layout();
    if layout.strides().len() != 4 {
        return None;
    }
    let shape = [0, 1, 2, 3].map(|axis| layout.shape()[axis]);
    let strides = kernel_strides(&shape, layout.strides())?;
    Some((layout.start_offset(), strides))
}

/// A flex tensor of `dtype`'s elements for writing ([`CpuStorage::writable`]), through
/// `storage`, its elements as a mutable slice of the dtype's type.
#[cfg(feature = "flex")]
fn flex_writable<'t, E>(
    tensor: &'t mut burn::backend::flex::FlexTensor,
    dtype: DType,
    storage: impl FnOnce(&'t mut burn::backend::flex::FlexTensor) -> &'t mut [E],
) -> Option<StridedMut<'t, E>> {
    if tensor.dtype() != dtype {
        return None;
    }
    // A layout the kernels do not read, or one where two elements share a place (a stride
    // of 0 on a longer axis: a broadcast), is written through a contiguous copy.
    let shared_places = |strides: [usize; 4]| {
        let shape = rank_4(&*tensor);
        (0..4).any(|axis| strides[axis] == 0 && shape[axis] > 1)
    };
    if flex_strides(tensor, dtype).is_none_or(|(_, strides)| shared_places(strides)) {
        *tensor = tensor.to_contiguous();
    }
    let (start, strides) = flex_strides(tensor, dtype)?;
    // A buffer shared with another tensor is copied here (flex's copy-on-write).
    let values = storage(tensor).get_mut(start..)?;
    Some(StridedMut { values, strides })
}

/// A row-major copy of an ndarray view (of a layout the kernels do not read in place).
#[cfg(feature = "ndarray")]
fn standard_copy<E: Clone>(
    view: ndarray::ArrayViewD<'_, E>,
) -> ndarray::ArcArray<E, ndarray::IxDyn> {
    view.as_standard_layout().into_owned().into_shared()
}

/// An ndarray array's elements for writing ([`CpuStorage::writable`]), the array owned by its
/// tensor (`ensure_owned`).
#[cfg(feature = "ndarray")]
fn ndarray_writable<E: Clone>(
    array: &mut ndarray::ArcArray<E, ndarray::IxDyn>,
) -> Option<StridedMut<'_, E>> {
    // Unique from here on, so that the strides read below are the ones written through: a
    // contiguous array's shared buffer is copied here (ndarray's copy-on-write), any other
    // array is replaced by a standard-layout copy below.
    let contiguous = array.as_slice_memory_order_mut().is_some();
    if !contiguous || kernel_strides(array.shape(), array.strides()).is_none() {
        *array = standard_copy(array.view());
    }
    let strides = kernel_strides(array.shape(), array.strides())?;
    let values = array.as_slice_memory_order_mut()?;
    Some(StridedMut { values, strides })
}

#[cfg(feature = "ndarray")]
impl CpuStorage for burn::backend::NdArray {
    /// ndarray's tensors own plain vectors, freed when they drop.
    const BUFFERS: BufferSource = BufferSource::Allocator;

    fn readable(tensor: &FloatTensor<Self>) -> Option<FloatTensor<Self>> {
        use burn::backend::ndarray::NdArrayTensor;
        let NdArrayTensor::F32(storage) = tensor else {
            return None;
        };
        Some(match Self::strided(tensor) {
            Some(_) => tensor.clone(),
            None => NdArrayTensor::from(standard_copy(storage.view())),
        })
    }

    fn strided(tensor: &FloatTensor<Self>) -> Option<Strided<'_>> {
        let burn::backend::ndarray::NdArrayTensor::F32(storage) = tensor else {
            return None;
        };
        super::matrix::ndarray_elements(storage.view())
    }

    fn writable(tensor: &mut FloatTensor<Self>) -> Option<StridedMut<'_>> {
        let burn::backend::ndarray::NdArrayTensor::F32(storage) = tensor else {
            return None;
        };
        ndarray_writable(storage.ensure_owned())
    }

    fn int8_writable(tensor: &mut IntTensor<Self>) -> Option<StridedMut<'_, i8>> {
        let burn::backend::ndarray::NdArrayTensor::I8(storage) = tensor else {
            return None;
        };
        ndarray_writable(storage.ensure_owned())
    }

    fn int8_readable(tensor: &IntTensor<Self>) -> Option<IntTensor<Self>> {
        use burn::backend::ndarray::NdArrayTensor;
        let NdArrayTensor::I8(storage) = tensor else {
            return None;
        };
        Some(match Self::int8_strided(tensor) {
            Some(_) => tensor.clone(),
            None => NdArrayTensor::from(standard_copy(storage.view())),
        })
    }

    fn int8_strided(tensor: &IntTensor<Self>) -> Option<Strided<'_, i8>> {
        let burn::backend::ndarray::NdArrayTensor::I8(storage) = tensor else {
            return None;
        };
        super::matrix::ndarray_elements(storage.view())
    }

    fn sequence_major(values: Vec<f32>, shape: [usize; 4]) -> FloatTensor<Self> {
        use burn::backend::ndarray::NdArrayTensor;
        use ndarray::{ArcArray, IxDyn, ShapeBuilder};
        let [_, heads, seq, dim] = shape;
        let strides = [seq * heads * dim, dim, heads * dim, 1];
        let array = ArcArray::from_shape_vec(IxDyn(&shape).strides(IxDyn(&strides)), values)
            .expect("sequence-major strides fit the buffer");
        NdArrayTensor::from(array)
    }

    fn contiguous(values: Vec<f32>, shape: [usize; 4]) -> FloatTensor<Self> {
        use burn::backend::ndarray::NdArrayTensor;
        use ndarray::{ArcArray, IxDyn};
        let array =
            ArcArray::from_shape_vec(IxDyn(&shape), values).expect("the shape fits the buffer");
        NdArrayTensor::from(array)
    }
}

#[cfg(all(test, feature = "flex", feature = "ndarray"))]
mod tests {
    use super::*;
    use burn::backend::{Flex, NdArray, TensorData};

    use crate::cpu::matrix::HeadIndex;

    /// The f32 elements of a primitive, in its logical order.
    fn elements<B: Backend>(tensor: FloatTensor<B>) -> Vec<f32> {
        burn_std::reader::try_read_sync(B::float_into_data(tensor))
            .expect("read")
            .expect("data")
            .to_vec::<f32>()
            .expect("f32")
    }

    /// A backend reads a head-split view (`[batch, seq, heads, dim]` memory) in place with its
    /// strides, copies a flipped one into a layout it reads, and leaves f64 alone.
    fn reads_views_in_place_and_copies_other_layouts<B: CpuStorage>() {
        let device = Default::default();
        let values: Vec<f32> = (0..120).map(|i| i as f32).collect();
        let memory = B::float_from_data(TensorData::new(values, [2, 3, 4, 5]), &device);
        // Element (b, h, s, d) of the heads view is memory element 60 b + 20 s + 5 h + d.
        let heads = B::float_swap_dims(memory, 1, 2);
        let flipped = B::float_flip(heads.clone(), &[2]);
        let index = HeadIndex { batch: 1, head: 2 };
        let row_start = |seq: usize| 60 + 20 * seq + 5 * 2;
        assert!(
            B::strided(&heads).is_some(),
            "a head split is read in place"
        );
        // Row 0 of the flipped view is row 2 of the heads.
        for (tensor, row, seq) in [(&heads, 1, 1), (&flipped, 0, 2)] {
            let readable = B::readable(tensor).expect("f32");
            let view = B::heads_view(&readable).expect("readable");
            let read = view.row(index, row).to_vec();
            let start = row_start(seq) as f32;
            let expected: Vec<f32> = (0..5).map(|d| start + d as f32).collect();
            assert_eq!(read, expected);
        }
        let f64 = B::float_from_data(TensorData::new(vec![0.0f64; 4], [1, 1, 2, 2]), &device);
        assert!(
            B::readable(&f64).is_none(),
            "f64 is left to the generic body"
        );
    }

    #[test]
    fn both_backends_read_views_in_place_and_copy_other_layouts() {
        reads_views_in_place_and_copies_other_layouts::<Flex>();
        reads_views_in_place_and_copies_other_layouts::<NdArray>();
    }

    /// As [`reads_views_in_place_and_copies_other_layouts`], for i8 (an int8 cache's values).
    fn reads_int8_views_in_place_and_copies_other_layouts<B: CpuStorage>() {
        let device = Default::default();
        let values: Vec<i8> = (0..120).map(|i| (i - 60) as i8).collect();
        let memory = B::int_from_data(TensorData::new(values, [2, 3, 4, 5]), &device);
        let heads = B::int_swap_dims(memory, 1, 2);
        let flipped = B::int_flip(heads.clone(), &[2]);
        let index = HeadIndex { batch: 1, head: 2 };
        let row_start = |seq: usize| 60 + 20 * seq + 5 * 2 - 60;
        assert!(B::int8_strided(&heads).is_some(), "read in place");
        for (tensor, row, seq) in [(&heads, 1, 1), (&flipped, 0, 2)] {
            let readable = B::int8_readable(tensor).expect("i8");
            let view = B::int8_heads_view(&readable).expect("readable");
            let expected: Vec<i8> = (0..5).map(|d| (row_start(seq) + d) as i8).collect();
            assert_eq!(view.row(index, row), expected.as_slice());
        }
        let i32s = B::int_from_data(TensorData::new(vec![0i32; 4], [1, 1, 2, 2]), &device);
        assert!(B::int8_readable(&i32s).is_none(), "only i8");
    }

    #[test]
    fn both_backends_read_int8_views_in_place_and_copy_other_layouts() {
        reads_int8_views_in_place_and_copies_other_layouts::<Flex>();
        reads_int8_views_in_place_and_copies_other_layouts::<NdArray>();
    }

    /// A sequence-major output reads back as its logical shape.
    fn sequence_major_outputs_read_as_their_logical_shape<B: CpuStorage>() {
        // [batch 1, seq 3, heads 2, dim 2] memory: element (h, s, d) at 4 s + 2 h + d.
        let values: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let logical = [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11].map(|i| i as f32);
        assert_eq!(
            elements::<B>(B::sequence_major(values.clone(), [1, 2, 3, 2])),
            logical
        );
        assert_eq!(
            elements::<B>(B::contiguous(values.clone(), [1, 2, 3, 2])),
            values
        );
    }

    #[test]
    fn both_backends_hand_outputs_over_in_either_layout() {
        sequence_major_outputs_read_as_their_logical_shape::<Flex>();
        sequence_major_outputs_read_as_their_logical_shape::<NdArray>();
    }

    #[test]
    fn native_storage_is_flex_and_ndarray_with_or_without_autodiff() {
        #[allow(deprecated)]
        let ndarray = Device::ndarray();
        for device in [Device::flex(), ndarray] {
            assert!(native_storage(&device));
            assert!(native_storage(&device.autodiff()));
        }
    }
}
