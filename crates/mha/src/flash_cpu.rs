//! The flash kernel on the f32 storage of the CPU backends (flex, ndarray): the same
//! computation as the generic body in `flash.rs`, with the matmuls handed to the `gemm` crate
//! (flex's own GEMM) on strided views (no transposed or head-split copies), the scale folded
//! into the score GEMM, a vectorised `exp`, key blocks past a query block's causal horizon
//! skipped, results written sequence-major (the layout the head merge reads without a copy),
//! and every intermediate in one reused per-thread buffer instead of fresh tensors.
//!
//! Parallel over `(batch, head)` in the forward and over `(batch, key/value head)` in the
//! backward, where each task owns its key/value gradients outright.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, DType, TensorData, TensorMetadata};
use rayon::prelude::*;

use crate::flash::{FlashForward, FlashGrads, FlashInputs, FlashState};

/// A CPU backend whose float tensors this kernel reads and writes in place.
pub(crate) trait CpuStorage: Backend {
    /// `tensor` itself, or a copy in a layout [`CpuStorage::strided`] reads, for f32.
    fn readable(tensor: &FloatTensor<Self>) -> Option<FloatTensor<Self>>;

    /// The f32 elements from the tensor's first one on, and its four strides, if all are
    /// non-negative and the last is 1.
    fn strided(tensor: &FloatTensor<Self>) -> Option<(&[f32], [usize; 4])>;

    /// A tensor of logical shape `[batch, heads, seq, dim]` over `values` laid out
    /// `[batch, seq, heads, dim]`.
    fn sequence_major(values: Vec<f32>, shape: [usize; 4]) -> FloatTensor<Self>;
}

#[cfg(feature = "flex")]
impl CpuStorage for burn::backend::Flex {
    fn readable(tensor: &FloatTensor<Self>) -> Option<FloatTensor<Self>> {
        if tensor.dtype() != DType::F32 {
            return None;
        }
        Some(match Self::strided(tensor) {
            Some(_) => tensor.clone(),
            None => tensor.to_contiguous(),
        })
    }

    fn strided(tensor: &FloatTensor<Self>) -> Option<(&[f32], [usize; 4])> {
        let layout = tensor.layout();
        let strides = layout.strides();
        if strides.len() != 4 || strides[3] != 1 || strides.iter().any(|&s| s < 0) {
            return None;
        }
        let values = &tensor.storage::<f32>()[layout.start_offset()..];
        Some((values, [0, 1, 2, 3].map(|axis| strides[axis] as usize)))
    }

    fn sequence_major(values: Vec<f32>, shape: [usize; 4]) -> FloatTensor<Self> {
        use burn::backend::flex::{FlexTensor, Layout};
        let [_, heads, seq, dim] = shape;
        let strides = [seq * heads * dim, dim, heads * dim, 1].map(|s| s as isize);
        FlexTensor::new(
            burn::backend::Bytes::from_elems(values),
            Layout::new(burn::backend::Shape::new(shape), strides.to_vec(), 0),
            DType::F32,
        )
    }
}

#[cfg(feature = "ndarray")]
impl CpuStorage for burn::backend::NdArray {
    fn readable(tensor: &FloatTensor<Self>) -> Option<FloatTensor<Self>> {
        use burn::backend::ndarray::NdArrayTensor;
        let NdArrayTensor::F32(storage) = tensor else {
            return None;
        };
        Some(match Self::strided(tensor) {
            Some(_) => tensor.clone(),
            None => NdArrayTensor::from(
                storage
                    .view()
                    .as_standard_layout()
                    .into_owned()
                    .into_shared(),
            ),
        })
    }

    fn strided(tensor: &FloatTensor<Self>) -> Option<(&[f32], [usize; 4])> {
        let burn::backend::ndarray::NdArrayTensor::F32(storage) = tensor else {
            return None;
        };
        let view = storage.view();
        let (shape, strides) = (view.shape(), view.strides());
        if strides.len() != 4 || strides[3] != 1 || strides.iter().any(|&s| s < 0) {
            return None;
        }
        let extent = 1
            + (0..4)
                .map(|axis| shape[axis].saturating_sub(1) * strides[axis] as usize)
                .sum::<usize>();
        // SAFETY: the view's elements lie in `extent` elements from its first one (non-negative
        // strides), all inside `storage`, which the returned slice borrows.
        let values = unsafe { std::slice::from_raw_parts(view.as_ptr(), extent) };
        Some((values, [0, 1, 2, 3].map(|axis| strides[axis] as usize)))
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
}

/// Queries per block at most (fewer when `ChunkSizes::query` asks): the score block is
/// `query block × visible keys` floats per thread. Keys are not blocked: a row's softmax is
/// then one pass, and 128 rows of 16384 keys are 8 MiB.
const QUERY_BLOCK: usize = 128;

fn from_values<B: Backend>(
    values: Vec<f32>,
    shape: [usize; 4],
    device: &B::Device,
) -> FloatTensor<B> {
    B::float_from_data(TensorData::new(values, shape), device)
}

/// A `[batch, heads, seq, dim]` f32 tensor read in place through its strides: the heads that
/// `Linear` + split produce (`[batch, seq, heads, dim]` memory) need no copy.
struct View<'a> {
    values: &'a [f32],
    strides: [usize; 4],
}

