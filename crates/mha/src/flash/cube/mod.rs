//! The flash op's native CubeCL kernels (wgpu, Vulkan, Metal, CUDA, ROCm): a forward that
//! writes the output and each query's softmax statistics, and FlashAttention-2's backward
//! (`D = rowsum(dO ∘ O)`, then `dQ` and `dK`/`dV` kernels that recompute every score tile
//! from the statistics). Work per tile, not per score: a cube per block of rows, each unit
//! owning several rows and every column of a score tile staged through shared memory, the
//! two products of each tile as register-tiled FMAs (`tile.rs`), the online rescale once per
//! tile. GQA reads each key/value head for its whole group (no copies); bottom-right causal
//! masking skips whole tiles; tiles that nothing hides take no per-score mask work
//! (`score.rs`), the others apply a float bias, key padding, windows and causal rules per
//! score; a custom scale, a soft cap and ALiBi everywhere. Inputs are read in their float type,
//! in vectors, and everything is accumulated in f32.
//!
//! Burn runs the CubeCL backends through its fusion backend: the kernels are registered as
//! custom fusion operations (the `CubeFlashKernels` extension below), so they queue lazily
//! with the ops around them.
//!
//! What they do not take goes to the generic body (`generic.rs`), forward and backward alike
//! (one decision per call, [`NativeCall::of`]): attention sinks, packed-sequence segments, head
//! widths over [`MAX_HEAD_DIM`], and empty sequences. `flash_attention_supported` and the
//! dispatch treat both the same; only speed differs.

mod backward;
mod forward;
mod plan;
mod score;
mod tile;

use burn::backend::fusion::custom::TensorSpec;
use burn::backend::ops::{BoolTensorOps, FloatTensorOps};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, DType, ExtensionType, Shape, TensorData, TensorMetadata};
use burn::backend::{FloatDType, backend_extension};
use burn_cubecl::CubeBackend;
use burn_cubecl::cubecl;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::inputs::{FlashForward, FlashGrads, FlashInputs, FlashParams, FlashState};
use super::{FlashAttentionBackend, FlashKernels, generic, native_or_generic, precision};
use crate::execution::{Pass, Ran};
use crate::extension::{MaybeBool, MaybeFloat};
use crate::geometry::Geometry;
use plan::{Executor, Plan};
use score::{Flags, ProblemLaunch, StridesLaunch};

/// The widest query/key and value heads the kernels keep in registers.
pub(crate) const MAX_HEAD_DIM: usize = 256;

/// Units per cube of the `D = rowsum(dO ∘ O)` kernel.
const ROW_DOT_UNITS: usize = 256;

/// What a native call computes besides its tensors.
#[derive(Debug, Clone)]
pub(crate) struct NativeCall {
    scale: f32,
    softcap: Option<f32>,
    query_start: i32,
    key_start: i32,
    pinned: u32,
    positional: u32,
    window: u32,
    causal: bool,
    has_bias: bool,
    has_forbid: bool,
    has_alibi: bool,
}

/// The forward's results.
#[derive(ExtensionType)]
#[extension_type(fusion)]
pub(crate) struct NativeForward<B: Backend> {
    /// `[batch, n_heads, seq_q, value_dim]`, the inputs' type.
    pub output: FloatTensor<B>,
    /// `[batch, n_heads, seq_q, 2]`, f32: `(m, 1 / Σ)` per query.
    pub stats: FloatTensor<B>,
}

/// The backward's results, each the shape and type of its input.
#[derive(ExtensionType)]
#[extension_type(fusion)]
pub(crate) struct NativeGrads<B: Backend> {
    pub query: FloatTensor<B>,
    pub key: FloatTensor<B>,
    pub value: FloatTensor<B>,
}

/// The kernels as backend operations (custom fusion operations on `Fusion<CubeBackend>`).
///
/// `bias` and `forbid` (1 for a hidden key, 0 otherwise) broadcast to
/// `[batch, n_heads, seq_q, seq_k]`; `slopes` is `[n_heads]`. Each is a one-element
/// placeholder when the call says it has none.
#[backend_extension(Cube: cfg(feature = "cube"), Fusion)]
pub(crate) trait CubeFlashKernels: Backend {
    #[fusion(meta = forward_meta)]
    fn native_flash_forward(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        forbid: FloatTensor<Self>,
        slopes: FloatTensor<Self>,
        call: NativeCall,
    ) -> NativeForward<Self>;

