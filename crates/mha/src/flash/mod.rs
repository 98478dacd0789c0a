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
//! that fall back to the generic body for what they do not take: `cpu.rs` (flex and ndarray
//! f32 storage) and `cube/` (CubeCL kernels for the GPU backends, f32, f16 and bf16).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{
    Autodiff, AutodiffBackend, Backend, Dispatch, DispatchDevice, ExtensionType, TensorMetadata,
    backend_extension,
};
use burn::tensor::{Bool, DType, Device, FloatDType, Tensor};

use crate::geometry::Geometry;
use crate::input::BlockSizes;
use crate::kernel::SoftmaxOptions;
use crate::mask::ScoreMasks;
use crate::rules::ScoreRules;

#[cfg(any(feature = "flex", feature = "ndarray"))]
mod cpu;
#[cfg(feature = "cube")]
mod cube;
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) use cpu::{
    packed_product as cpu_packed_product, product as cpu_product, row_sum as cpu_row_sum,
};
mod generic;
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) mod recycle;
#[cfg(any(feature = "flex", feature = "ndarray"))]
mod simd;

/// What one flash-attention call computes besides `q`, `k`, `v` and the masks.
#[derive(Debug, Clone, PartialEq)]
pub struct FlashParams {
    /// Multiplies `q kᵀ`.
    pub scale: f64,
    /// Scores become `softcap · tanh(score / softcap)` after scaling, before biases and masks.
    pub softcap: Option<f64>,
    /// Causal masking, a window, segments, ALiBi: applied by the kernel to each block.
    pub(crate) rules: ScoreRules,
    /// Query and key block sizes.
    pub blocks: BlockSizes,
}

/// An optional float tensor across the dispatch boundary (the extension macro maps enums of
/// tensors, not `Option`s).
#[derive(ExtensionType)]
pub enum MaybeFloat<B: Backend> {
    /// A tensor.
    Some(FloatTensor<B>),
    /// No tensor.
    None,
}

/// An optional bool tensor across the dispatch boundary.
#[derive(ExtensionType)]
pub enum MaybeBool<B: Backend> {
    /// A tensor.
    Some(BoolTensor<B>),
    /// No tensor.
    None,
}

impl<B: Backend> MaybeFloat<B> {
    pub(crate) fn from_option(tensor: Option<FloatTensor<B>>) -> Self {
        tensor.map_or(Self::None, Self::Some)
    }

    pub(crate) fn into_option(self) -> Option<FloatTensor<B>> {
        match self {
            Self::Some(tensor) => Some(tensor),
            Self::None => None,
        }
    }
}

impl<B: Backend> MaybeBool<B> {
    fn from_option(tensor: Option<BoolTensor<B>>) -> Self {
        tensor.map_or(Self::None, Self::Some)
    }

    fn into_option(self) -> Option<BoolTensor<B>> {
        match self {
            Self::Some(tensor) => Some(tensor),
            Self::None => None,
        }
    }
}

/// Backends with a memory-bounded attention op whose backward recomputes the scores.
///
/// The default body is generic over the backend's primitives; autodiff gets the handwritten
/// backward below.
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
    fn flash_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        #[extension_type] bias: MaybeFloat<Self>,
        #[extension_type] forbid: MaybeBool<Self>,
        #[extension_type] sinks: MaybeFloat<Self>,
        params: FlashParams,
    ) -> FloatTensor<Self> {
        let inputs = FlashInputs::<Self> {
            query,
            key,
            value,
            bias: bias.into_option(),
            forbid: forbid.into_option(),
            sinks: sinks.into_option(),
            params,
        };
        generic::forward(&inputs).output
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
    fn flash_attention_weights(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        #[extension_type] bias: MaybeFloat<Self>,
        #[extension_type] forbid: MaybeBool<Self>,
        #[extension_type] sinks: MaybeFloat<Self>,
        params: FlashParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let inputs = FlashInputs::<Self> {
            query,
            key,
            value,
            bias: bias.into_option(),
            forbid: forbid.into_option(),
            sinks: sinks.into_option(),
            params,
        };
        generic::forward_with_weights(&inputs)
    }
}

/// The forward and backward computations of a backend, generic unless overridden.
pub(crate) trait FlashKernels: Backend {
    fn forward_kernel(inputs: &FlashInputs<Self>) -> FlashForward<Self> {
        generic::forward(inputs)
    }

    /// The output and the attention weights.
    fn weights_kernel(inputs: &FlashInputs<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        generic::forward_with_weights(inputs)
    }

    fn backward_kernel(
        state: &FlashState<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FlashGrads<Self> {
        generic::backward(state, output_grad)
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
                let inputs = FlashInputs {
                    query,
                    key,
                    value,
                    bias: bias.into_option(),
                    forbid: forbid.into_option(),
                    sinks: sinks.into_option(),
                    params,
                };
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
                let inputs = FlashInputs {
                    query,
                    key,
                    value,
                    bias: bias.into_option(),
                    forbid: forbid.into_option(),
                    sinks: sinks.into_option(),
                    params,
                };
                Self::weights_kernel(&inputs)
            }
        }
    };
}
#[cfg(feature = "cube")]
use kernel_routed_extension;

/// Gives a CPU backend the native kernels of `cpu.rs`, with the generic body for the dtypes
/// they do not take.
#[cfg(any(feature = "flex", feature = "ndarray"))]
macro_rules! native_flash_kernels {
    ($backend:ty) => {
        impl FlashKernels for $backend {
            fn forward_kernel(inputs: &FlashInputs<Self>) -> FlashForward<Self> {
                if generic_body_forced() {
                    return generic::forward(inputs);
                }
                cpu::forward(inputs).unwrap_or_else(|| generic::forward(inputs))
            }

            fn weights_kernel(
                inputs: &FlashInputs<Self>,
            ) -> (FloatTensor<Self>, FloatTensor<Self>) {
                if generic_body_forced() {
                    return generic::forward_with_weights(inputs);
                }
                match cpu::forward_with_weights(inputs) {
                    Some((forward, weights)) => (forward.output, weights),
                    None => generic::forward_with_weights(inputs),
                }
            }

            fn backward_kernel(
                state: &FlashState<Self>,
                output_grad: FloatTensor<Self>,
            ) -> FlashGrads<Self> {
                if generic_body_forced() {
                    return generic::backward(state, output_grad);
                }
                cpu::backward(state, &output_grad)
                    .unwrap_or_else(|| generic::backward(state, output_grad))
            }
        }

        kernel_routed_extension!($backend);
    };
}

#[cfg(test)]
std::thread_local! {
    static GENERIC_BODY_FORCED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread's tests asked for the generic body where a native kernel exists (the
/// native kernel takes every f32 call, so the generic body would otherwise never run on f32).
#[cfg(any(feature = "flex", feature = "ndarray", feature = "cube"))]
fn generic_body_forced() -> bool {
    #[cfg(test)]
    return GENERIC_BODY_FORCED.get();
    #[cfg(not(test))]
    false
}

/// Runs `run` with the generic body in place of the native kernels, forward and backward.
#[cfg(test)]
fn with_generic_body<R>(run: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            GENERIC_BODY_FORCED.set(self.0);
        }
    }
    let _restore = Restore(GENERIC_BODY_FORCED.replace(true));
    run()
}