impl<'a> View<'a> {
    fn of<B: CpuStorage>(readable: &'a FloatTensor<B>) -> Option<Self> {
        let (values, strides) = B::strided(readable)?;
        Some(Self { values, strides })
    }

    /// Head `(batch, head)` as a `[seq, dim]` matrix.
    fn matrix(&self, batch: usize, head: usize) -> Matrix {
        let start = batch * self.strides[0] + head * self.strides[1];
        Matrix {
            pointer: self.values[start..].as_ptr(),
            row_stride: self.strides[2] as isize,
            column_stride: 1,
        }
    }

    /// Row `row` of head `(batch, head)`, `dim` long.
    fn row(&self, batch: usize, head: usize, row: usize, dim: usize) -> &[f32] {
        let start = batch * self.strides[0] + head * self.strides[1] + row * self.strides[2];
        &self.values[start..start + dim]
    }
}

/// A `[batch, heads, seq, dim]` result stored sequence-major (`[batch, seq, heads, dim]`
/// memory), the layout the head merge and `Linear`'s backward read without a copy. Each task
/// writes its own heads through [`SequenceMajor::matrix`].
struct SequenceMajor {
    values: Vec<f32>,
    shape: [usize; 4],
}

impl SequenceMajor {
    fn new([batch, heads, seq, dim]: [usize; 4], fill: f32) -> Self {
        Self {
            values: vec![fill; batch * heads * seq * dim],
            shape: [batch, heads, seq, dim],
        }
    }

    fn pointer(&mut self) -> SharedPointer {
        SharedPointer(self.values.as_mut_ptr())
    }

    fn into_tensor<B: CpuStorage>(self) -> FloatTensor<B> {
        B::sequence_major(self.values, self.shape)
    }
}

/// A pointer into a [`SequenceMajor`] buffer shared by the tasks of one call, each of which
/// writes only its own heads' elements.
#[derive(Clone, Copy)]
struct SharedPointer(*mut f32);

// SAFETY: the tasks write disjoint elements (their own heads), and the buffer outlives them.
unsafe impl Send for SharedPointer {}
unsafe impl Sync for SharedPointer {}

impl SharedPointer {
    /// Elements `start..start + length`.
    ///
    /// # Safety
    ///
    /// They lie in the buffer, and no other task touches them meanwhile.
    unsafe fn slice<'a>(self, start: usize, length: usize) -> &'a mut [f32] {
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), length) }
    }

    /// Head `(batch, head)` of a `[batch, seq, heads, dim]` buffer as a `[seq, dim]` matrix.
    fn matrix(self, [_, heads, seq, dim]: [usize; 4], batch: usize, head: usize) -> MatrixMut {
        MatrixMut {
            // SAFETY: in bounds of the buffer of that shape.
            pointer: unsafe { self.0.add((batch * seq * heads + head) * dim) },
            row_stride: (heads * dim) as isize,
        }
    }
}

/// A read-only strided matrix: element `(i, j)` at `pointer + i · row_stride + j ·
/// column_stride`.
#[derive(Clone, Copy)]
struct Matrix {
    pointer: *const f32,
    row_stride: isize,
    column_stride: isize,
}

impl Matrix {
    fn from_slice(values: &[f32], row_stride: usize) -> Self {
        Self {
            pointer: values.as_ptr(),
            row_stride: row_stride as isize,
            column_stride: 1,
        }
    }

    fn transposed(self) -> Self {
        Self {
            pointer: self.pointer,
            row_stride: self.column_stride,
            column_stride: self.row_stride,
        }
    }

    /// The matrix from row `row` on.
    fn rows_from(self, row: usize) -> Self {
        Self {
            // SAFETY: callers stay inside the matrix they took the rows of.
            pointer: unsafe { self.pointer.offset(row as isize * self.row_stride) },
            ..self
        }
    }
}

