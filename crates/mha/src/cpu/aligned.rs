//! Zero tensors whose memory starts on a cache line, for the caches' buffers on flex.
//!
//! A decoding step reads a cache's rows (a key or value row of 64 f32 features is 256 bytes; a
//! paged block's feature-major key row of 16 f32 positions is 64) one cache line after another.
//! glibc hands out large allocations 16 bytes past a page boundary, so each such row then spans
//! one cache line more than it needs to: 5 lines instead of 4, or 2 instead of 1. The caches grow
//! their buffers through [`line_aligned_zeros`], whose memory starts on a 64-byte boundary, and
//! flex keeps that memory as the tensor's storage (it keeps a `TensorData`'s bytes, and writes
//! into them in place while one tensor holds them).
//!
//! Only flex, outside autodiff: ndarray copies a `TensorData` into a `Vec` of its own, and the
//! GPU backends allocate their own memory.

use burn::tensor::kind::Basic;
use burn::tensor::{DType, Device, Tensor};

/// A `shape` tensor of zeros in `dtype` whose memory starts on a cache line's boundary, on a
/// flex device outside autodiff; `None` on any other device (the caller then allocates as it
/// did, e.g. with `Tensor::zeros`).
#[cfg(feature = "flex")]
pub(crate) fn line_aligned_zeros<const D: usize, K: Basic>(
    shape: [usize; D],
    device: &Device,
    dtype: DType,
) -> Option<Tensor<D, K>> {
    use burn::backend::DispatchDevice;
    use burn::tensor::TensorData;

    if !matches!(device.as_dispatch(), DispatchDevice::Flex(_)) {
        return None;
    }
    let bytes = shape.iter().product::<usize>() * dtype.size();
    let data = TensorData::from_bytes(controller::zeroed_bytes(bytes), shape, dtype);
    Some(Tensor::from_data(data, (device, dtype)))
}

/// Without flex, no device keeps the memory it is given.
#[cfg(not(feature = "flex"))]
pub(crate) fn line_aligned_zeros<const D: usize, K: Basic>(
    _shape: [usize; D],
    _device: &Device,
    _dtype: DType,
) -> Option<Tensor<D, K>> {
    None
}

/// `tensor` in a buffer of its own that starts on a cache line on flex
/// ([`line_aligned_zeros`]); elsewhere `tensor` as it is.
pub(crate) fn line_aligned<const D: usize, K: Basic>(tensor: Tensor<D, K>) -> Tensor<D, K> {
    let dims = tensor.dims();
    match line_aligned_zeros(dims, &tensor.device(), tensor.dtype()) {
        Some(zeros) => zeros.slice_assign(dims.map(|size| 0..size), tensor),
        None => tensor,
    }
}

/// `tensor` with `extra` zero entries after its own along `axis`, in a new buffer: one that
/// starts on a cache line on flex ([`line_aligned_zeros`]), else `Tensor::cat`'s.
pub(crate) fn with_zeros_after<const D: usize, K: Basic>(
    tensor: Tensor<D, K>,
    axis: usize,
    extra: usize,
) -> Tensor<D, K> {
    let (device, dtype, dims) = (tensor.device(), tensor.dtype(), tensor.dims());
    let mut shape = dims;
    shape[axis] += extra;
    match line_aligned_zeros(shape, &device, dtype) {
        Some(zeros) => zeros.slice_assign(dims.map(|size| 0..size), tensor),
        None => {
            shape[axis] = extra;
            Tensor::cat(vec![tensor, Tensor::zeros(shape, (&device, dtype))], axis)
        }
    }
}

#[cfg(feature = "flex")]
mod controller {
    use std::mem::MaybeUninit;

    use burn::backend::Bytes;
    use burn_std::{AccessError, AccessPolicy, AllocationController, AllocationProperty};

    use crate::cpu::simd::CACHE_LINE;

    /// One cache line of bytes: a slice of them is an allocation aligned to a line.
    #[derive(Clone, Copy)]
    #[repr(C, align(64))]
    struct Line([u8; CACHE_LINE]);

    const _: () = assert!(align_of::<Line>() == CACHE_LINE);

    /// Memory in whole cache lines, handed to flex as a tensor's storage.
    pub(super) struct Lines {
        lines: Box<[Line]>,
    }

    /// Zero lines enough for `bytes` bytes.
    pub(super) fn zeroed_lines(bytes: usize) -> Lines {
        Lines {
            lines: vec![Line([0; CACHE_LINE]); bytes.div_ceil(CACHE_LINE)].into_boxed_slice(),
        }
    }

    /// `bytes` zero bytes, their first on a line boundary.
    pub(super) fn zeroed_bytes(bytes: usize) -> Bytes {
        let lines = zeroed_lines(bytes);
        // SAFETY: the controller's memory is `lines.len() · 64 ≥ bytes` bytes, all of them
        // initialised (zero).
        unsafe { Bytes::from_controller(Box::new(lines), bytes) }
    }

    impl AllocationController for Lines {
        fn alloc_align(&self) -> usize {
            CACHE_LINE
        }

        fn property(&self) -> AllocationProperty {
            AllocationProperty::Native
        }