    #[allow(clippy::too_many_arguments)]
    #[fusion(meta = backward_meta)]
    fn native_flash_backward(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        forbid: FloatTensor<Self>,
        slopes: FloatTensor<Self>,
        output: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        call: NativeCall,
    ) -> NativeGrads<Self>;
}

fn forward_meta(
    query: &TensorSpec,
    _key: &TensorSpec,
    value: &TensorSpec,
    _bias: &TensorSpec,
    _forbid: &TensorSpec,
    _slopes: &TensorSpec,
    _call: &NativeCall,
) -> NativeForwardMetadata {
    let [batch, heads, seq_q] = [query.shape[0], query.shape[1], query.shape[2]];
    NativeForwardMetadata {
        output: TensorSpec::new(
            Shape::new([batch, heads, seq_q, value.shape[3]]),
            query.dtype,
        ),
        stats: TensorSpec::new(Shape::new([batch, heads, seq_q, 2]), DType::F32),
    }
}

#[allow(clippy::too_many_arguments)]
fn backward_meta(
    query: &TensorSpec,
    key: &TensorSpec,
    value: &TensorSpec,
    _bias: &TensorSpec,
    _forbid: &TensorSpec,
    _slopes: &TensorSpec,
    _output: &TensorSpec,
    _stats: &TensorSpec,
    _output_grad: &TensorSpec,
    _call: &NativeCall,
) -> NativeGradsMetadata {
    NativeGradsMetadata {
        query: query.clone(),
        key: key.clone(),
        value: value.clone(),
    }
}

/// A call's tensors and scalars as the kernels take them.
struct NativeInputs<B: Backend> {
    query: FloatTensor<B>,
    key: FloatTensor<B>,
    value: FloatTensor<B>,
    bias: FloatTensor<B>,
    forbid: FloatTensor<B>,
    slopes: FloatTensor<B>,
    call: NativeCall,
}

/// What decides whether the kernels take a call (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
struct CallTraits {
    query: DType,
    key: DType,
    value: DType,
    bias: Option<DType>,
    sinks: bool,
    segments: bool,
    geometry: Geometry,
    executor: Executor,
}

impl CallTraits {
    fn of(inputs: &FlashInputs<burn::backend::Cube>) -> Self {
        let device = inputs.query.device();
        Self {
            query: inputs.query.dtype(),
            key: inputs.key.dtype(),
            value: inputs.value.dtype(),
            bias: inputs.bias.as_ref().map(|bias| bias.dtype()),
            sinks: inputs.sinks.is_some(),
            segments: inputs.params.rules.segments.is_some(),
            geometry: inputs.geometry(),
            executor: Executor::of(device.client().properties()),
        }
    }

    /// Whether the kernels take the call: no sinks or segments, one float type the kernels
    /// read for every float input, head widths they keep in registers, no empty axis, and
    /// loops the device runs to the end.
    fn taken(&self) -> bool {
        let dtype = self.query;
        let geometry = &self.geometry;
        !self.sinks
            && !self.segments
            && matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
            && [self.key, self.value] == [dtype, dtype]
            && self.bias.is_none_or(|bias| bias == dtype)
            && geometry.head_dim <= MAX_HEAD_DIM
            && geometry.value_dim <= MAX_HEAD_DIM
            && geometry.seq_q > 0
            && geometry.seq_k > 0
            && geometry.batch * geometry.n_heads > 0
            && Plan::new(geometry, self.executor).runs_to_the_end(geometry, self.executor)
    }
}