/// A writable row-major matrix with unit column stride.
#[derive(Clone, Copy)]
struct MatrixMut {
    pointer: *mut f32,
    row_stride: isize,
}

impl MatrixMut {
    fn from_slice(values: &mut [f32], row_stride: usize) -> Self {
        Self {
            pointer: values.as_mut_ptr(),
            row_stride: row_stride as isize,
        }
    }

    fn rows_from(self, row: usize) -> Self {
        Self {
            // SAFETY: as `Matrix::rows_from`.
            pointer: unsafe { self.pointer.offset(row as isize * self.row_stride) },
            ..self
        }
    }

    /// Row `row`, `length` long.
    ///
    /// # Safety
    ///
    /// The row must lie in the buffer and no other task may touch it meanwhile.
    unsafe fn row<'a>(self, row: usize, length: usize) -> &'a mut [f32] {
        unsafe {
            std::slice::from_raw_parts_mut(
                self.pointer.offset(row as isize * self.row_stride),
                length,
            )
        }
    }
}

/// The additive mask of one call, `bias` plus `-inf` where `forbid`, broadcastable to
/// `[batch, n_heads, seq_q, seq_k]`, in a layout [`BiasView`] reads; `None` without either.
fn combined_bias<B: CpuStorage>(inputs: &FlashInputs<B>) -> Option<FloatTensor<B>> {
    let forbid = inputs.forbid.clone().map(|forbid| {
        let shape = forbid.shape();
        let zeros = B::float_zeros(shape, &inputs.query.device(), DType::F32.into());
        B::float_mask_fill(zeros, forbid, f32::NEG_INFINITY.into())
    });
    let tensor = match (inputs.bias.clone(), forbid) {
        (None, None) => return None,
        (Some(bias), None) => bias,
        (None, Some(forbid)) => forbid,
        (Some(bias), Some(forbid)) => B::float_add(bias, forbid),
    };
    Some(B::readable(&tensor).expect("an f32 bias (checked by `readable_inputs`)"))
}

/// A [`combined_bias`] read in place, with the element strides that broadcast it (0 on an
/// axis of size 1).
struct BiasView<'a> {
    values: &'a [f32],
    strides: [usize; 4],
}

impl<'a> BiasView<'a> {
    fn of<B: CpuStorage>(readable: &'a FloatTensor<B>) -> Self {
        let shape = readable.shape();
        let (values, read_strides) = B::strided(readable).expect("made readable");
        // A broadcast axis is read with stride 0, whatever its stored stride.
        let strides = [0, 1, 2, 3].map(|axis| {
            if shape[axis] == 1 {
                0
            } else {
                read_strides[axis]
            }
        });
        Self { values, strides }
    }

    /// Adds the bias row of query `query` of head `(batch, head)` to `scores`.
    fn add_row(&self, scores: &mut [f32], batch: usize, head: usize, query: usize) {
        let values = self.values;
        let [batch_stride, head_stride, query_stride, key_stride] = self.strides;
        let start = batch * batch_stride + head * head_stride + query * query_stride;
        if key_stride == 0 {
            let value = values[start];
            scores.iter_mut().for_each(|score| *score += value);
        } else {
            let row = &values[start..start + scores.len()];
            scores
                .iter_mut()
                .zip(row)
                .for_each(|(score, bias)| *score += bias);
        }
    }
}

/// Sizes of one call.
#[derive(Clone, Copy)]
struct Sizes {
    batch: usize,
    n_heads: usize,
    n_kv_heads: usize,
    seq_q: usize,
    seq_k: usize,
    head_dim: usize,
    value_dim: usize,
    scale: f32,
    causal: bool,
    query_block: usize,
}

impl Sizes {
    fn of<B: Backend>(inputs: &FlashInputs<B>) -> Self {
        let (q, k, v) = (
            inputs.query.shape(),
            inputs.key.shape(),
            inputs.value.shape(),
        );
        Self {
            batch: q[0],
            n_heads: q[1],
            n_kv_heads: k[1],
            seq_q: q[2],
            seq_k: k[2],
            head_dim: q[3],
            value_dim: v[3],
            scale: inputs.params.scale as f32,
            causal: inputs.params.causal,
            query_block: inputs.params.chunks.query.clamp(1, QUERY_BLOCK),
        }
    }