#[cfg(feature = "flex")]
native_flash_kernels!(burn::backend::Flex);

#[cfg(feature = "ndarray")]
native_flash_kernels!(burn::backend::NdArray);

impl<B: FlashKernels, C: CheckpointStrategy> FlashAttentionBackend for Autodiff<B, C> {
    fn flash_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        bias: MaybeFloat<Self>,
        forbid: MaybeBool<Self>,
        sinks: MaybeFloat<Self>,
        params: FlashParams,
    ) -> FloatTensor<Self> {
        let sinks = sinks.into_option();
        let nodes = [query.node(), key.node(), value.node()];
        let sinks_node = sinks.as_ref().map(|sinks| sinks.node());
        let inputs = FlashInputs::<B> {
            query: query.into_primitive(),
            key: key.into_primitive(),
            value: value.into_primitive(),
            bias: bias.into_option().map(|bias| bias.into_primitive()),
            forbid: forbid.into_option(),
            sinks: sinks.map(|sinks| sinks.into_primitive()),
            params,
        };
        match sinks_node {
            None => record::<B, C, 3>(nodes, inputs),
            Some(sinks) => {
                let [query, key, value] = nodes;
                record::<B, C, 4>([query, key, value, sinks], inputs)
            }
        }
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
        let sinks = sinks.into_option();
        let tracked = [Some(&query), Some(&key), Some(&value), sinks.as_ref()]
            .into_iter()
            .flatten()
            .any(|tensor| tensor.is_tracked());
        // The dispatch sends weights requests on autodiff devices to the explicit path; this
        // guards any other caller against gradients that would silently go missing.
        assert!(
            !tracked,
            "flash attention: the weights are computed for inference and cannot carry a \
             gradient; use the explicit path when an input requires one"
        );
        let inputs = FlashInputs::<B> {
            query: query.into_primitive(),
            key: key.into_primitive(),
            value: value.into_primitive(),
            bias: bias.into_option().map(|bias| bias.into_primitive()),
            forbid: forbid.into_option(),
            sinks: sinks.map(|sinks| sinks.into_primitive()),
            params,
        };
        let (output, weights) = B::weights_kernel(&inputs);
        (Self::from_inner(output), Self::from_inner(weights))
    }
}

/// Runs the forward and, when a parent is tracked, records the node that will run the
/// backward: parents q, k, v, and the sinks when the call has them.
fn record<B: FlashKernels, C: CheckpointStrategy, const N: usize>(
    nodes: [burn::backend::autodiff::ops::NodeGuard; N],
    inputs: FlashInputs<B>,
) -> FloatTensor<Autodiff<B, C>>
where
    FlashAttentionBackward<N>: Backward<B, N, State = FlashState<B>>,
{
    match FlashAttentionBackward::<N>
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let FlashForward {
                output,
                softmax_stats,
            } = B::forward_kernel(&inputs);
            let state = FlashState {
                inputs,
                output: output.clone(),
                softmax_stats,
            };
            prep.finish(state, output)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::forward_kernel(&inputs).output),
    }
}

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
    /// A kernel written for the backend's storage (flex, ndarray: `cpu.rs`).
    Native,
    /// The CubeCL kernels (`cube/`) of the GPU backends.
    Cube,
}

/// The flash op's body on `device` (autodiff or not), if the op runs there at all.
pub(crate) fn flash_kernel(device: &Device) -> Option<FlashKernel> {
    fn kernel(device: &DispatchDevice) -> Option<FlashKernel> {
        match device {
            #[cfg(feature = "flex")]
            DispatchDevice::Flex(_) => Some(FlashKernel::Native),
            #[cfg(feature = "ndarray")]
            DispatchDevice::NdArray(_) => Some(FlashKernel::Native),
            #[cfg(any(
                feature = "wgpu",
                feature = "vulkan",
                feature = "metal",
                feature = "cuda",
                feature = "rocm"
            ))]
            DispatchDevice::Cube(_) => Some(FlashKernel::Cube),
            DispatchDevice::Autodiff(inner) => kernel(inner),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
    kernel(device.as_dispatch())
}

/// Memory-bounded attention with a recomputing backward, on split heads.
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
) -> Tensor<4> {
    let call = DispatchedCall::new(query, key, value, masks, options, blocks);
    let output = <Dispatch as FlashAttentionBackend>::flash_attention(
        call.query,
        call.key,
        call.value,
        call.bias,
        call.forbid,
        call.sinks,
        call.params,
    );
    call.dtype.restore(Tensor::from_dispatch(output))
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
) -> (Tensor<4>, Tensor<4>) {
    let call = DispatchedCall::new(query, key, value, masks, options, blocks);
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
        call.dtype.restore(Tensor::from_dispatch(output)),
        call.dtype.restore(Tensor::from_dispatch(weights)),
    )
}

/// The float type a call's results are returned in.
#[derive(Clone, Copy)]
struct ResultType(DType);

impl ResultType {
    fn restore(self, tensor: Tensor<4>) -> Tensor<4> {
        match tensor.dtype() == self.0 {
            true => tensor,
            false => tensor.cast(FloatDType::from(self.0)),
        }
    }
}