impl NativeCall {
    /// The kernels' form of `inputs`, or `None` for what they do not take ([`CallTraits`]).
    fn of(inputs: &FlashInputs<burn::backend::Cube>) -> Option<NativeInputs<burn::backend::Cube>> {
        if !CallTraits::of(inputs).taken() {
            return None;
        }
        let rules = &inputs.params.rules;
        let dtype = inputs.query.dtype();
        let device = inputs.query.device();
        type B = burn::backend::Cube;
        let placeholder = || B::float_zeros(Shape::new([1]), &device, FloatDType::from(dtype));
        let call = NativeCall {
            scale: inputs.params.scale as f32,
            softcap: inputs.params.softcap.map(|cap| cap as f32),
            query_start: to_i32(rules.query_start),
            key_start: to_i32(rules.key_start),
            pinned: to_u32(rules.pinned_keys),
            positional: to_u32(rules.positional_keys),
            window: rules.window.map_or(0, to_u32),
            causal: rules.causal,
            has_bias: inputs.bias.is_some(),
            has_forbid: inputs.forbid.is_some(),
            has_alibi: rules.alibi.is_some(),
        };
        Some(NativeInputs {
            query: inputs.query.clone(),
            key: inputs.key.clone(),
            value: inputs.value.clone(),
            bias: inputs.bias.clone().unwrap_or_else(placeholder),
            forbid: inputs.forbid.clone().map_or_else(placeholder, |forbid| {
                B::bool_into_float(forbid, FloatDType::from(dtype))
            }),
            slopes: rules.alibi.as_ref().map_or_else(
                || B::float_zeros(Shape::new([1]), &device, FloatDType::F32),
                |slopes| {
                    B::float_from_data(TensorData::new(slopes.to_vec(), [slopes.len()]), &device)
                },
            ),
            call,
        })
    }
}

fn to_i32(value: i64) -> i32 {
    i32::try_from(value).expect("flash attention: positions must fit in i32 on the GPU kernels")
}

fn to_u32(value: usize) -> u32 {
    u32::try_from(value).expect("flash attention: sizes must fit in u32 on the GPU kernels")
}

/// The native kernels where they take the call, the generic body (half precision widened to
/// f32) for the rest and for the weights.
impl FlashKernels for burn::backend::Cube {
    fn forward_kernel(inputs: &FlashInputs<Self>) -> FlashForward<Self> {
        native_or_generic(
            &inputs.params.execution,
            Pass::Forward,
            Ran::Cube,
            || NativeCall::of(inputs).map(native_forward),
            || precision::forward(inputs, generic::forward),
        )
    }

    fn backward_kernel(
        state: &FlashState<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FlashGrads<Self> {
        state.check_output_grad(&output_grad);
        native_or_generic(
            &state.inputs.params.execution,
            Pass::Backward,
            Ran::Cube,
            || {
                NativeCall::of(&state.inputs)
                    .map(|native| native_backward(state, native, &output_grad))
            },
            || precision::backward(state, output_grad.clone(), generic::backward),
        )
    }
}

fn native_forward(native: NativeInputs<burn::backend::Cube>) -> FlashForward<burn::backend::Cube> {
    let NativeForward { output, stats } = burn::backend::Cube::native_flash_forward(
        native.query,
        native.key,
        native.value,
        native.bias,
        native.forbid,
        native.slopes,
        native.call,
    );
    FlashForward {
        output,
        softmax_stats: stats,
    }
}

fn native_backward(
    state: &FlashState<burn::backend::Cube>,
    native: NativeInputs<burn::backend::Cube>,
    output_grad: &FloatTensor<burn::backend::Cube>,
) -> FlashGrads<burn::backend::Cube> {
    let NativeGrads { query, key, value } = burn::backend::Cube::native_flash_backward(
        native.query,
        native.key,
        native.value,
        native.bias,
        native.forbid,
        native.slopes,
        state.output.clone(),
        state.softmax_stats.clone(),
        output_grad.clone(),
        native.call,
    );
    FlashGrads {
        query,
        key,
        value,
        sinks: None,
    }
}

super::kernel_routed_extension!(burn::backend::Cube);

/// What the launches derive from a call's sizes.
trait LaunchSizes {
    fn problem(&self, call: &NativeCall, bias: &CubeTensor, forbid: &CubeTensor) -> ProblemLaunch;
    fn flags(&self, call: &NativeCall) -> Flags;
}

impl LaunchSizes for Geometry {
    fn problem(&self, call: &NativeCall, bias: &CubeTensor, forbid: &CubeTensor) -> ProblemLaunch {
        let strides = |tensor: &CubeTensor, used: bool| {
            let [batch, head, query, key] = if used {
                broadcast_strides(tensor)
            } else {
                [0; 4]
            };
            StridesLaunch::new(batch, head, query, key)
        };
        ProblemLaunch::new(
            to_u32(self.seq_q),
            to_u32(self.seq_k),
            to_u32(self.n_heads),
            to_u32(self.n_kv_heads),
            call.scale,
            call.softcap.unwrap_or(1.0),
            call.query_start,
            call.key_start,
            call.pinned,
            call.positional,
            call.window,
            strides(bias, call.has_bias),
            strides(forbid, call.has_forbid),
        )
    }

