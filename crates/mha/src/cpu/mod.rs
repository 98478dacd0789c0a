//! The CPU layer: what the native kernels on flex's and ndarray's f32 storage share (the flash
//! op's kernel in `flash/cpu/`, and the projections here). It is the ground floor: nothing in it
//! imports `flash/`, `module.rs` or the caches; they import it.
//!
//! - `storage.rs`: the backends' storage as strided f32 slices, and outputs handed back as
//!   tensors without a copy;
//! - `matrix.rs`: strided matrices, the `gemm` wrapper and the task runner (the unsafe code);
//! - `simd.rs`: row kernels compiled for AVX-512 and AVX2 + FMA, picked at run time;
//! - `capability.rs`: which of those copies run (`MHA_CPU_CAPABILITY` caps it);
//! - `buffers.rs`: the bounded pool of output buffers (`mha::buffer_pool`);
//! - `linear.rs`: `x · W + b` as one op with its own backward;
//! - `rotary.rs`: RoPE's rotation as one op, its backward the inverse rotation;
//! - `gelu.rs`: the GELU (exact or tanh-approximated) as one vectorised op, with its backward;
//! - `aligned.rs`: zero tensors whose memory starts on a cache line, for the caches' buffers on
//!   flex (compiled with any backend; without flex it always declines).
//!
//! All of it but `aligned.rs` needs a CPU backend compiled in (this crate's `flex` or `ndarray`
//! feature); without one, no projection runs natively.

pub(crate) mod aligned;
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) mod buffers;
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) mod capability;
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) mod gelu;
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) mod linear;
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) mod matrix;
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) mod rotary;
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) mod simd;
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) mod storage;

#[cfg(any(feature = "flex", feature = "ndarray"))]
pub use capability::{CPU_CAPABILITY_VARIABLE, CpuCapability, cpu_capability};
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) use gelu::{GeluKind, native_gelu};
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) use linear::{native_linear, native_packed_linear};
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) use rotary::native_rotation;
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) use storage::native_storage;

/// `f` of every item, in order, on rayon's threads where `parallel` (independent pieces of one
/// call, each too small to fill the threads alone, so that they share the threads instead of
/// taking turns), else one after the other on the calling thread.
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) fn map_in_parallel<T: Send, R: Send>(
    items: Vec<T>,
    parallel: bool,
    f: impl Fn(T) -> R + Sync + Send,
) -> Vec<R> {
    use rayon::iter::{IntoParallelIterator, ParallelIterator};
    if parallel {
        items.into_par_iter().map(f).collect()
    } else {
        items.into_iter().map(f).collect()
    }
}

/// Without a CPU backend compiled in, one item after the other.
#[cfg(not(any(feature = "flex", feature = "ndarray")))]
pub(crate) fn map_in_parallel<T: Send, R: Send>(
    items: Vec<T>,
    _parallel: bool,
    f: impl Fn(T) -> R + Sync + Send,
) -> Vec<R> {
    items.into_iter().map(f).collect()
}

/// Without a CPU backend compiled in, no device stores its tensors where the native kernels
/// read them.
#[cfg(not(any(feature = "flex", feature = "ndarray")))]
pub(crate) fn native_storage(_: &burn::tensor::Device) -> bool {
    false
}

/// Without a CPU backend compiled in, no projection runs natively: `Linear::forward` it is.
#[cfg(not(any(feature = "flex", feature = "ndarray")))]
pub(crate) fn native_linear(
    _: &burn::nn::Linear,
    _: &burn::tensor::Tensor<3>,
) -> Option<burn::tensor::Tensor<3>> {
    None
}

/// As [`native_linear`].
#[cfg(not(any(feature = "flex", feature = "ndarray")))]
pub(crate) fn native_packed_linear(
    _: [&burn::nn::Linear; 3],
    _: &burn::tensor::Tensor<3>,
) -> Option<burn::tensor::Tensor<3>> {
    None
}

/// Without a CPU backend compiled in, no rotation runs natively: the tensor ops it is.
#[cfg(not(any(feature = "flex", feature = "ndarray")))]
pub(crate) fn native_rotation(
    _: &burn::tensor::Tensor<4>,
    _: impl FnOnce() -> crate::rotary::Rotation,
) -> Option<burn::tensor::Tensor<4>> {
    None
}

/// Which GELU (as `gelu::GeluKind`), where no CPU backend is compiled in.
#[cfg(not(any(feature = "flex", feature = "ndarray")))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GeluKind {
    Exact,
    Tanh,
}

/// Without a CPU backend compiled in, no GELU runs natively: Burn's it is.
#[cfg(not(any(feature = "flex", feature = "ndarray")))]
pub(crate) fn native_gelu(
    _: &burn::tensor::Tensor<3>,
    _: GeluKind,
) -> Option<burn::tensor::Tensor<3>> {
    None
}