    /// Keys query `query` may see: `0..visible_keys(query)`.
    fn visible_keys(&self, query: usize) -> usize {
        if self.causal {
            (query + 1 + self.seq_k)
                .saturating_sub(self.seq_q)
                .min(self.seq_k)
        } else {
            self.seq_k
        }
    }

    /// Whether the call is worth rayon's threads: a decoding step (one query) is not.
    fn parallel(&self) -> bool {
        let work =
            self.batch * self.n_heads * self.seq_q * self.seq_k * (self.head_dim + self.value_dim);
        self.batch * self.n_heads > 1 && work >= 1 << 22
    }

    fn kv_head(&self, head: usize) -> usize {
        head / (self.n_heads / self.n_kv_heads)
    }
}

/// `scores` ← the score block of queries `q_start..q_start + q_len` of head `(b, h)` over keys
/// `0..keys`, `[q_len, keys]`: `scale · Q Kᵀ + bias`, causal-future keys at `-inf`.
fn score_block(
    scores: &mut Vec<f32>,
    sizes: &Sizes,
    bias: Option<&BiasView>,
    (b, h): (usize, usize),
    (q_start, q_len, keys): (usize, usize, usize),
    head_query: Matrix,
    head_key: Matrix,
) {
    scores.resize(q_len * keys, 0.0);
    // SAFETY: the callers' views hold these rows, and `scores` is the task's own buffer.
    unsafe {
        gemm(
            (q_len, keys, sizes.head_dim),
            MatrixMut::from_slice(scores, keys),
            false,
            head_query.rows_from(q_start),
            head_key.transposed(),
            sizes.scale,
        );
    }
    for row in 0..q_len {
        let query_index = q_start + row;
        let row_scores = &mut scores[row * keys..][..keys];
        if let Some(bias) = bias {
            bias.add_row(row_scores, b, h, query_index);
        }
        row_scores[sizes.visible_keys(query_index)..].fill(f32::NEG_INFINITY);
    }
}

/// Runs `task(scratch, index)` for every index below `count`, on rayon's threads when
/// `parallel`, each thread with its own scratch from `init`.
fn for_each_task<S: Send>(
    count: usize,
    parallel: bool,
    init: impl Fn() -> S + Sync + Send,
    task: impl Fn(&mut S, usize) + Sync + Send,
) {
    if parallel {
        (0..count).into_par_iter().for_each_init(init, task);
    } else {
        let mut scratch = init();
        (0..count).for_each(|index| task(&mut scratch, index));
    }
}