        unsafe fn memory_mut(
            &mut self,
            _policy: AccessPolicy,
        ) -> Result<&mut [MaybeUninit<u8>], AccessError> {
            let bytes = self.capacity();
            // SAFETY: the boxed slice spans `capacity()` bytes, borrowed mutably with `self`;
            // `Line` is plain bytes, so any bytes the caller writes leave valid lines.
            Ok(unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast(), bytes) })
        }

        fn memory(&self, _policy: AccessPolicy) -> Result<&[MaybeUninit<u8>], AccessError> {
            // SAFETY: as in `memory_mut`, borrowed immutably.
            Ok(unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast(), self.capacity()) })
        }

        fn capacity(&self) -> usize {
            self.lines.len() * CACHE_LINE
        }

        // A copy (copy-on-write of a tensor two hold) keeps the alignment. Without this,
        // `Bytes::clone` would copy through cubecl's native controller at `alloc_align()`,
        // which asserts (in debug builds) an alignment of 16 at most. `Bytes::split` with an
        // owned policy would do the same; neither flex nor Burn 0.22.1 splits a tensor's bytes.
        fn duplicate(&self) -> Option<Box<dyn AllocationController>> {
            Some(Box::new(Lines {
                lines: self.lines.clone(),
            }))
        }

        // `try_detach` stays `None`: the memory cannot become a `Vec` of elements, which would
        // free it with the elements' alignment, not the line's.
    }
}

/// Whether `tensor`'s memory starts on a line boundary and is held with that alignment, read
/// through a copy-free `into_data` (the tensor held once, contiguous, whole).
#[cfg(all(test, feature = "flex"))]
pub(crate) fn starts_on_a_line<const D: usize, K: Basic>(tensor: Tensor<D, K>) -> bool {
    use crate::cpu::simd::CACHE_LINE;

    let data = tensor.into_data();
    let bytes = data.bytes();
    bytes.align() == CACHE_LINE && (bytes.as_ptr() as usize).is_multiple_of(CACHE_LINE)
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use burn::tensor::{Float, Int, Tensor};

    use super::*;
    use crate::cpu::simd::CACHE_LINE;

    #[test]
    fn zeros_on_flex_start_on_a_line_and_stay_there_when_written() {
        let device = Device::flex();
        for dtype in [DType::F32, DType::F16] {
            let zeros = line_aligned_zeros::<4, Float>([3, 2, 5, 7], &device, dtype)
                .expect("flex gives aligned zeros");
            assert_eq!(zeros.dtype(), dtype);
            assert_eq!(zeros.clone().abs().sum().into_scalar::<f32>(), 0.0);
            // An assignment into a tensor held once writes in place.
            let ones = Tensor::<4>::ones([3, 2, 1, 7], (&device, dtype));
            let written = zeros.slice_assign([0..3, 0..2, 4..5, 0..7], ones);
            assert_eq!(written.clone().sum().into_scalar::<f32>(), 42.0);
            assert!(starts_on_a_line(written));
        }
        let int8: Tensor<4, Int> = line_aligned_zeros([2, 2, 3, 3], &device, DType::I8).unwrap();
        assert_eq!(int8.dtype(), DType::I8);
        assert!(starts_on_a_line(int8));
    }

    #[test]
    fn a_duplicate_and_a_copy_of_the_bytes_start_on_a_line() {
        // `Bytes::clone` is what flex's copy-on-write (`Arc::make_mut`) calls when a kernel
        // writes into a buffer another tensor shares.
        use burn_std::{AccessPolicy, AllocationController};

        let mut lines = controller::zeroed_lines(1000);
        // SAFETY: a byte is written through the controller's own memory, within its capacity.
        unsafe { lines.memory_mut(AccessPolicy::default()).unwrap()[5].write(3) };
        let duplicate = lines.duplicate().expect("a duplicate keeps the alignment");
        let memory = duplicate.memory(AccessPolicy::default()).unwrap();
        assert_eq!(memory.len(), 1024);
        assert!((memory.as_ptr() as usize).is_multiple_of(CACHE_LINE));
        // SAFETY: every byte of the lines is initialised.
        assert_eq!(unsafe { memory[5].assume_init() }, 3);

        let bytes = controller::zeroed_bytes(1000);
        let mut copy = bytes.clone();
        copy[999] = 7;
        assert_eq!((bytes[999], copy[999]), (0, 7));
        for held in [&bytes, &copy] {
            assert_eq!((held.len(), held.align()), (1000, CACHE_LINE));
            assert!((held.as_ptr() as usize).is_multiple_of(CACHE_LINE));
        }
    }

    #[test]
    fn an_assignment_into_a_shared_buffer_leaves_the_other_holder_its_values() {
        let device = Device::flex();
        let zeros: Tensor<4> = line_aligned_zeros([1, 1, 4, 16], &device, DType::F32).unwrap();
        let kept = zeros.clone();
        let ones = Tensor::<4>::ones([1, 1, 1, 16], &device);
        let written = zeros.slice_assign([0..1, 0..1, 0..1, 0..16], ones);
        assert_eq!(written.sum().into_scalar::<f32>(), 16.0);
        assert_eq!(kept.clone().sum().into_scalar::<f32>(), 0.0);
        assert!(starts_on_a_line(kept));
    }

    #[test]
    fn other_devices_get_none() {
        let device = Device::flex().autodiff();
        assert!(line_aligned_zeros::<2, Int>([2, 2], &device, DType::I32).is_none());
        #[cfg(feature = "ndarray")]
        {
            #[allow(deprecated)]
            let ndarray = Device::ndarray();
            assert!(line_aligned_zeros::<2, Int>([2, 2], &ndarray, DType::I32).is_none());
        }
    }
}