/// Whether the flash op on `device` takes f16 and bf16 inputs as they are (the CubeCL
/// backends' kernels).
fn reads_halves(device: &Device) -> bool {
    fn cube(device: &DispatchDevice) -> bool {
        match device {
            #[cfg(feature = "cube")]
            DispatchDevice::Cube(_) => true,
            DispatchDevice::Autodiff(inner) => cube(inner),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
    cube(device.as_dispatch())
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
    dtype: ResultType,
}

impl DispatchedCall {
    fn new(
        query: Tensor<4>,
        key: Tensor<4>,
        value: Tensor<4>,
        masks: &ScoreMasks,
        options: &SoftmaxOptions,
        blocks: BlockSizes,
    ) -> Self {
        assert!(
            flash_attention_supported(&query.device()),
            "MultiHeadAttention: the flash kernel does not run on {:?}; enable this crate's \
             feature for that backend or use another `AttentionPath`",
            query.device()
        );
        // Half-precision inputs are computed in f32 (the softmax statistics and the sums over
        // key and query blocks lose too much in 8 or 11 bits of mantissa) and the results are
        // returned in their type, as mixed-precision training expects. The GPU kernels read
        // halves themselves and accumulate in f32 (their fallback widens, `cube::widened`);
        // elsewhere they are widened here.
        let dtype = query.dtype();
        let computed_in = match dtype {
            DType::F16 | DType::BF16 if !reads_halves(&query.device()) => DType::F32,
            other => other,
        };
        let widen = |tensor: Tensor<4>| match tensor.dtype() == computed_in {
            true => tensor,
            false => tensor.cast(FloatDType::from(computed_in)),
        };
        let sinks = options
            .sinks
            .clone()
            .map(|sinks| sinks.cast(FloatDType::from(computed_in)).into_dispatch());
        Self {
            query: widen(query).into_dispatch(),
            key: widen(key).into_dispatch(),
            value: widen(value).into_dispatch(),
            bias: MaybeFloat::from_option(
                masks.bias.clone().map(|bias| widen(bias).into_dispatch()),
            ),
            forbid: MaybeBool::from_option(
                masks.forbid.clone().map(Tensor::<4, Bool>::into_dispatch),
            ),
            sinks: MaybeFloat::from_option(sinks),
            params: FlashParams {
                scale: options.scale,
                softcap: options.softcap,
                rules: masks.rules.clone(),
                blocks,
            },
            dtype: ResultType(dtype),
        }
    }
}

/// The op's inputs on the backend that computes it.
#[derive(Debug, Clone)]
pub(crate) struct FlashInputs<B: Backend> {
    pub query: FloatTensor<B>,
    pub key: FloatTensor<B>,
    pub value: FloatTensor<B>,
    pub bias: Option<FloatTensor<B>>,
    pub forbid: Option<BoolTensor<B>>,
    /// `[n_heads]`
    pub sinks: Option<FloatTensor<B>>,
    pub params: FlashParams,
}

impl<B: Backend> FlashInputs<B> {
    /// The call's sizes, after checking that query, key and value fit together and that the
    /// masks broadcast to `[batch, n_heads, seq_q, seq_k]`.
    ///
    /// # Panics
    ///
    /// If they do not.
    pub fn geometry(&self) -> Geometry {
        let geometry = Geometry::of_heads(
            dims(&self.query.shape()),
            dims(&self.key.shape()),
            dims(&self.value.shape()),
        );
        let Geometry {
            batch,
            n_heads,
            seq_q,
            seq_k,
            ..
        } = geometry;
        let full = [batch, n_heads, seq_q, seq_k];
        let masks = [
            ("bias", self.bias.as_ref().map(|bias| bias.shape())),
            ("forbid", self.forbid.as_ref().map(|forbid| forbid.shape())),
        ];
        for (name, shape) in masks {
            if let Some(shape) = shape {
                let shape = dims(&shape);
                assert!(
                    (0..4).all(|axis| shape[axis] == full[axis] || shape[axis] == 1),
                    "flash attention: `{name}` {shape:?} does not broadcast to the scores {full:?}"
                );
            }
        }
        assert!(
            self.params.blocks.query > 0 && self.params.blocks.key > 0,
            "flash attention: block sizes must be positive, got {:?}",
            self.params.blocks
        );
        if let Some(sinks) = &self.sinks {
            let shape = sinks.shape();
            assert!(
                shape.num_dims() == 1 && shape[0] == n_heads,
                "flash attention: one sink logit per query head, got sinks {shape:?}"
            );
        }
        let rules = &self.params.rules;
        assert!(
            rules.positional_keys <= seq_k
                && rules
                    .alibi
                    .as_ref()
                    .is_none_or(|slopes| slopes.len() == n_heads)
                && rules.segments.as_ref().is_none_or(|segments| {
                    segments.seq_q == seq_q
                        && segments.seq_k == rules.positional_keys
                        && segments.query.len() == batch * seq_q
                        && segments.key.len() == batch * rules.positional_keys
                }),
            "flash attention: the rules do not fit the call"
        );
        geometry
    }
}

/// The four sizes of a rank-4 shape.
///
/// # Panics
///
/// If the shape does not have rank 4.
fn dims(shape: &burn::backend::Shape) -> [usize; 4] {
    assert_eq!(
        shape.num_dims(),
        4,
        "flash attention: tensors must have rank 4, got shape {shape:?}"
    );
    [shape[0], shape[1], shape[2], shape[3]]
}

pub(crate) struct FlashForward<B: Backend> {
    /// `[batch, n_heads, seq_q, value_dim]`
    pub output: FloatTensor<B>,
    /// `[batch, n_heads, seq_q, 2]`: each query's score maximum `m` and `1 / Σ_k exp(s_k - m)`,
    /// from which the backward recomputes `P = exp(S - m) / Σ`. A query with no allowed key
    /// has the lowest finite `m` and 0, which make every recomputed probability 0.
    ///
    /// (Not FlashAttention's single log-sum-exp `m + ln Σ`: rounded to f32 it carries an
    /// absolute error of an ulp of `m`, which `exp(S - lse)` turns into a relative error of
    /// `|m| · 6e-8` in every probability, 6e-5 at scores of 1000; the pair keeps the
    /// recomputed probabilities as exact as the explicit path's.)
    pub softmax_stats: FloatTensor<B>,
}

/// What the backward pass keeps: the inputs, the output and the softmax statistics, `O(seq)`
/// each.
#[derive(Debug, Clone)]
pub(crate) struct FlashState<B: Backend> {
    pub inputs: FlashInputs<B>,
    pub output: FloatTensor<B>,
    pub softmax_stats: FloatTensor<B>,
}

impl<B: Backend> FlashState<B> {
    /// # Panics
    ///
    /// If `output_grad` does not have the output's shape, or the saved statistics are not two
    /// values per query.
    pub fn check_output_grad(&self, output_grad: &FloatTensor<B>) {
        let output = dims(&self.output.shape());
        let [batch, heads, seq_q, _] = output;
        assert_eq!(
            dims(&output_grad.shape()),
            output,
            "flash attention: the output gradient must have the output's shape"
        );
        assert_eq!(
            dims(&self.softmax_stats.shape()),
            [batch, heads, seq_q, 2],
            "flash attention: two softmax statistics per query"
        );
    }
}

/// The flash op's autodiff node over `N` parents: q, k, v, and the sinks when a call has them.
#[derive(Debug)]
pub(crate) struct FlashAttentionBackward<const N: usize>;

impl<B: FlashKernels, const N: usize> Backward<B, N> for FlashAttentionBackward<N> {
    type State = FlashState<B>;

    /// Registers one gradient for each tracked parent, exactly once (what data-parallel
    /// training's per-parameter gradient sync counts on).
    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let output_grad = grads.consume::<B>(&ops.node);
        let FlashGrads {
            query,
            key,
            value,
            sinks,
        } = B::backward_kernel(&ops.state, output_grad);
        let computed = [Some(query), Some(key), Some(value), sinks];
        #[cfg(test)]
        let mut registered = Vec::new();
        for (node, grad) in ops.parents.into_iter().zip(computed) {
            if let (Some(node), Some(grad)) = (node, grad) {
                #[cfg(test)]
                registered.push(node.id.value);
                grads.register::<B>(node.id, grad);
            }
        }
        #[cfg(test)]
        registrations::record(
            ops.node
                .parents
                .iter()
                .map(|parent| parent.id.value)
                .collect(),
            registered,
        );
    }
}

/// What each flash node's backward registered, against the parent slots the autodiff tape
/// counts for it (tests only: data-parallel training's gradient sync waits for exactly that
/// many registrations of each parameter, and no test backend runs its all-reduce).
#[cfg(test)]
pub(crate) mod registrations {
    use std::cell::RefCell;

    thread_local! {
        /// `(declared parent ids, registered ids)` per backward of a flash node run on this
        /// thread (Burn runs a backward pass on the thread that asks for it; per thread, so
        /// that tests running side by side do not mix their logs).
        static LOG: RefCell<Vec<(Vec<u64>, Vec<u64>)>> = const { RefCell::new(Vec::new()) };
    }

    pub fn record(declared: Vec<u64>, registered: Vec<u64>) {
        LOG.with_borrow_mut(|log| log.push((declared, registered)));
    }

    /// Empties this thread's log and returns what it held.
    pub fn take() -> Vec<(Vec<u64>, Vec<u64>)> {
        LOG.with_borrow_mut(std::mem::take)
    }
}

pub(crate) struct FlashGrads<B: Backend> {
    pub query: FloatTensor<B>,
    pub key: FloatTensor<B>,
    pub value: FloatTensor<B>,
    /// `[n_heads]`, when the call had sinks.
    pub sinks: Option<FloatTensor<B>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::{chunked_attention, explicit_attention};
    use crate::rules::Segments;
    use burn::nn::DropoutConfig;
    use burn::tensor::{Distribution, TensorData, Tolerance};
    use std::sync::Arc;

    #[allow(deprecated)]
    fn cpu_devices() -> [Device; 2] {
        [Device::flex(), Device::ndarray()]
    }

    fn normal<const D: usize>(shape: [usize; D], device: &Device) -> Tensor<D> {
        Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
    }

    /// One configuration of masks, rules, soft cap and sinks.
    struct Case {
        label: &'static str,
        masks: ScoreMasks,
        softcap: Option<f64>,
        sinks: bool,
    }

    /// The cases the kernels are compared on: what they are called and what they hold.
    // A table, one case per entry: it grows by an entry per feature.
    fn cases(device: &Device, [batch, n_heads, seq_q, seq_k]: [usize; 4]) -> Vec<Case> {
        // Key padding as the module passes it, `[batch, 1, 1, seq_k]`: broadcast query and head
        // axes; the second sequence's last keys padded, one query row fully masked by a bool
        // mask on top.
        let mut padding = vec![false; batch * seq_k];
        padding[seq_k + seq_k - 2..].fill(true);
        let padding =
            Tensor::<4, Bool>::from_data(TensorData::new(padding, [batch, 1, 1, seq_k]), device);
        let mut row = vec![false; seq_q * seq_k];
        row[seq_k..2 * seq_k].fill(true);
        let dead_row =
            Tensor::<4, Bool>::from_data(TensorData::new(row, [1, 1, seq_q, seq_k]), device);
        let none = || ScoreMasks::none(seq_k);
        let causal = ScoreRules {
            query_start: seq_k as i64 - seq_q as i64,
            causal: true,
            ..ScoreRules::none(seq_k)
        };
        // Two documents per row, split at a different place in each batch element.
        let split = |len: usize, b: usize| (0..len).map(move |i| i64::from(i >= len / 2 + b));
        let segments = Arc::new(Segments::new(
            (0..batch).flat_map(|b| split(seq_q, b)).collect(),
            (0..batch).flat_map(|b| split(seq_k, b)).collect(),
            seq_q,
            seq_k,
        ));
        let case = |label, masks, softcap, sinks| Case {
            label,
            masks,
            softcap,
            sinks,
        };
        vec![
            case("none", none(), None, false),
            case(
                "causal",
                ScoreMasks {
                    rules: causal.clone(),
                    ..none()
                },
                None,
                false,
            ),
            case(
                "padding + dead row + causal",
                ScoreMasks {
                    forbid: Some(
                        padding
                            .expand([batch, 1, seq_q, seq_k])
                            .bool_or(dead_row.clone().expand([batch, 1, seq_q, seq_k])),
                    ),
                    rules: causal.clone(),
                    ..none()
                },
                None,
                false,
            ),
            case(
                "broadcast padding",
                ScoreMasks {
                    forbid: Some(Tensor::from_data(
                        TensorData::new(vec![false; batch * seq_k], [batch, 1, 1, seq_k]),
                        device,
                    )),
                    ..none()
                },
                None,
                false,
            ),
            case(
                "float bias",
                ScoreMasks {
                    bias: Some(normal([batch, n_heads, seq_q, seq_k], device)),
                    ..none()
                },
                None,
                false,
            ),
            case(
                "window 3, causal, ALiBi",
                ScoreMasks {
                    rules: ScoreRules {
                        window: Some(3),
                        alibi: Some((0..n_heads).map(|h| 0.5 / (h + 1) as f32).collect()),
                        ..causal.clone()
                    },
                    ..none()
                },
                None,
                false,
            ),
            case(
                "segments, causal",
                ScoreMasks {
                    rules: ScoreRules {
                        segments: Some(segments.clone()),
                        ..causal.clone()
                    },
                    ..none()
                },
                None,
                false,
            ),
            case(
                "two-sided window 2, segments",
                ScoreMasks {
                    rules: ScoreRules {
                        window: Some(2),
                        segments: Some(segments),
                        ..ScoreRules::none(seq_k)
                    },
                    ..none()
                },
                None,
                false,
            ),
            case("soft cap 1.5", none(), Some(1.5), false),
            case(
                "sinks + dead row + causal",
                ScoreMasks {
                    forbid: Some(dead_row.expand([batch, 1, seq_q, seq_k])),
                    rules: causal,
                    ..none()
                },
                None,
                true,
            ),
        ]
    }

    /// The output and the gradients of q, k, v (and the sinks) of `loss = Σ o · sin(o)`.
    fn outputs_and_grads(
        [query, key, value]: [&Tensor<4>; 3],
        sinks: Option<&Tensor<1>>,
        attend: impl Fn(Tensor<4>, Tensor<4>, Tensor<4>, Option<Tensor<1>>) -> Tensor<4>,
    ) -> Vec<Tensor<4>> {
        let [query, key, value] = [query, key, value].map(|t| t.clone().detach().require_grad());
        let sinks = sinks.map(|s| s.clone().detach().require_grad());
        let output = attend(query.clone(), key.clone(), value.clone(), sinks.clone());
        let grads = (output.clone() * output.clone().sin()).sum().backward();
        let mut all = vec![
            output.inner(),
            query.grad(&grads).unwrap(),
            key.grad(&grads).unwrap(),
            value.grad(&grads).unwrap(),
        ];
        if let Some(sinks) = sinks {
            all.push(sinks.grad(&grads).unwrap().reshape([1, 1, 1, -1]));
        }
        all
    }

    /// Asserts that each of [`outputs_and_grads`]'s tensors in `actual` is within `tolerance`
    /// of `expected`'s, naming `label` and the tensor where one is not.
    fn assert_outputs_and_grads_close(
        actual: Vec<Tensor<4>>,
        expected: &[Tensor<4>],
        tolerance: f32,
        label: &str,
    ) {
        assert_eq!(actual.len(), expected.len(), "{label}: tensors");
        for (index, (actual, expected)) in actual.into_iter().zip(expected).enumerate() {
            let what = ["output", "d query", "d key", "d value", "d sinks"][index];
            let difference = (actual - expected.clone()).abs().max().into_scalar::<f32>();
            assert!(
                difference <= tolerance,
                "{label}: {what} differs by {difference}"
            );
        }
    }

    /// Random q `[2, 4, seq_q, 6]`, k `[2, 2, seq_k, 6]`, v `[2, 2, seq_k, 3]` (two query heads
    /// per key/value head) and sinks `[4]`.
    fn grouped_heads(device: &Device, seq_q: usize, seq_k: usize) -> ([Tensor<4>; 3], Tensor<1>) {
        grouped_heads_with_values(device, seq_q, seq_k, 3)
    }

    /// [`grouped_heads`] with value heads `value_dim` wide.
    fn grouped_heads_with_values(
        device: &Device,
        seq_q: usize,
        seq_k: usize,
        value_dim: usize,
    ) -> ([Tensor<4>; 3], Tensor<1>) {
        let heads = [
            normal([2, 4, seq_q, 6], device),
            normal([2, 2, seq_k, 6], device),
            normal([2, 2, seq_k, value_dim], device),
        ];
        (heads, normal([4], device))
    }

    fn options(case: &Case, sinks: Option<Tensor<1>>) -> SoftmaxOptions {
        SoftmaxOptions {
            scale: 0.35,
            custom_scale: true,
            softcap: case.softcap,
            sinks,
        }
    }

    /// The generic body (forced where a native kernel exists) and the native kernel against
    /// the explicit path, in the output and the gradients of q, k, v and the sinks: GQA, causal
    /// with more queries than keys and fewer, broadcast key padding whose last query block
    /// holds one query, a fully masked row, a float bias, windows one- and two-sided, ALiBi,
    /// packed segments, a soft cap, sinks.
    #[test]
    fn both_bodies_equal_the_explicit_path_in_outputs_and_gradients() {
        let dropout = DropoutConfig::new(0.0).init();
        for device in cpu_devices() {
            let device = device.autodiff();
            device.seed(31);
            // seq_q 5 with query blocks of 4: the last block is query 4 alone.
            for (seq_q, seq_k) in [(5, 7), (7, 3), (5, 5)] {
                let (batch, n_heads) = (2, 4);
                let ([query, key, value], sinks) = grouped_heads(&device, seq_q, seq_k);
                let heads = [&query, &key, &value];
                for case in cases(&device, [batch, n_heads, seq_q, seq_k]) {
                    let expected =
                        outputs_and_grads(heads, case.sinks.then_some(&sinks), |q, k, v, s| {
                            explicit_attention(q, k, v, &case.masks, &options(&case, s), &dropout).0
                        });
                    for blocks in [
                        BlockSizes { query: 4, key: 2 },
                        BlockSizes { query: 1, key: 7 },
                    ] {
                        let flash = || {
                            outputs_and_grads(heads, case.sinks.then_some(&sinks), |q, k, v, s| {
                                flash_attention(q, k, v, &case.masks, &options(&case, s), blocks)
                            })
                        };
                        // Fresh output buffers NaN: an element the native kernel does not
                        // write (recycled buffers hold an earlier call's values) shows.
                        let bodies = [
                            ("native", recycle::poison::with(flash)),
                            ("generic", with_generic_body(flash)),
                        ];
                        for (body, actual) in bodies {
                            assert_outputs_and_grads_close(
                                actual,
                                &expected,
                                1e-5,
                                &format!("{} {seq_q}x{seq_k} {blocks:?} {body}", case.label),
                            );
                        }
                    }
                }
            }
        }
    }

    /// The wgpu device for the GPU kernels' tests, or `None` (with a note) where the run leaves
    /// wgpu out (`MHA_TEST_DEVICES` without it) or no adapter works; `MHA_REQUIRE_WGPU=1`
    /// makes a missing adapter a failure, as in the integration tests.
    #[cfg(feature = "wgpu")]
    fn wgpu_test_device() -> Option<Device> {
        let listed = std::env::var("MHA_TEST_DEVICES").map_or(true, |list| {
            list.split(',').any(|name| name.trim() == "wgpu")
        });
        if !listed {
            return None;
        }
        let device = Device::wgpu(burn::tensor::DeviceKind::DefaultDevice);
        let probe = device.clone();
        let works = std::panic::catch_unwind(move || {
            Tensor::<1>::ones([2], &probe).sum().into_scalar::<f32>() == 2.0
        })
        .unwrap_or(false);
        let required = std::env::var("MHA_REQUIRE_WGPU").is_ok_and(|value| value == "1");
        assert!(
            works || !required,
            "MHA_REQUIRE_WGPU=1 but no wgpu adapter works"
        );
        if !works {
            eprintln!("*** SKIPPING the GPU kernels' test: no wgpu adapter ***");
        }
        works.then_some(device)
    }

    /// The native CubeCL kernels on wgpu (lavapipe where there is no GPU) against the explicit
    /// path on the same device, in the output and the gradients of q, k, v: every case of
    /// [`cases`] (sinks and segments go to the generic body, the rest to the kernels; the
    /// count of native calls says so), GQA, causal with more queries than keys and fewer, odd
    /// head widths, and sequences spanning several query and key tiles.
    #[cfg(feature = "wgpu")]
    #[test]
    fn the_gpu_kernels_equal_the_explicit_path_in_outputs_and_gradients() {
        let Some(device) = wgpu_test_device() else {
            return;
        };
        let dropout = DropoutConfig::new(0.0).init();
        let device = device.autodiff();
        device.seed(37);
        for (seq_q, seq_k) in [(5, 7), (7, 3), (45, 70)] {
            let (batch, n_heads) = (2, 4);
            let ([query, key, value], sinks) = grouped_heads(&device, seq_q, seq_k);
            let heads = [&query, &key, &value];
            for case in cases(&device, [batch, n_heads, seq_q, seq_k]) {
                let native = case.masks.rules.segments.is_none() && !case.sinks;
                let expected =
                    outputs_and_grads(heads, case.sinks.then_some(&sinks), |q, k, v, s| {
                        explicit_attention(q, k, v, &case.masks, &options(&case, s), &dropout).0
                    });
                cube::native_calls::take();
                let actual =
                    outputs_and_grads(heads, case.sinks.then_some(&sinks), |q, k, v, s| {
                        flash_attention(
                            q,
                            k,
                            v,
                            &case.masks,
                            &options(&case, s),
                            BlockSizes::default(),
                        )
                    });
                let calls = cube::native_calls::take();
                assert_eq!(
                    calls,
                    if native { 2 } else { 0 },
                    "{} {seq_q}x{seq_k}: native forward and backward calls",
                    case.label
                );
                assert_outputs_and_grads_close(
                    actual,
                    &expected,
                    1e-4,
                    &format!("{} {seq_q}x{seq_k}", case.label),
                );
            }
        }
        // Head width 64 over 600 queries and keys: a unit's loops run more than 65535
        // iterations unless the ones over the head width are unrolled, and lavapipe's
        // (llvmpipe's) loop limiter cuts a shader short past that, silently.
        let heads = [[1, 2, 600, 64], [1, 1, 600, 64], [1, 1, 600, 64]].map(|s| normal(s, &device));
        let masks = ScoreMasks {
            rules: ScoreRules {
                causal: true,
                ..ScoreRules::none(600)
            },
            ..ScoreMasks::none(600)
        };
        let case = Case {
            label: "causal 600x600, head width 64",
            masks,
            softcap: None,
            sinks: false,
        };
        let [q, k, v] = [&heads[0], &heads[1], &heads[2]];
        let expected = outputs_and_grads([q, k, v], None, |q, k, v, _| {
            explicit_attention(q, k, v, &case.masks, &options(&case, None), &dropout).0
        });
        let actual = outputs_and_grads([q, k, v], None, |q, k, v, _| {
            flash_attention(
                q,
                k,
                v,
                &case.masks,
                &options(&case, None),
                BlockSizes::default(),
            )
        });
        for (index, (actual, expected)) in actual.into_iter().zip(&expected).enumerate() {
            let what = ["output", "d query", "d key", "d value"][index];
            let difference = (actual - expected.clone()).abs().max().into_scalar::<f32>();
            assert!(
                difference <= 1e-4,
                "{}: {what} differs by {difference}",
                case.label
            );
        }
    }

    /// Half precision on the GPU kernels (f16 and bf16 inputs, f32 accumulation), two ways.
    ///
    /// - FlashAttention's rule: against the explicit path in f32, the error of the output and
    ///   of each gradient is at most twice the explicit path's own in the same precision.
    /// - f32 accumulation: on inputs that are exact in the half type (and a loss whose output
    ///   gradient is too), each result differs from the f32 reference by its final rounding
    ///   alone, at most one half-precision epsilon of the largest value; sums carried in the
    ///   half type would round at every step.
    ///
    /// Odd widths and lengths spanning several tiles; a dtype the adapter lacks is skipped with
    /// a note.
    #[cfg(feature = "wgpu")]
    #[test]
    fn the_gpu_kernels_in_half_precision_round_once_and_err_at_most_twice_the_explicit_path() {
        let Some(device) = wgpu_test_device() else {
            return;
        };
        let dropout = DropoutConfig::new(0.0).init();
        let device = device.autodiff();
        device.seed(41);
        let (seq_q, seq_k) = (45, 150);
        let ([query, key, value], _) = grouped_heads(&device, seq_q, seq_k);
        let weight = normal([2, 4, seq_q, 3], &device);
        let all = cases(&device, [2, 4, seq_q, seq_k]);
        let picked = ["causal", "padding + dead row + causal", "float bias"];
        for (dtype, epsilon) in [
            (FloatDType::F16, 2f32.powi(-10)),
            (FloatDType::BF16, 2f32.powi(-7)),
        ] {
            if !device.supports_dtype(dtype) {
                eprintln!("*** SKIPPING {dtype:?} on wgpu: the adapter does not support it ***");
                continue;
            }
            let narrow = |tensor: &Tensor<4>| tensor.clone().cast(dtype);
            let exact = |tensor: &Tensor<4>| narrow(tensor).cast(FloatDType::F32);
            let run =
                |heads: [Tensor<4>; 3],
                 weight: Tensor<4>,
                 attend: &dyn Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>| {
                    let [q, k, v] = heads.map(|tensor| tensor.detach().require_grad());
                    let output = attend(q.clone(), k.clone(), v.clone());
                    let grads = (output.clone() * weight).sum().backward();
                    [
                        output.inner(),
                        q.grad(&grads).unwrap(),
                        k.grad(&grads).unwrap(),
                        v.grad(&grads).unwrap(),
                    ]
                };
            for case in all.iter().filter(|case| picked.contains(&case.label)) {
                let half_masks = ScoreMasks {
                    bias: case.masks.bias.as_ref().map(narrow),
                    ..case.masks.clone()
                };
                let exact_masks = ScoreMasks {
                    bias: case.masks.bias.as_ref().map(exact),
                    ..case.masks.clone()
                };
                let explicit_in = |masks: &ScoreMasks| {
                    let (masks, dropout) = (masks.clone(), dropout.clone());
                    move |q, k, v| {
                        explicit_attention(q, k, v, &masks, &options(case, None), &dropout).0
                    }
                };
                let heads = || [narrow(&query), narrow(&key), narrow(&value)];
                let reference = run(
                    [exact(&query), exact(&key), exact(&value)],
                    exact(&weight),
                    &explicit_in(&exact_masks),
                );
                let explicit = run(heads(), narrow(&weight), &explicit_in(&half_masks));
                cube::native_calls::take();
                let flash = run(heads(), narrow(&weight), &|q, k, v| {
                    flash_attention(
                        q,
                        k,
                        v,
                        &half_masks,
                        &options(case, None),
                        BlockSizes::default(),
                    )
                });
                assert_eq!(cube::native_calls::take(), 2, "{dtype:?}: native calls");
                let error = |tensor: &Tensor<4>, reference: &Tensor<4>| {
                    (tensor.clone().cast(FloatDType::F32) - reference.clone())
                        .abs()
                        .max()
                        .into_scalar::<f32>()
                };
                for (index, reference) in reference.iter().enumerate() {
                    let what = ["output", "d query", "d key", "d value"][index];
                    let label = format!("{dtype:?} {}: {what}", case.label);
                    assert_eq!(flash[index].dtype(), dtype.into(), "{label} keeps its type");
                    let (ours, theirs) = (
                        error(&flash[index], reference),
                        error(&explicit[index], reference),
                    );
                    let largest = reference.clone().abs().max().into_scalar::<f32>();
                    assert!(
                        ours <= 2.0 * theirs + 1e-6,
                        "{label}: error {ours} > 2 × the explicit path's {theirs}"
                    );
                    assert!(
                        ours <= epsilon * largest,
                        "{label}: error {ours} > one rounding ({epsilon} × {largest})"
                    );
                }
            }
        }
    }

    /// Data-parallel training (burn-train's DDP) syncs a parameter's gradient once it has been
    /// registered as often as the tape has parent slots for it. Here one leaf is the query, key
    /// and value of one flash call and the key and value of a second one (with sinks), so it
    /// fills five slots: each flash node must register each of its tracked slots exactly once,
    /// through two backward passes, and the summed gradients must equal the explicit path's.
    #[test]
    fn the_backward_registers_each_tracked_parent_exactly_once() {
        registrations::take();
        let dropout = DropoutConfig::new(0.0).init();
        for device in cpu_devices() {
            let device = device.autodiff();
            device.seed(47);
            let shared = normal([2, 2, 5, 6], &device).require_grad();
            let sinks = normal([2], &device).require_grad();
            let frozen = normal([2, 2, 5, 6], &device);
            let masks = ScoreMasks::none(5);
            let blocks = BlockSizes { query: 2, key: 3 };
            let case = |sinks| options(&cases(&device, [2, 2, 5, 5]).remove(0), sinks);
            type Attend<'a> =
                &'a dyn Fn(Tensor<4>, Tensor<4>, Tensor<4>, Option<Tensor<1>>) -> Tensor<4>;
            let flash: Attend = &|q, k, v, s| flash_attention(q, k, v, &masks, &case(s), blocks);
            let explicit: Attend =
                &|q, k, v, s| explicit_attention(q, k, v, &masks, &case(s), &dropout).0;
            let grads_of = |attend: Attend| {
                let first = attend(shared.clone(), shared.clone(), shared.clone(), None);
                let second = attend(first, shared.clone(), shared.clone(), Some(sinks.clone()));
                // An untracked input takes a slot of neither count.
                let third = attend(second, frozen.clone(), shared.clone(), None);
                let grads = (third.clone() * third.sin()).sum().backward();
                [
                    shared.grad(&grads).unwrap(),
                    sinks.grad(&grads).unwrap().reshape([1, 1, 1, 2]),
                ]
            };
            let expected = grads_of(explicit);
            registrations::take();
            for pass in 0..2 {
                let actual = grads_of(flash);
                let log = registrations::take();
                assert_eq!(log.len(), 3, "three flash nodes ran their backward");
                for (mut declared, mut registered) in log {
                    declared.sort_unstable();
                    registered.sort_unstable();
                    assert_eq!(
                        registered, declared,
                        "pass {pass}: each tracked parent slot registered exactly once"
                    );
                }
                for (actual, expected) in actual.into_iter().zip(&expected) {
                    let difference = (actual - expected.clone()).abs().max().into_scalar::<f32>();
                    assert!(
                        difference <= 1e-5,
                        "pass {pass}: gradient differs by {difference}"
                    );
                }
            }
        }
    }

    /// A decoding-like call under grouped-query attention (3 query heads per key/value head, 2
    /// queries: 6 rows, a block of four and one of two) with value heads 80 wide (a 64-column
    /// chunk and a remainder), where the native forward reads each value row once per group:
    /// the explicit path's outputs and gradients on every case (the weights: below).
    #[test]
    fn grouped_query_heads_sharing_one_pass_over_wide_values_equal_the_explicit_path() {
        let dropout = DropoutConfig::new(0.0).init();
        let (batch, n_heads, n_kv_heads, seq_q, seq_k) = (2, 6, 2, 2, 37);
        for device in cpu_devices() {
            let device = device.autodiff();
            device.seed(34);
            let query = normal([batch, n_heads, seq_q, 16], &device);
            let key = normal([batch, n_kv_heads, seq_k, 16], &device);
            let value = normal([batch, n_kv_heads, seq_k, 80], &device);
            let sinks = normal([n_heads], &device);
            let heads = [&query, &key, &value];
            let blocks = BlockSizes { query: 4, key: 8 };
            for case in cases(&device, [batch, n_heads, seq_q, seq_k]) {
                let sinks = case.sinks.then_some(&sinks);
                let expected = outputs_and_grads(heads, sinks, |q, k, v, s| {
                    explicit_attention(q, k, v, &case.masks, &options(&case, s), &dropout).0
                });
                let actual = recycle::poison::with(|| {
                    outputs_and_grads(heads, sinks, |q, k, v, s| {
                        flash_attention(q, k, v, &case.masks, &options(&case, s), blocks)
                    })
                });
                assert_outputs_and_grads_close(actual, &expected, 2e-5, case.label);
            }
        }
    }

    /// A decoding step under grouped-query attention with a saturated softmax (query rows
    /// whose weights are one-hot): the backward recomputes the probabilities the forward found
    /// to the bit, so those rows' query gradients are exactly zero, as autodiff through the
    /// explicit softmax gives. Scores computed one way forward and another backward leave a
    /// rounding residue there.
    #[test]
    fn one_hot_rows_of_a_grouped_decoding_step_have_exactly_zero_query_gradients() {
        let (n_heads, seq_q, seq_k) = (4, 2, 40);
        for device in cpu_devices() {
            let device = device.autodiff();
            device.seed(35);
            let query = normal([1, n_heads, seq_q, 64], &device) * 30.0;
            let key = normal([1, 2, seq_k, 64], &device) * 30.0;
            let value = normal([1, 2, seq_k, 64], &device);
            let case = Case {
                label: "saturated",
                masks: ScoreMasks::none(seq_k),
                softcap: None,
                sinks: false,
            };
            let options = options(&case, None);
            let grads = outputs_and_grads([&query, &key, &value], None, |q, k, v, _| {
                flash_attention(q, k, v, &case.masks, &options, BlockSizes::default())
            });
            let [q, k, v] = [&query, &key, &value].map(|t| t.clone().detach());
            let (_, weights) =
                flash_attention_with_weights(q, k, v, &case.masks, &options, BlockSizes::default());
            let weights = weights.into_data().to_vec::<f32>().expect("f32 weights");
            let query_grad = grads[1]
                .clone()
                .into_data()
                .to_vec::<f32>()
                .expect("f32 grads");
            let mut one_hot_rows = 0;
            for (row, (row_weights, row_grad)) in
                weights.chunks(seq_k).zip(query_grad.chunks(64)).enumerate()
            {
                if row_weights.contains(&1.0) {
                    one_hot_rows += 1;
                    let largest = row_grad.iter().fold(0.0f32, |m, g| m.max(g.abs()));
                    assert_eq!(
                        largest, 0.0,
                        "{device:?}: one-hot row {row}'s largest |d query|"
                    );
                }
            }
            assert!(
                one_hot_rows >= n_heads * seq_q / 2,
                "{one_hot_rows} one-hot rows"
            );
        }
    }

    /// For inference, both bodies return the explicit path's weights beside its output on every
    /// case: zero for hidden keys and for a row that sees no key, the sinks' share left out;
    /// the last shape, 2 queries over value heads 80 wide, is a decoding step's grouped pass.
    #[test]
    fn both_bodies_return_the_explicit_paths_weights() {
        let dropout = DropoutConfig::new(0.0).init();
        for device in cpu_devices() {
            device.seed(33);
            for (seq_q, seq_k, value_dim) in [(5, 7, 3), (7, 3, 3), (2, 37, 80)] {
                let (batch, n_heads) = (2, 4);
                let ([query, key, value], sinks) =
                    grouped_heads_with_values(&device, seq_q, seq_k, value_dim);
                for case in cases(&device, [batch, n_heads, seq_q, seq_k]) {
                    let options = options(&case, case.sinks.then(|| sinks.clone()));
                    let (context, weights) = explicit_attention(
                        query.clone(),
                        key.clone(),
                        value.clone(),
                        &case.masks,
                        &options,
                        &dropout,
                    );
                    let blocks = BlockSizes { query: 4, key: 2 };
                    let flash = || {
                        flash_attention_with_weights(
                            query.clone(),
                            key.clone(),
                            value.clone(),
                            &case.masks,
                            &options,
                            blocks,
                        )
                    };
                    for (body, (actual_context, actual_weights)) in [
                        ("native", recycle::poison::with(flash)),
                        ("generic", with_generic_body(flash)),
                    ] {
                        for (what, actual, expected) in [
                            ("context", actual_context, &context),
                            ("weights", actual_weights, &weights),
                        ] {
                            assert_eq!(actual.dims(), expected.dims(), "{what} shape");
                            let difference =
                                (actual - expected.clone()).abs().max().into_scalar::<f32>();
                            assert!(
                                difference <= 1e-6,
                                "{} {seq_q}x{seq_k} {body}: {what} differs by {difference}",
                                case.label
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "the weights are computed for inference and cannot carry a gradient")]
    fn weights_refuse_a_tracked_input() {
        let device = Device::flex().autodiff();
        let query = normal([1, 1, 2, 4], &device).require_grad();
        let key = normal([1, 1, 3, 4], &device);
        let options = SoftmaxOptions {
            scale: 0.5,
            custom_scale: true,
            softcap: None,
            sinks: None,
        };
        flash_attention_with_weights(
            query,
            key.clone(),
            key,
            &ScoreMasks::none(3),
            &options,
            BlockSizes::default(),
        );
    }

    /// Half-precision inputs, through the native kernel and the generic body, against an f32
    /// reference by FlashAttention's rule: no more than twice the error of the explicit path
    /// computed in the same precision, plus a little.
    #[test]
    fn half_precision_inputs_are_as_accurate_as_the_explicit_path_in_that_precision() {
        let dropout = DropoutConfig::new(0.0).init();
        let device = Device::flex().autodiff();
        device.seed(32);
        let (batch, n_heads, n_kv_heads, seq_q, seq_k) = (2, 4, 2, 9, 13);
        let query = normal([batch, n_heads, seq_q, 17], &device);
        let key = normal([batch, n_kv_heads, seq_k, 17], &device);
        let value = normal([batch, n_kv_heads, seq_k, 5], &device);
        let sinks = normal([n_heads], &device);
        let heads = [&query, &key, &value];
        let max_error = |a: &Tensor<4>, b: &Tensor<4>| -> f32 {
            (a.clone().cast(FloatDType::F32) - b.clone())
                .abs()
                .max()
                .into_scalar::<f32>()
        };
        for dtype in [FloatDType::BF16, FloatDType::F16] {
            if !device.supports_dtype(dtype) {
                continue;
            }
            for case in cases(&device, [batch, n_heads, seq_q, seq_k]) {
                let reference =
                    outputs_and_grads(heads, case.sinks.then_some(&sinks), |q, k, v, s| {
                        explicit_attention(q, k, v, &case.masks, &options(&case, s), &dropout).0
                    });
                let low = |t: Tensor<4>| t.cast(dtype);
                let low_masks = ScoreMasks {
                    bias: case.masks.bias.clone().map(low),
                    ..case.masks.clone()
                };
                let explicit_low =
                    outputs_and_grads(heads, case.sinks.then_some(&sinks), |q, k, v, s| {
                        let options = options(&case, s.map(|s| s.cast(dtype)));
                        explicit_attention(low(q), low(k), low(v), &low_masks, &options, &dropout).0
                    });
                let flash_low = || {
                    outputs_and_grads(heads, case.sinks.then_some(&sinks), |q, k, v, s| {
                        let blocks = BlockSizes { query: 4, key: 5 };
                        let options = options(&case, s.map(|s| s.cast(dtype)));
                        flash_attention(low(q), low(k), low(v), &low_masks, &options, blocks)
                    })
                };
                let bodies = [
                    ("native", flash_low()),
                    ("generic", with_generic_body(flash_low)),
                ];
                for (body, flash_low) in bodies {
                    for (index, flash) in flash_low.iter().enumerate() {
                        let what = ["output", "d query", "d key", "d value", "d sinks"][index];
                        let yardstick = max_error(&explicit_low[index], &reference[index]);
                        let error = max_error(flash, &reference[index]);
                        assert!(
                            error <= 2.0 * yardstick + 1e-3,
                            "{dtype:?} {} {body}: {what} error {error} > 2 × {yardstick} + 1e-3",
                            case.label
                        );
                    }
                }
            }
        }
    }

    /// A kernel refuses inputs that do not fit together, whoever calls it.
    #[test]
    #[should_panic(expected = "do not fit together")]
    fn mismatched_head_widths_are_refused_at_the_kernel() {
        let device = Device::flex();
        let options = SoftmaxOptions {
            scale: 1.0,
            custom_scale: true,
            softcap: None,
            sinks: None,
        };
        flash_attention(
            normal([1, 2, 3, 8], &device),
            normal([1, 2, 4, 4], &device),
            normal([1, 2, 4, 4], &device),
            &ScoreMasks::none(4),
            &options,
            BlockSizes::default(),
        );
    }

    /// The native kernels read heads in place through their strides and copy other layouts
    /// first: a strided view, a negative-stride (flipped) tensor and a view at an offset give
    /// what contiguous copies of them give on the tensor-op path.
    #[test]
    fn any_input_layout_gives_the_contiguous_result() {
        for device in cpu_devices() {
            device.seed(3);
            let normal = Distribution::Normal(0.0, 1.0);
            // [batch, seq, heads, dim] memory seen as [batch, heads, seq, dim].
            let query = Tensor::<4>::random([2, 5, 4, 8], normal, &device).swap_dims(1, 2);
            let key = Tensor::<4>::random([2, 2, 7, 8], normal, &device).flip([2, 3]);
            let value = Tensor::<4>::random([2, 2, 9, 8], normal, &device).narrow(2, 2, 7);
            let copy = |tensor: &Tensor<4>| {
                let data: TensorData = tensor.to_data();
                Tensor::<4>::from_data(data, &device)
            };
            let masks = ScoreMasks {
                rules: ScoreRules {
                    query_start: 2,
                    causal: true,
                    ..ScoreRules::none(7)
                },
                ..ScoreMasks::none(7)
            };
            let options = SoftmaxOptions {
                scale: 0.3,
                custom_scale: true,
                softcap: None,
                sinks: None,
            };
            let sizes = BlockSizes { query: 2, key: 3 };
            let expected = chunked_attention(
                copy(&query),
                copy(&key),
                copy(&value),
                &masks,
                &options,
                sizes,
            );
            let actual = flash_attention(query, key, value, &masks, &options, sizes);
            actual
                .into_data()
                .assert_approx_eq::<f32>(&expected.into_data(), Tolerance::absolute(1e-5));
        }
    }
}