    fn flags(&self, call: &NativeCall) -> Flags {
        Flags {
            causal: call.causal,
            capped: call.softcap.is_some(),
            has_bias: call.has_bias,
            has_forbid: call.has_forbid,
            has_alibi: call.has_alibi,
            head_dim: self.head_dim,
            value_dim: self.value_dim,
        }
    }
}

fn dims(tensor: &CubeTensor) -> [usize; 4] {
    super::inputs::dims(&tensor.shape())
}

/// Element strides of a contiguous rank-4 tensor read as its broadcast to the scores: 0 on
/// axes of size 1.
fn broadcast_strides(tensor: &CubeTensor) -> [u32; 4] {
    let shape = dims(tensor);
    let mut strides = [0u32; 4];
    let mut stride = 1usize;
    for axis in (0..4).rev() {
        if shape[axis] != 1 {
            strides[axis] = to_u32(stride);
        }
        stride *= shape[axis];
    }
    strides
}

/// What `device` tells `AttentionPath::Auto` (see [`CubeTraits`](super::CubeTraits)).
pub(crate) fn device_traits(device: &cubecl::Device) -> super::CubeTraits {
    let client = device.client();
    let properties = client.properties();
    super::CubeTraits {
        tensor_cores: !properties.features.matmul.cmma.is_empty(),
        memory: properties.memory.max_memory(),
    }
}

/// What runs `client`'s kernels.
fn executor(client: &cubecl::client::Client) -> Executor {
    Executor::of(client.properties())
}

fn address_type(tensors: &[&CubeTensor]) -> AddressType {
    tensors
        .iter()
        .map(|tensor| tensor.required_address_type())
        .max()
        .unwrap_or_default()
}

impl CubeFlashKernels for CubeBackend {
    fn native_flash_forward(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        forbid: FloatTensor<Self>,
        slopes: FloatTensor<Self>,
        call: NativeCall,
    ) -> NativeForward<Self> {
        let [query, key, value, bias, forbid, slopes] =
            [query, key, value, bias, forbid, slopes].map(into_contiguous);
        let sizes = Geometry::of_heads(dims(&query), dims(&key), dims(&value));
        let (client, device, dtype) = (query.client.clone(), query.device.clone(), query.dtype);
        let rows = sizes.batch * sizes.n_heads;
        let output = empty_device_contiguous_dtype(
            client.clone(),
            device.clone(),
            Shape::new([sizes.batch, sizes.n_heads, sizes.seq_q, sizes.value_dim]),
            dtype,
        );
        let stats = empty_device_contiguous_dtype(
            client.clone(),
            device,
            Shape::new([sizes.batch, sizes.n_heads, sizes.seq_q, 2]),
            DType::F32,
        );
        let address = address_type(&[&query, &key, &value, &bias, &forbid, &output]);
        let problem = sizes.problem(&call, &bias, &forbid);
        let tiling = Plan::new(&sizes, executor(&client)).query_side;
        forward::forward_kernel::launch(
            &client,
            CubeCount::Static(
                to_u32(sizes.seq_q.div_ceil(tiling.units * tiling.rows)),
                to_u32(rows),
                1,
            ),
            CubeDim::new_1d(tiling.units as u32),
            address,
            plan::vector_size(&sizes),
            query.into_tensor_arg(),
            key.into_tensor_arg(),
            value.into_tensor_arg(),
            bias.into_tensor_arg(),
            forbid.into_tensor_arg(),
            slopes.into_tensor_arg(),
            output.clone().into_tensor_arg(),
            stats.clone().into_tensor_arg(),
            problem,
            sizes.flags(&call),
            tiling,
            burn::backend::cubecl::dtype_to_storage_type(dtype),
        );
        NativeForward { output, stats }
    }

