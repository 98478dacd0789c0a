//! Memory-bounded attention for training: one autodiff op whose forward runs query blocks ×
//! key blocks with an online softmax and keeps only the output and each query's log-sum-exp,
//! and whose backward recomputes every score block from that log-sum-exp (FlashAttention-2's
//! backward, Dao 2023, Algorithm 2).
//!
//! Chunking with ordinary tensor ops bounds inference memory only: under autodiff every block's
//! scores and probabilities are kept for the backward pass, which is the full score matrix
//! again. Per-chunk gradient checkpointing would avoid that too, but Burn's checkpointing is a
//! strategy of the whole device, not something one op can ask for, and it would run each
//! block's forward twice. A custom backward node keeps `O(seq · head_dim)` state and costs one
//! extra `q kᵀ` product per block.
//!
//! The op is a Burn backend extension, written once in backend primitives and routed to the
//! backends listed on [`FlashAttentionBackend`]; [`flash_attention_supported`] says whether a
//! device is one of them, since calling it on another panics.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{
    Autodiff, Backend, Dispatch, DispatchDevice, ExtensionType, Shape, Slice, TensorData,
    TensorMetadata, backend_extension,
};
use burn::tensor::{Bool, Device, Tensor};

use crate::kernel::{ChunkSizes, SoftmaxOptions};
use crate::mask::ScoreMasks;

/// What one flash-attention call computes besides `q`, `k` and `v`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlashParams {
    /// Multiplies `q kᵀ`.
    pub scale: f64,
    /// Bottom-right aligned causal masking: query `i` of `seq_q` sees keys up to
    /// `i + seq_k - seq_q`.
    pub causal: bool,
    /// Query and key block sizes.
    pub chunks: ChunkSizes,
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
    fn from_option(tensor: Option<FloatTensor<B>>) -> Self {
        tensor.map_or(Self::None, Self::Some)
    }

    fn into_option(self) -> Option<FloatTensor<B>> {
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
#[backend_extension(Flex: cfg(feature = "flex"), NdArray: cfg(feature = "ndarray"), Autodiff)]
pub(crate) trait FlashAttentionBackend: Backend {
    /// `softmax(q kᵀ · scale + bias, forbidden and causal-future keys removed) v` by blocks.
    ///
    /// # Shapes
    ///
    /// - query: `[batch, n_heads, seq_q, head_dim]`
    /// - key: `[batch, n_kv_heads, seq_k, head_dim]`, `n_heads` a multiple of `n_kv_heads`
    /// - value: `[batch, n_kv_heads, seq_k, value_dim]`
    /// - bias, forbid: broadcastable to `[batch, n_heads, seq_q, seq_k]`; the bias is treated as
    ///   a constant (it gets no gradient)
    /// - output: `[batch, n_heads, seq_q, value_dim]`; a query with no allowed key outputs zeros
    fn flash_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        #[extension_type] bias: MaybeFloat<Self>,
        #[extension_type] forbid: MaybeBool<Self>,
        params: FlashParams,
    ) -> FloatTensor<Self> {
        let inputs = FlashInputs::<Self> {
            query,
            key,
            value,
            bias: bias.into_option(),
            forbid: forbid.into_option(),
            params,
        };
        flash_forward(&inputs).output
    }
}

/// The forward and backward computations of a backend, generic unless overridden.
pub(crate) trait FlashKernels: Backend {
    fn forward_kernel(inputs: &FlashInputs<Self>) -> FlashForward<Self> {
        flash_forward(inputs)
    }