/// `dst (+)= beta · lhs · rhs` for an `m × k` by `k × n` product.
///
/// # Safety
///
/// Every element the strides reach lies in its buffer, `dst` aliases neither operand, and no
/// other task touches `dst`'s elements meanwhile.
unsafe fn gemm(
    (m, n, k): (usize, usize, usize),
    dst: MatrixMut,
    accumulate: bool,
    lhs: Matrix,
    rhs: Matrix,
    beta: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.pointer,
            1,
            dst.row_stride,
            accumulate,
            lhs.pointer,
            lhs.column_stride,
            lhs.row_stride,
            rhs.pointer,
            rhs.column_stride,
            rhs.row_stride,
            1.0,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Query, key and value in layouts [`View`] reads, or `None` for a dtype this kernel does not
/// take (the generic body runs instead).
fn readable_inputs<B: CpuStorage>(inputs: &FlashInputs<B>) -> Option<[FloatTensor<B>; 3]> {
    if inputs
        .bias
        .as_ref()
        .is_some_and(|bias| bias.dtype() != DType::F32)
    {
        return None;
    }
    Some([
        B::readable(&inputs.query)?,
        B::readable(&inputs.key)?,
        B::readable(&inputs.value)?,
    ])
}

/// Views of readable tensors.
fn views<B: CpuStorage, const N: usize>(readable: &[FloatTensor<B>; N]) -> Option<[View<'_>; N]> {
    let views = readable.each_ref().map(View::of::<B>);
    views
        .iter()
        .all(Option::is_some)
        .then(|| views.map(|view| view.expect("checked")))
}

pub(crate) fn forward<B: CpuStorage>(inputs: &FlashInputs<B>) -> Option<FlashForward<B>> {
    let readable = readable_inputs(inputs)?;
    let [query, key, value] = views::<B, 3>(&readable)?;
    let sizes = Sizes::of(inputs);
    let bias = combined_bias(inputs);
    let bias = bias.as_ref().map(BiasView::of::<B>);
    let Sizes {
        batch,
        n_heads,
        seq_q,
        value_dim,
        ..
    } = sizes;
    let mut output = SequenceMajor::new([batch, n_heads, seq_q, value_dim], 0.0);
    let output_pointer = output.pointer();
    let mut log_sum_exp = vec![0.0f32; batch * n_heads * seq_q];
    let log_sum_exp_pointer = SharedPointer(log_sum_exp.as_mut_ptr());
    for_each_task(
        batch * n_heads,
        sizes.parallel(),
        Vec::new,
        |scores: &mut Vec<f32>, index| {
            // SAFETY: task `index` alone writes these `seq_q` elements of the buffer.
            let log_sum_exp = unsafe { log_sum_exp_pointer.slice(index * seq_q, seq_q) };
            let (b, h) = (index / n_heads, index % n_heads);
            let kv_head = sizes.kv_head(h);
            let head_q = query.matrix(b, h);
            let head_k = key.matrix(b, kv_head);
            let head_v = value.matrix(b, kv_head);
            let head_output = output_pointer.matrix(output.shape, b, h);
            for q_start in (0..seq_q).step_by(sizes.query_block) {
                let q_len = sizes.query_block.min(seq_q - q_start);
                let keys = sizes.visible_keys(q_start + q_len - 1);
                if keys == 0 {
                    log_sum_exp[q_start..q_start + q_len].fill(f32::MIN);
                    continue;
                }
                score_block(
                    scores,
                    &sizes,
                    bias.as_ref(),
                    (b, h),
                    (q_start, q_len, keys),
                    head_q,
                    head_k,
                );
                let mut inverse_sums = [0.0f32; QUERY_BLOCK];
                for (row, inverse_sum) in inverse_sums.iter_mut().enumerate().take(q_len) {
                    let query_index = q_start + row;
                    let row_scores = &mut scores[row * keys..][..keys];
                    let max = crate::simd::max(row_scores);
                    if max == f32::NEG_INFINITY {
                        // No allowed key: a zero row, zero output, and a log-sum-exp that
                        // makes every recomputed probability exp(-inf) = 0.
                        row_scores.fill(0.0);
                        log_sum_exp[query_index] = f32::MIN;
                        continue;
                    }
                    let sum = crate::simd::exp_shifted(row_scores, max);
                    *inverse_sum = 1.0 / sum;
                    log_sum_exp[query_index] = max + sum.ln();
                }
                let block_output = head_output.rows_from(q_start);
                // SAFETY: as above.
                unsafe {
                    // O = P V, then each row divided by its sum.
                    gemm(
                        (q_len, value_dim, keys),
                        block_output,
                        false,
                        Matrix::from_slice(scores, keys),
                        head_v,
                        1.0,
                    );
                    for (row, inverse_sum) in inverse_sums.iter().enumerate().take(q_len) {
                        block_output
                            .row(row, value_dim)
                            .iter_mut()
                            .for_each(|x| *x *= inverse_sum);
                    }
                }
            }
        },
    );
    Some(FlashForward {
        output: output.into_tensor::<B>(),
        log_sum_exp: from_values::<B>(
            log_sum_exp,
            [batch, n_heads, seq_q, 1],
            &inputs.query.device(),
        ),
    })
}

pub(crate) fn backward<B: CpuStorage>(
    state: &FlashState<B>,
    output_grad: &FloatTensor<B>,
) -> Option<FlashGrads<B>> {
    let inputs = &state.inputs;
    let readable = readable_inputs(inputs)?;
    let [query, key, value] = views::<B, 3>(&readable)?;
    let sizes = Sizes::of(inputs);
    let readable_outputs = [B::readable(&state.output)?, B::readable(output_grad)?];
    let [output, output_grad] = views::<B, 2>(&readable_outputs)?;
    let log_sum_exp = B::readable(&state.log_sum_exp)?;
    let (lse, lse_strides) = B::strided(&log_sum_exp)?;
    let [batch_stride, head_stride, row_stride, _] = lse_strides;
    let bias = combined_bias(inputs);
    let bias = bias.as_ref().map(BiasView::of::<B>);
    let Sizes {
        batch,
        n_heads,
        n_kv_heads,
        seq_q,
        seq_k,
        head_dim,
        value_dim,
        ..
    } = sizes;
    let groups = n_heads / n_kv_heads;
    let mut query_grad = SequenceMajor::new([batch, n_heads, seq_q, head_dim], 0.0);
    // GEMMs accumulate into these, so they are filled with -0.0 (-0.0 + x = x): zeros would be
    // untouched pages that the first accumulating read maps to the shared zero page, and the
    // write after it would then take a copy-on-write fault and a TLB shootdown of every other
    // core, page by page (15% of a training step at batch 4, 512 tokens, d_model 512).
    let mut key_grad = SequenceMajor::new([batch, n_kv_heads, seq_k, head_dim], -0.0);
    let mut value_grad = SequenceMajor::new([batch, n_kv_heads, seq_k, value_dim], -0.0);
    let (query_grad_pointer, key_grad_pointer, value_grad_pointer) = (
        query_grad.pointer(),
        key_grad.pointer(),
        value_grad.pointer(),
    );
    let (query_grad_shape, key_grad_shape, value_grad_shape) =
        (query_grad.shape, key_grad.shape, value_grad.shape);
    for_each_task(
        batch * n_kv_heads,
        sizes.parallel(),
        || (Vec::new(), Vec::new()),
        |(probabilities, score_grads): &mut (Vec<f32>, Vec<f32>), kv| {
            let (b, kv_head) = (kv / n_kv_heads, kv % n_kv_heads);
            let head_k = key.matrix(b, kv_head);
            let head_v = value.matrix(b, kv_head);
            let head_key_grad = key_grad_pointer.matrix(key_grad_shape, b, kv_head);
            let head_value_grad = value_grad_pointer.matrix(value_grad_shape, b, kv_head);
            for h in kv_head * groups..(kv_head + 1) * groups {
                let head_q = query.matrix(b, h);
                let head_d_o = output_grad.matrix(b, h);
                let head_lse =
                    |row: usize| lse[b * batch_stride + h * head_stride + row * row_stride];
                let head_query_grad = query_grad_pointer.matrix(query_grad_shape, b, h);
                for q_start in (0..seq_q).step_by(sizes.query_block) {
                    let q_len = sizes.query_block.min(seq_q - q_start);
                    let keys = sizes.visible_keys(q_start + q_len - 1);
                    if keys == 0 {
                        continue;
                    }
                    let block_q = head_q.rows_from(q_start);
                    let block_d_o = head_d_o.rows_from(q_start);
                    score_grads.resize(q_len * keys, 0.0);
                    // P = exp(S - lse)
                    score_block(
                        probabilities,
                        &sizes,
                        bias.as_ref(),
                        (b, h),
                        (q_start, q_len, keys),
                        head_q,
                        head_k,
                    );
                    for row in 0..q_len {
                        let row_p = &mut probabilities[row * keys..][..keys];
                        crate::simd::exp_shifted(row_p, head_lse(q_start + row));
                    }
                    // SAFETY: the views and buffers hold these rows; this task owns key/value
                    // head (b, kv_head) and the query heads of its group.
                    // SAFETY: as above.
                    unsafe {
                        // dV += Pᵀ dO
                        gemm(
                            (keys, value_dim, q_len),
                            head_value_grad,
                            true,
                            Matrix::from_slice(probabilities, keys).transposed(),
                            block_d_o,
                            1.0,
                        );
                        // dP = dO Vᵀ
                        gemm(
                            (q_len, keys, value_dim),
                            MatrixMut::from_slice(score_grads, keys),
                            false,
                            block_d_o,
                            head_v.transposed(),
                            1.0,
                        );
                    }
                    // dS = P ∘ (dP - rowsum(dO ∘ O))
                    for row in 0..q_len {
                        let query_index = q_start + row;
                        let row_dot = crate::simd::dot(
                            output_grad.row(b, h, query_index, value_dim),
                            output.row(b, h, query_index, value_dim),
                        );
                        crate::simd::softmax_grad(
                            &mut score_grads[row * keys..][..keys],
                            &probabilities[row * keys..][..keys],
                            row_dot,
                        );
                    }
                    let score_grads = Matrix::from_slice(score_grads, keys);
                    // SAFETY: as above.
                    unsafe {
                        // dQ = scale · dS K
                        gemm(
                            (q_len, head_dim, keys),
                            head_query_grad.rows_from(q_start),
                            false,
                            score_grads,
                            head_k,
                            sizes.scale,
                        );
                        // dK += scale · dSᵀ Q
                        gemm(
                            (keys, head_dim, q_len),
                            head_key_grad,
                            true,
                            score_grads.transposed(),
                            block_q,
                            sizes.scale,
                        );
                    }
                }
            }
        },
    );
    Some(FlashGrads {
        query: query_grad.into_tensor::<B>(),
        key: key_grad.into_tensor::<B>(),
        value: value_grad.into_tensor::<B>(),
    })
}