    // Over 80 lines: three launches, mostly their argument lists.
    fn native_flash_backward(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        forbid: FloatTensor<Self>,
        slopes: FloatTensor<Self>,
        output: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        call: NativeCall,
    ) -> NativeGrads<Self> {
        let [
            query,
            key,
            value,
            bias,
            forbid,
            slopes,
            output,
            stats,
            output_grad,
        ] = [
            query,
            key,
            value,
            bias,
            forbid,
            slopes,
            output,
            stats,
            output_grad,
        ]
        .map(into_contiguous);
        let sizes = Geometry::of_heads(dims(&query), dims(&key), dims(&value));
        let (client, device, dtype) = (query.client.clone(), query.device.clone(), query.dtype);
        let storage = burn::backend::cubecl::dtype_to_storage_type(dtype);
        let query_rows = sizes.batch * sizes.n_heads * sizes.seq_q;
        let row_dots = empty_device_contiguous_dtype(
            client.clone(),
            device.clone(),
            Shape::new([sizes.batch, sizes.n_heads, sizes.seq_q]),
            DType::F32,
        );
        let empty_like = |tensor: &CubeTensor| {
            empty_device_contiguous_dtype(client.clone(), device.clone(), tensor.shape(), dtype)
        };
        let (query_grad, key_grad, value_grad) =
            (empty_like(&query), empty_like(&key), empty_like(&value));
        let address = address_type(&[
            &query,
            &key,
            &value,
            &bias,
            &forbid,
            &output,
            &output_grad,
            &stats,
        ]);

        let cube_dim = CubeDim::new_1d(ROW_DOT_UNITS as u32);
        backward::row_dot_kernel::launch(
            &client,
            CubeCount::Static(to_u32(query_rows.div_ceil(ROW_DOT_UNITS)), 1, 1),
            cube_dim,
            address,
            output.into_tensor_arg(),
            output_grad.clone().into_tensor_arg(),
            row_dots.clone().into_tensor_arg(),
            sizes.value_dim,
            storage,
        );
        let plan = Plan::new(&sizes, executor(&client));
        let query_tiling = plan.query_side;
        backward::query_grad_kernel::launch(
            &client,
            CubeCount::Static(
                to_u32(sizes.seq_q.div_ceil(query_tiling.units * query_tiling.rows)),
                to_u32(sizes.batch * sizes.n_heads),
                1,
            ),
            CubeDim::new_1d(query_tiling.units as u32),
            address,
            plan::vector_size(&sizes),
            query.clone().into_tensor_arg(),
            key.clone().into_tensor_arg(),
            value.clone().into_tensor_arg(),
            bias.clone().into_tensor_arg(),
            forbid.clone().into_tensor_arg(),
            slopes.clone().into_tensor_arg(),
            stats.clone().into_tensor_arg(),
            row_dots.clone().into_tensor_arg(),
            output_grad.clone().into_tensor_arg(),
            query_grad.clone().into_tensor_arg(),
            sizes.problem(&call, &bias, &forbid),
            sizes.flags(&call),
            query_tiling,
            storage,
        );
        let key_tiling = plan.key_side;
        backward::key_value_grad_kernel::launch(
            &client,
            CubeCount::Static(
                to_u32(sizes.seq_k.div_ceil(key_tiling.units * key_tiling.rows)),
                to_u32(sizes.batch * sizes.n_kv_heads),
                1,
            ),
            CubeDim::new_1d(key_tiling.units as u32),
            address,
            plan::vector_size(&sizes),
            query.into_tensor_arg(),
            key.into_tensor_arg(),
            value.into_tensor_arg(),
            bias.clone().into_tensor_arg(),
            forbid.clone().into_tensor_arg(),
            slopes.into_tensor_arg(),
            stats.into_tensor_arg(),
            row_dots.into_tensor_arg(),
            output_grad.into_tensor_arg(),
            key_grad.clone().into_tensor_arg(),
            value_grad.clone().into_tensor_arg(),
            sizes.problem(&call, &bias, &forbid),
            sizes.flags(&call),
            key_tiling,
            storage,
        );
        NativeGrads {
            query: query_grad,
            key: key_grad,
            value: value_grad,
        }
    }
}

#[cfg(test)]
mod tests;