    fn backward_kernel(
        state: &FlashState<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FlashGrads<Self> {
        flash_backward(state, output_grad)
    }
}

/// Gives a CPU backend the native kernels of `flash_cpu.rs`, with the generic body for the
/// dtypes they do not take.
#[cfg(any(feature = "flex", feature = "ndarray"))]
macro_rules! native_flash_kernels {
    ($backend:ty) => {
        impl FlashKernels for $backend {
            fn forward_kernel(inputs: &FlashInputs<Self>) -> FlashForward<Self> {
                crate::flash_cpu::forward(inputs).unwrap_or_else(|| flash_forward(inputs))
            }

            fn backward_kernel(
                state: &FlashState<Self>,
                output_grad: FloatTensor<Self>,
            ) -> FlashGrads<Self> {
                crate::flash_cpu::backward(state, &output_grad)
                    .unwrap_or_else(|| flash_backward(state, output_grad))
            }
        }

        impl FlashAttentionBackend for $backend {
            fn flash_attention(
                query: FloatTensor<Self>,
                key: FloatTensor<Self>,
                value: FloatTensor<Self>,
                bias: MaybeFloat<Self>,
                forbid: MaybeBool<Self>,
                params: FlashParams,
            ) -> FloatTensor<Self> {
                let inputs = FlashInputs {
                    query,
                    key,
                    value,
                    bias: bias.into_option(),
                    forbid: forbid.into_option(),
                    params,
                };
                Self::forward_kernel(&inputs).output
            }
        }
    };
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
        params: FlashParams,
    ) -> FloatTensor<Self> {
        let nodes = [query.node(), key.node(), value.node()];
        let inputs = FlashInputs::<B> {
            query: query.into_primitive(),
            key: key.into_primitive(),
            value: value.into_primitive(),
            bias: bias.into_option().map(|bias| bias.into_primitive()),
            forbid: forbid.into_option(),
            params,
        };
        match FlashAttentionBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let FlashForward {
                    output,
                    log_sum_exp,
                } = B::forward_kernel(&inputs);
                let state = FlashState {
                    inputs,
                    output: output.clone(),
                    log_sum_exp,
                };
                prep.finish(state, output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::forward_kernel(&inputs).output),
        }
    }
}

