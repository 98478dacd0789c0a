//! Memory-bounded attention for training: one autodiff op whose forward runs query blocks ×
//! key blocks with an online softmax and keeps only the output and each query's softmax
//! statistics (maximum and inverse sum), and whose backward recomputes every score block from
//! them (FlashAttention-2's backward, Dao 2023, Algorithm 2).
//!
//! Chunking with ordinary tensor ops bounds inference memory only: under autodiff every block's
//! scores and probabilities are kept for the backward pass, which is the full score matrix
//! again. Per-chunk gradient checkpointing would avoid that too, but Burn's checkpointing is a
//! strategy of the whole device, not something one op can ask for, and it would run each
//! block's forward twice. A custom backward node keeps `O(seq · head_dim)` state and costs one
//! extra `q kᵀ` product per block.
//!
//! The op is a Burn backend extension routed to the backends listed on
//! [`FlashAttentionBackend`]; [`flash_attention_supported`] says whether a device is one of
//! them, since calling it on another panics. Each backend gets its forward and backward from
//! [`FlashKernels`]: the generic body in backend primitives (`generic.rs`), or native kernels
//! that fall back to the generic body for what they do not take: `cpu/` (flex and ndarray f32
//! storage) and `cube/` (CubeCL kernels for the GPU backends, f32, f16 and bf16).
//!
//! - `inputs.rs`: what a call takes, keeps and returns, and the checks at every body's entry;
//! - `autodiff.rs`: the autodiff node;
//! - `precision.rs`: half-precision calls computed in f32;
//! - `generic.rs`, `cpu/`, `cube/`: the bodies.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, DispatchDevice, backend_extension};
use burn::tensor::{Bool, Device, Tensor};

use crate::execution::{Body, Execution, Pass, Ran};
use crate::extension::{MaybeBool, MaybeFloat};
use crate::input::BlockSizes;
use crate::kernel::SoftmaxOptions;
use crate::mask::ScoreMasks;

mod autodiff;
#[cfg(any(feature = "flex", feature = "ndarray"))]
mod cpu;
#[cfg(feature = "cube")]
mod cube;
mod generic;
mod inputs;
mod precision;
#[cfg(test)]
mod tests;

pub(crate) use inputs::{FlashForward, FlashGrads, FlashInputs, FlashParams, FlashState};

/// Backends with a memory-bounded attention op whose backward recomputes the scores.
///
/// The default body is generic over the backend's primitives; autodiff gets the handwritten
/// backward of `autodiff.rs`.
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray"),
    Cube: cfg(any(feature = "wgpu", feature = "vulkan", feature = "metal", feature = "cuda", feature = "rocm")),
    Autodiff
)]
pub(crate) trait FlashAttentionBackend: Backend {
    /// `softmax(cap(q kᵀ · scale) + bias, forbidden keys removed, sinks in the denominator) v`
    /// by blocks.
    ///
    /// # Shapes
    ///
    /// - query: `[batch, n_heads, seq_q, head_dim]`
    /// - key: `[batch, n_kv_heads, seq_k, head_dim]`, `n_heads` a multiple of `n_kv_heads`
    /// - value: `[batch, n_kv_heads, seq_k, value_dim]`
    /// - bias, forbid: broadcastable to `[batch, n_heads, seq_q, seq_k]`; the bias is treated as
    ///   a constant (it gets no gradient)
    /// - sinks: `[n_heads]`, one more logit per head in every softmax's denominator
    /// - output: `[batch, n_heads, seq_q, value_dim]`; a query with no allowed key outputs zeros
    // Without a backend feature (the macro's arms' conditions) its dispatch function has no
    // arm that passes `params` on.
    #[cfg_attr(
        not(any(
            feature = "flex",
            feature = "ndarray",
            feature = "wgpu",
            feature = "vulkan",
            feature = "metal",
            feature = "cuda",
            feature = "rocm"
        )),
        allow(unused_variables)
    )]
    fn flash_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        #[extension_type] bias: MaybeFloat<Self>,
        #[extension_type] forbid: MaybeBool<Self>,
        #[extension_type] sinks: MaybeFloat<Self>,
        params: FlashParams,
    ) -> FloatTensor<Self> {
        let inputs = FlashInputs::new(query, key, value, bias, forbid, sinks, params);
        precision::forward(&inputs, generic::forward).output
    }

    /// [`flash_attention`](Self::flash_attention) and the attention weights
    /// `[batch, n_heads, seq_q, seq_k]` (zero for hidden keys), for inference: neither output
    /// takes part in a gradient.
    ///
    /// # Shapes
    ///
    /// As [`flash_attention`](Self::flash_attention).
    ///
    /// # Panics
    ///
    /// On an autodiff backend, if an input is tracked.
    // Without a backend feature (the macro's arms' conditions) its dispatch function has no
    // arm that passes `params` on.
    #[cfg_attr(
        not(any(
            feature = "flex",
            feature = "ndarray",
            feature = "wgpu",
            feature = "vulkan",
            feature = "metal",
            feature = "cuda",
            feature = "rocm"
        )),
        allow(unused_variables)
    )]
    fn flash_attention_weights(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        #[extension_type] bias: MaybeFloat<Self>,
        #[extension_type] forbid: MaybeBool<Self>,
        #[extension_type] sinks: MaybeFloat<Self>,
        params: FlashParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let inputs = FlashInputs::new(query, key, value, bias, forbid, sinks, params);
        precision::weights(&inputs, generic::forward_with_weights)
    }
}