/// Whether [`flash_attention`] runs on `device` (autodiff or not): the backends compiled into
/// [`FlashAttentionBackend`] by this crate's `flex` and `ndarray` features.
pub fn flash_attention_supported(device: &Device) -> bool {
    fn supported(device: &DispatchDevice) -> bool {
        match device {
            #[cfg(feature = "flex")]
            DispatchDevice::Flex(_) => true,
            #[cfg(feature = "ndarray")]
            DispatchDevice::NdArray(_) => true,
            DispatchDevice::Autodiff(inner) => supported(inner),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
    supported(device.as_dispatch())
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
    options: SoftmaxOptions,
    chunks: ChunkSizes,
) -> Tensor<4> {
    assert!(
        flash_attention_supported(&query.device()),
        "MultiHeadAttention: the flash kernel does not run on {:?}; enable this crate's feature \
         for that backend or use another `AttentionPath`",
        query.device()
    );
    assert!(!options.quiet, "the flash kernel has no quiet softmax");
    let params = FlashParams {
        scale: options.scale,
        causal: masks.causal,
        chunks,
    };
    let output = <Dispatch as FlashAttentionBackend>::flash_attention(
        query.into_dispatch(),
        key.into_dispatch(),
        value.into_dispatch(),
        MaybeFloat::from_option(masks.bias.clone().map(Tensor::into_dispatch)),
        MaybeBool::from_option(masks.forbid.clone().map(Tensor::<4, Bool>::into_dispatch)),
        params,
    );
    Tensor::from_dispatch(output)
}

/// The op's inputs on the backend that computes it.
#[derive(Debug, Clone)]
pub(crate) struct FlashInputs<B: Backend> {
    pub query: FloatTensor<B>,
    pub key: FloatTensor<B>,
    pub value: FloatTensor<B>,
    pub bias: Option<FloatTensor<B>>,
    pub forbid: Option<BoolTensor<B>>,
    pub params: FlashParams,
}

pub(crate) struct FlashForward<B: Backend> {
    /// `[batch, n_heads, seq_q, value_dim]`
    pub output: FloatTensor<B>,
    /// `log Σ_k exp(score)` per query, `[batch, n_heads, seq_q, 1]`; `f32::MIN` for a query with
    /// no allowed key, so that every recomputed probability of that row is `exp(-inf) = 0`.
    pub log_sum_exp: FloatTensor<B>,
}

/// What the backward pass keeps: the inputs, the output and the log-sum-exp, `O(seq)` each.
#[derive(Debug, Clone)]
pub(crate) struct FlashState<B: Backend> {
    pub inputs: FlashInputs<B>,
    pub output: FloatTensor<B>,
    pub log_sum_exp: FloatTensor<B>,
}

#[derive(Debug)]
struct FlashAttentionBackward;

impl<B: FlashKernels> Backward<B, 3> for FlashAttentionBackward {
    type State = FlashState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [query_node, key_node, value_node] = ops.parents;
        let output_grad = grads.consume::<B>(&ops.node);
        let FlashGrads { query, key, value } = B::backward_kernel(&ops.state, output_grad);
        for (node, grad) in [(query_node, query), (key_node, key), (value_node, value)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

pub(crate) struct FlashGrads<B: Backend> {
    pub query: FloatTensor<B>,
    pub key: FloatTensor<B>,
    pub value: FloatTensor<B>,
}

/// Sizes of one call, read off its inputs.
#[derive(Debug, Clone, Copy)]
struct Geometry {
    batch: usize,
    n_heads: usize,
    n_kv_heads: usize,
    groups: usize,
    seq_q: usize,
    seq_k: usize,
    head_dim: usize,
    value_dim: usize,
}

impl Geometry {
    fn of<B: Backend>(inputs: &FlashInputs<B>) -> Self {
        let [batch, n_heads, seq_q, head_dim] = dims::<B>(&inputs.query);
        let [_, n_kv_heads, seq_k, _] = dims::<B>(&inputs.key);
        let value_dim = dims::<B>(&inputs.value)[3];
        Self {
            batch,
            n_heads,
            n_kv_heads,
            groups: n_heads / n_kv_heads,
            seq_q,
            seq_k,
            head_dim,
            value_dim,
        }
    }

    /// Query blocks: `(start, length)`.
    fn query_blocks(&self, chunks: ChunkSizes) -> impl Iterator<Item = (usize, usize)> {
        blocks(self.seq_q, chunks.query)
    }

    /// Key blocks that query block `(q_start, q_len)` can see.
    fn key_blocks(
        &self,
        params: &FlashParams,
        (q_start, q_len): (usize, usize),
    ) -> impl Iterator<Item = (usize, usize)> {
        // The block's last query sees keys up to q_start + q_len - 1 + seq_k - seq_q.
        let last_visible = (q_start + q_len + self.seq_k) as i64 - 1 - self.seq_q as i64;
        let causal = params.causal;
        blocks(self.seq_k, params.chunks.key)
            .take_while(move |&(k_start, _)| !causal || k_start as i64 <= last_visible)
    }

    /// `[batch, n_heads, rows, cols]`.
    fn per_head(&self, rows: usize, cols: usize) -> Shape {
        Shape::new([self.batch, self.n_heads, rows, cols])
    }

    /// `[batch, n_kv_heads, groups · rows, cols]`: the query heads sharing a key/value head
    /// stacked, so one matmul per key/value head serves its whole group.
    fn grouped(&self, rows: usize, cols: usize) -> Shape {
        Shape::new([self.batch, self.n_kv_heads, self.groups * rows, cols])
    }
}

fn blocks(length: usize, block: usize) -> impl Iterator<Item = (usize, usize)> {
    let block = block.max(1);
    (0..length)
        .step_by(block)
        .map(move |start| (start, block.min(length - start)))
}

fn dims<B: Backend>(tensor: &FloatTensor<B>) -> [usize; 4] {
    let shape = tensor.shape();
    [shape[0], shape[1], shape[2], shape[3]]
}

/// `tensor[.., .., start..start + length]` along `axis`, or the tensor itself where that axis
/// has size 1 (a broadcast mask or bias).
fn narrow<B: Backend>(
    tensor: FloatTensor<B>,
    axis: usize,
    start: usize,
    length: usize,
) -> FloatTensor<B> {
    let shape = tensor.shape();
    if shape[axis] == 1 && length != 1 {
        return tensor;
    }
    B::float_slice(tensor, &axis_slices(&shape, axis, start, length))
}

fn narrow_bool<B: Backend>(
    tensor: BoolTensor<B>,
    axis: usize,
    start: usize,
    length: usize,
) -> BoolTensor<B> {
    let shape = tensor.shape();
    if shape[axis] == 1 && length != 1 {
        return tensor;
    }
    B::bool_slice(tensor, &axis_slices(&shape, axis, start, length))
}

fn axis_slices(shape: &Shape, axis: usize, start: usize, length: usize) -> Vec<Slice> {
    (0..shape.num_dims())
        .map(|dim| {
            if dim == axis {
                Slice::from(start..start + length)
            } else {
                Slice::from(0..shape[dim])
            }
        })
        .collect()
}

/// One score block: `q kᵀ · scale + bias`, forbidden and causal-future keys at `-inf`,
/// `[batch, n_heads, q_len, k_len]`.
struct ScoreBlock<'a, B: Backend> {
    inputs: &'a FlashInputs<B>,
    geometry: Geometry,
    /// `(start, length)` of the query block.
    queries: (usize, usize),
    /// This query block, scaled and grouped: `[batch, n_kv_heads, groups · q_len, head_dim]`.
    scaled_query: FloatTensor<B>,
}

impl<B: Backend> ScoreBlock<'_, B> {
    fn scores(&self, keys: (usize, usize), key_block: &FloatTensor<B>) -> FloatTensor<B> {
        let (q_start, q_len) = self.queries;
        let (k_start, k_len) = keys;
        let geometry = &self.geometry;
        let shape = geometry.per_head(q_len, k_len);
        let transposed = B::float_swap_dims(key_block.clone(), 2, 3);
        let mut scores = B::float_reshape(
            B::float_matmul(self.scaled_query.clone(), transposed),
            shape.clone(),
        );
        if let Some(bias) = &self.inputs.bias {
            let bias = narrow::<B>(
                narrow::<B>(bias.clone(), 2, q_start, q_len),
                3,
                k_start,
                k_len,
            );
            scores = B::float_add(scores, bias);
        }
        if let Some(forbid) = &self.inputs.forbid {
            let forbid = narrow_bool::<B>(
                narrow_bool::<B>(forbid.clone(), 2, q_start, q_len),
                3,
                k_start,
                k_len,
            );
            scores = B::float_mask_fill(
                scores,
                B::bool_expand(forbid, shape.clone()),
                f32::NEG_INFINITY.into(),
            );
        }
        let future_offset = (k_start + geometry.seq_q) as i64 - (q_start + geometry.seq_k) as i64;
        // Query i (of this block) sees key j when j - i <= -future_offset.
        if self.inputs.params.causal && k_len as i64 - 1 + future_offset > 0 {
            let device = scores.device();
            let future = causal_block::<B>(q_len, k_len, future_offset, &device);
            scores = B::float_add(scores, future);
        }
        scores
    }
}

/// `[1, 1, q_len, k_len]`: `-inf` where key `j` is in query `i`'s future (`j - i > -offset`),
/// else 0.
fn causal_block<B: Backend>(
    q_len: usize,
    k_len: usize,
    offset: i64,
    device: &B::Device,
) -> FloatTensor<B> {
    let values: Vec<f32> = (0..q_len as i64)
        .flat_map(|i| {
            (0..k_len as i64).map(move |j| {
                if j - i + offset > 0 {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
        })
        .collect();
    B::float_from_data(TensorData::new(values, [1, 1, q_len, k_len]), device)
}

/// The query block `(start, length)` times `scale`, grouped: `[batch, n_kv_heads, groups ·
/// length, head_dim]`.
fn scaled_query_block<B: Backend>(
    inputs: &FlashInputs<B>,
    geometry: &Geometry,
    (start, length): (usize, usize),
) -> FloatTensor<B> {
    let block = narrow::<B>(inputs.query.clone(), 2, start, length);
    let scaled = B::float_mul_scalar(block, inputs.params.scale.into());
    B::float_reshape(scaled, geometry.grouped(length, geometry.head_dim))
}

fn flash_forward<B: Backend>(inputs: &FlashInputs<B>) -> FlashForward<B> {
    let geometry = Geometry::of(inputs);
    let params = inputs.params;
    let mut outputs = Vec::new();
    let mut log_sum_exps = Vec::new();
    for queries in geometry.query_blocks(params.chunks) {
        let (_, q_len) = queries;
        let block = ScoreBlock {
            inputs,
            geometry,
            queries,
            scaled_query: scaled_query_block(inputs, &geometry, queries),
        };
        // Running maximum, sum of exponentials and weighted values per query.
        let mut running: Option<(FloatTensor<B>, FloatTensor<B>, FloatTensor<B>)> = None;
        for keys in geometry.key_blocks(&params, queries) {
            let (k_start, k_len) = keys;
            let key_block = narrow::<B>(inputs.key.clone(), 2, k_start, k_len);
            let value_block = narrow::<B>(inputs.value.clone(), 2, k_start, k_len);
            let scores = block.scores(keys, &key_block);
            let block_max = B::float_max_dim(scores.clone(), 3);
            let new_max = match &running {
                None => block_max,
                Some((max, _, _)) => {
                    B::float_max_dim(B::float_cat(vec![max.clone(), block_max], 3), 3)
                }
            };
            // A query with no allowed key so far keeps a finite maximum, so that
            // `exp(-inf - max)` is 0 rather than NaN.
            let new_max = B::float_clamp_min(new_max, f32::MIN.into());
            let probabilities = B::float_exp(B::float_sub(scores, new_max.clone()));
            let block_sum = B::float_sum_dim(probabilities.clone(), 3);
            let weighted = B::float_reshape(
                B::float_matmul(
                    B::float_reshape(probabilities, geometry.grouped(q_len, k_len)),
                    value_block,
                ),
                geometry.per_head(q_len, geometry.value_dim),
            );
            running = Some(match running {
                None => (new_max, block_sum, weighted),
                Some((max, sum, accumulated)) => {
                    let correction = B::float_exp(B::float_sub(max, new_max.clone()));
                    (
                        new_max,
                        B::float_add(B::float_mul(sum, correction.clone()), block_sum),
                        B::float_add(B::float_mul(accumulated, correction), weighted),
                    )
                }
            });
        }
        let (max, sum, accumulated) = match running {
            Some(running) => running,
            // Every key is in the future of every query of this block (more queries than
            // keys under a causal mask).
            None => empty_rows::<B>(inputs, &geometry, q_len),
        };
        // The sum is at least 1 wherever a key is allowed (the maximum contributes exp(0)), and
        // 0 with a zero accumulator where none is, so clamping to 1 zeros exactly those rows.
        let sum = B::float_clamp_min(sum, 1.0.into());
        outputs.push(B::float_div(accumulated, sum.clone()));
        log_sum_exps.push(B::float_add(max, B::float_log(sum)));
    }
    FlashForward {
        output: B::float_cat(outputs, 2),
        log_sum_exp: B::float_cat(log_sum_exps, 2),
    }
}

/// Maximum `f32::MIN`, sum 0 and accumulator 0 for `q_len` queries that see no key.
fn empty_rows<B: Backend>(
    inputs: &FlashInputs<B>,
    geometry: &Geometry,
    q_len: usize,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let device = inputs.query.device();
    let dtype = inputs.query.dtype().into();
    let zeros = |cols| B::float_zeros(geometry.per_head(q_len, cols), &device, dtype);
    let max = B::float_full(geometry.per_head(q_len, 1), f32::MIN.into(), &device, dtype);
    (max, zeros(1), zeros(geometry.value_dim))
}

fn flash_backward<B: Backend>(state: &FlashState<B>, output_grad: FloatTensor<B>) -> FlashGrads<B> {
    let inputs = &state.inputs;
    let geometry = Geometry::of(inputs);
    let params = inputs.params;
    // D_i = Σ_d dO_id · O_id = Σ_j P_ij dP_ij, the softmax Jacobian's row term.
    let row_dot = B::float_sum_dim(B::float_mul(output_grad.clone(), state.output.clone()), 3);
    let key_blocks: Vec<(usize, usize)> = blocks(geometry.seq_k, params.chunks.key).collect();
    let mut key_grads: Vec<Option<FloatTensor<B>>> = vec![None; key_blocks.len()];
    let mut value_grads: Vec<Option<FloatTensor<B>>> = vec![None; key_blocks.len()];
    let mut query_grads = Vec::new();
    for queries in geometry.query_blocks(params.chunks) {
        let (q_start, q_len) = queries;
        let block = ScoreBlock {
            inputs,
            geometry,
            queries,
            scaled_query: scaled_query_block(inputs, &geometry, queries),
        };
        let log_sum_exp = narrow::<B>(state.log_sum_exp.clone(), 2, q_start, q_len);
        let block_row_dot = narrow::<B>(row_dot.clone(), 2, q_start, q_len);
        let block_output_grad = B::float_reshape(
            narrow::<B>(output_grad.clone(), 2, q_start, q_len),
            geometry.grouped(q_len, geometry.value_dim),
        );
        let mut query_grad: Option<FloatTensor<B>> = None;
        for (index, keys) in geometry.key_blocks(&params, queries).enumerate() {
            let (k_start, k_len) = keys;
            let key_block = narrow::<B>(inputs.key.clone(), 2, k_start, k_len);
            let value_block = narrow::<B>(inputs.value.clone(), 2, k_start, k_len);
            let scores = block.scores(keys, &key_block);
            let probabilities = B::float_exp(B::float_sub(scores, log_sum_exp.clone()));
            let grouped_probabilities =
                B::float_reshape(probabilities.clone(), geometry.grouped(q_len, k_len));
            // dV_j += Pᵀ dO, summed over the query heads of each key/value head.
            let value_grad = B::float_matmul(
                B::float_swap_dims(grouped_probabilities, 2, 3),
                block_output_grad.clone(),
            );
            accumulate::<B>(&mut value_grads[index], value_grad);
            // dS = P ∘ (dO Vᵀ - D)
            let probability_grad = B::float_reshape(
                B::float_matmul(
                    block_output_grad.clone(),
                    B::float_swap_dims(value_block, 2, 3),
                ),
                geometry.per_head(q_len, k_len),
            );
            let score_grad = B::float_reshape(
                B::float_mul(
                    probabilities,
                    B::float_sub(probability_grad, block_row_dot.clone()),
                ),
                geometry.grouped(q_len, k_len),
            );
            // dK_j += dSᵀ (scale · Q); dQ += dS K (times scale below).
            let key_grad = B::float_matmul(
                B::float_swap_dims(score_grad.clone(), 2, 3),
                block.scaled_query.clone(),
            );
            accumulate::<B>(&mut key_grads[index], key_grad);
            accumulate::<B>(&mut query_grad, B::float_matmul(score_grad, key_block));
        }
        let query_grad = match query_grad {
            Some(grad) => B::float_reshape(
                B::float_mul_scalar(grad, params.scale.into()),
                geometry.per_head(q_len, geometry.head_dim),
            ),
            None => zeros_like::<B>(&inputs.query, geometry.per_head(q_len, geometry.head_dim)),
        };
        query_grads.push(query_grad);
    }
    let finish = |grads: Vec<Option<FloatTensor<B>>>, cols: usize| {
        let grads = grads
            .into_iter()
            .zip(&key_blocks)
            .map(|(grad, &(_, k_len))| {
                grad.unwrap_or_else(|| {
                    zeros_like::<B>(
                        &inputs.key,
                        Shape::new([geometry.batch, geometry.n_kv_heads, k_len, cols]),
                    )
                })
            })
            .collect();
        B::float_cat(grads, 2)
    };
    FlashGrads {
        query: B::float_cat(query_grads, 2),
        key: finish(key_grads, geometry.head_dim),
        value: finish(value_grads, geometry.value_dim),
    }
}

fn accumulate<B: Backend>(total: &mut Option<FloatTensor<B>>, term: FloatTensor<B>) {
    *total = Some(match total.take() {
        None => term,
        Some(total) => B::float_add(total, term),
    });
}

fn zeros_like<B: Backend>(reference: &FloatTensor<B>, shape: Shape) -> FloatTensor<B> {
    B::float_zeros(shape, &reference.device(), reference.dtype().into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::chunked_attention;
    use burn::tensor::{Distribution, TensorData, Tolerance};

    /// The native kernels read heads in place through their strides and copy other layouts
    /// first: a strided view, a negative-stride (flipped) tensor and a view at an offset give
    /// what contiguous copies of them give on the tensor-op path.
    #[test]
    fn any_input_layout_gives_the_contiguous_result() {
        #[allow(deprecated)]
        let devices = [Device::flex(), Device::ndarray()];
        for device in devices {
            if !flash_attention_supported(&device) {
                continue;
            }
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
                causal: true,
                ..ScoreMasks::default()
            };
            let options = SoftmaxOptions {
                scale: 0.3,
                default_scale: false,
                quiet: false,
            };
            let sizes = ChunkSizes { query: 2, key: 3 };
            let expected = chunked_attention(
                copy(&query),
                copy(&key),
                copy(&value),
                &masks,
                options,
                sizes,
            );
            let actual = flash_attention(query, key, value, &masks, options, sizes);
            actual
                .into_data()
                .assert_approx_eq::<f32>(&expected.into_data(), Tolerance::absolute(1e-5));
        }
    }
}