impl<B: Backend> FlashInputs<B> {
    /// The inputs as the extension's methods receive them.
    fn new(
        query: FloatTensor<B>,
        key: FloatTensor<B>,
        value: FloatTensor<B>,
        bias: MaybeFloat<B>,
        forbid: MaybeBool<B>,
        sinks: MaybeFloat<B>,
        params: FlashParams,
    ) -> Self {
        Self {
            query,
            key,
            value,
            bias: bias.into_option(),
            forbid: forbid.into_option(),
            sinks: sinks.into_option(),
            params,
        }
    }
}

/// The forward and backward computations of a backend, generic unless overridden.
pub(crate) trait FlashKernels: Backend {
    fn forward_kernel(inputs: &FlashInputs<Self>) -> FlashForward<Self> {
        inputs
            .params
            .execution
            .note_computed(Pass::Forward, Ran::Generic);
        precision::forward(inputs, generic::forward)
    }

    /// The output and the attention weights.
    fn weights_kernel(inputs: &FlashInputs<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        inputs
            .params
            .execution
            .note_computed(Pass::Weights, Ran::Generic);
        precision::weights(inputs, generic::forward_with_weights)
    }

    fn backward_kernel(
        state: &FlashState<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FlashGrads<Self> {
        state
            .inputs
            .params
            .execution
            .note_computed(Pass::Backward, Ran::Generic);
        precision::backward(state, output_grad, generic::backward)
    }
}

/// A native kernel's result where it took the call (and the execution allows it), else the
/// generic body's; either way the execution's probe hears which computed `pass`.
// Used by every native body; a build without one (no backend feature) has none.
#[allow(dead_code)]
fn native_or_generic<T>(
    execution: &Execution,
    pass: Pass,
    native_body: Ran,
    native: impl FnOnce() -> Option<T>,
    generic: impl FnOnce() -> T,
) -> T {
    let native = match execution.body {
        Body::Native => native(),
        Body::Generic => None,
    };
    match native {
        Some(result) => {
            execution.note_computed(pass, native_body);
            result
        }
        None => {
            execution.note_computed(pass, Ran::Generic);
            generic()
        }
    }
}

/// Routes a backend's extension calls to its [`FlashKernels`].
#[cfg(any(feature = "flex", feature = "ndarray", feature = "cube"))]
macro_rules! kernel_routed_extension {
    ($backend:ty) => {
        impl FlashAttentionBackend for $backend {
            fn flash_attention(
                query: FloatTensor<Self>,
                key: FloatTensor<Self>,
                value: FloatTensor<Self>,
                bias: MaybeFloat<Self>,
                forbid: MaybeBool<Self>,
                sinks: MaybeFloat<Self>,
                params: FlashParams,
            ) -> FloatTensor<Self> {
                let inputs = FlashInputs::new(query, key, value, bias, forbid, sinks, params);
                Self::forward_kernel(&inputs).output
            }

            fn flash_attention_weights(
                query: FloatTensor<Self>,
                key: FloatTensor<Self>,
                value: FloatTensor<Self>,
                bias: MaybeFloat<Self>,
                forbid: MaybeBool<Self>,
                sinks: MaybeFloat<Self>,
                params: FlashParams,
            ) -> (FloatTensor<Self>, FloatTensor<Self>) {
                let inputs = FlashInputs::new(query, key, value, bias, forbid, sinks, params);
                Self::weights_kernel(&inputs)
            }
        }
    };
}
#[cfg(feature = "cube")]
use kernel_routed_extension;

/// Gives a CPU backend the native kernels of `cpu/` on f32 (half precision widened to it), with
/// the generic body for the dtypes they do not take.
#[cfg(any(feature = "flex", feature = "ndarray"))]
macro_rules! native_flash_kernels {
    ($backend:ty) => {
        impl FlashKernels for $backend {
            fn forward_kernel(inputs: &FlashInputs<Self>) -> FlashForward<Self> {
                precision::forward(inputs, |inputs| {
                    native_or_generic(
                        &inputs.params.execution,
                        Pass::Forward,
                        Ran::Cpu,
                        || cpu::forward(inputs),
                        || generic::forward(inputs),
                    )
                })
            }

            fn weights_kernel(
                inputs: &FlashInputs<Self>,
            ) -> (FloatTensor<Self>, FloatTensor<Self>) {
                precision::weights(inputs, |inputs| {
                    native_or_generic(
                        &inputs.params.execution,
                        Pass::Weights,
                        Ran::Cpu,
                        || cpu::forward_with_weights(inputs),
                        || generic::forward_with_weights(inputs),
                    )
                })
            }

            fn backward_kernel(
                state: &FlashState<Self>,
                output_grad: FloatTensor<Self>,
            ) -> FlashGrads<Self> {
                precision::backward(state, output_grad, |state, output_grad| {
                    native_or_generic(
                        &state.inputs.params.execution,
                        Pass::Backward,
                        Ran::Cpu,
                        || cpu::backward(state, &output_grad),
                        || generic::backward(state, output_grad.clone()),
                    )
                })
            }
        }

        kernel_routed_extension!($backend);
    };
}

#[cfg(feature = "flex")]
native_flash_kernels!(burn::backend::Flex);

#[cfg(feature = "ndarray")]
native_flash_kernels!(burn::backend::NdArray);

/// Whether the flash op runs on `device` (autodiff or not): flex and ndarray with this crate's
/// features of those names (a native kernel), and the CubeCL backends (wgpu, Vulkan, Metal,
/// CUDA, ROCm) with this crate's feature of the backend's name (native CubeCL kernels, the
/// generic body for attention sinks and packed segments).
pub fn flash_attention_supported(device: &Device) -> bool {
    flash_kernel(device).is_some()
}

/// Which body of the flash op runs on a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
// A build with only CPU backends (the default) or only GPU ones never makes one of the two.
#[allow(dead_code)]
pub(crate) enum FlashKernel {
    /// A kernel written for the backend's storage (flex, ndarray: `cpu/`).
    Native,
    /// The CubeCL kernels (`cube/`) of the GPU backends.
    Cube,
}

/// The flash op's body on `device` (autodiff or not), if the op runs there at all.
pub(crate) fn flash_kernel(device: &Device) -> Option<FlashKernel> {
    fn cube(device: &DispatchDevice) -> bool {
        match device {
            #[cfg(feature = "cube")]
            DispatchDevice::Cube(_) => true,
            DispatchDevice::Autodiff(inner) => cube(inner),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
    #[cfg(any(feature = "flex", feature = "ndarray"))]
    if crate::cpu::storage::native_storage(device) {
        return Some(FlashKernel::Native);
    }
    cube(device.as_dispatch()).then_some(FlashKernel::Cube)
}

/// What a CubeCL device says of itself that [`AttentionPath::Auto`](crate::AttentionPath::Auto)
/// weighs for training (`dispatch.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CubeTraits {
    /// The device multiplies matrices on tensor cores (CubeCL's `cmma`): Burn's matmuls use
    /// them, the flash kernels (FMA tiles) do not.
    pub tensor_cores: bool,
    /// Its memory in bytes, where it says.
    pub memory: Option<u64>,
}

/// [`CubeTraits`] of `device` (or of the device under its autodiff), `None` where it is not a
/// CubeCL device with the flash kernels.
pub(crate) fn cube_traits(device: &Device) -> Option<CubeTraits> {
    fn of(device: &DispatchDevice) -> Option<CubeTraits> {
        match device {
            #[cfg(feature = "cube")]
            DispatchDevice::Cube(device) => Some(cube::device_traits(device)),
            DispatchDevice::Autodiff(inner) => of(inner),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
    of(device.as_dispatch())
}

/// Memory-bounded attention with a recomputing backward, on split heads, run as `execution`
/// says.
///
/// # Shapes
///
/// As [`FlashAttentionBackend::flash_attention`].
///
/// # Panics
///
/// If the device is not one [`flash_attention_supported`] accepts.
pub(crate) fn flash_attention(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    masks: &ScoreMasks,
    options: &SoftmaxOptions,
    blocks: BlockSizes,
    execution: &Execution,
) -> Tensor<4> {
    let call = DispatchedCall::new([query, key, value], masks, options, blocks, execution);
    let output = <Dispatch as FlashAttentionBackend>::flash_attention(
        call.query,
        call.key,
        call.value,
        call.bias,
        call.forbid,
        call.sinks,
        call.params,
    );
    Tensor::from_dispatch(output)
}

/// The flash op's output and attention weights `[batch, n_heads, seq_q, seq_k]`, for inference
/// (neither carries a gradient): on the native kernel the weights are written as each block's
/// probabilities are found.
///
/// # Shapes
///
/// As [`FlashAttentionBackend::flash_attention`].
///
/// # Panics
///
/// If the device is not one [`flash_attention_supported`] accepts, or an input is tracked by
/// autodiff.
pub(crate) fn flash_attention_with_weights(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    masks: &ScoreMasks,
    options: &SoftmaxOptions,
    blocks: BlockSizes,
    execution: &Execution,
) -> (Tensor<4>, Tensor<4>) {
    let call = DispatchedCall::new([query, key, value], masks, options, blocks, execution);
    let (output, weights) = <Dispatch as FlashAttentionBackend>::flash_attention_weights(
        call.query,
        call.key,
        call.value,
        call.bias,
        call.forbid,
        call.sinks,
        call.params,
    );
    (
        Tensor::from_dispatch(output),
        Tensor::from_dispatch(weights),
    )
}

/// One call's arguments, checked and converted for the dispatch.
struct DispatchedCall {
    query: FloatTensor<Dispatch>,
    key: FloatTensor<Dispatch>,
    value: FloatTensor<Dispatch>,
    bias: MaybeFloat<Dispatch>,
    forbid: MaybeBool<Dispatch>,
    sinks: MaybeFloat<Dispatch>,
    params: FlashParams,
}

impl DispatchedCall {
    /// # Panics
    ///
    /// If the device is not one [`flash_attention_supported`] accepts.
    fn new(
        [query, key, value]: [Tensor<4>; 3],
        masks: &ScoreMasks,
        options: &SoftmaxOptions,
        blocks: BlockSizes,
        execution: &Execution,
    ) -> Self {
        assert!(
            flash_attention_supported(&query.device()),
            "MultiHeadAttention: the flash kernel does not run on {:?}; enable this crate's \
             feature for that backend or use another `AttentionPath`",
            query.device()
        );
        Self {
            query: query.into_dispatch(),
            key: key.into_dispatch(),
            value: value.into_dispatch(),
            bias: MaybeFloat::from_option(masks.bias.clone().map(Tensor::into_dispatch)),
            forbid: MaybeBool::from_option(
                masks.forbid.clone().map(Tensor::<4, Bool>::into_dispatch),
            ),
            sinks: MaybeFloat::from_option(options.sinks.clone().map(Tensor::into_dispatch)),
            params: FlashParams {
                scale: options.scale,
                softcap: options.softcap,
                rules: masks.rules.clone(),
                blocks,
                execution: execution.clone(),
            },
        }
    }
}
