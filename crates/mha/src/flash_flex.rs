//! The flash kernel on flex's f32 storage: the same computation as the generic body in
//! `flash.rs`, with the matmuls handed to the `gemm` crate (flex's own GEMM) on strided views
//! (no transposed copies), the scale folded into the score GEMM, a vectorised `exp`, key
//! blocks past a query block's causal horizon skipped, and every intermediate in one reused
//! per-thread buffer instead of fresh tensors.
//!
//! Parallel over `(batch, head)` in the forward and over `(batch, key/value head)` in the
//! backward, where each task owns its key/value gradients outright.

use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
use burn::backend::{DType, Flex, TensorData, TensorMetadata};
use rayon::prelude::*;

use crate::flash::{FlashForward, FlashGrads, FlashInputs, FlashState};

/// Queries per block at most (fewer when `ChunkSizes::query` asks): the score block is
/// `query block × visible keys` floats per thread. Keys are not blocked: a row's softmax is
/// then one pass, and 128 rows of 16384 keys are 8 MiB.
const QUERY_BLOCK: usize = 128;

/// A contiguous f32 copy (or view) of a flex tensor.
fn contiguous_f32(tensor: &FlexTensor) -> Option<FlexTensor> {
    (tensor.dtype() == DType::F32).then(|| tensor.to_contiguous())
}

fn slice(tensor: &FlexTensor) -> &[f32] {
    tensor.as_slice::<f32>().expect("contiguous f32")
}

fn flex_tensor(values: Vec<f32>, shape: [usize; 4]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// The additive mask of one call: `bias` plus `-inf` where `forbid`, broadcastable to
/// `[batch, n_heads, seq_q, seq_k]`, with the element strides that broadcast it (0 on an axis
/// of size 1).
struct Bias {
    tensor: FlexTensor,
    strides: [usize; 4],
}

impl Bias {
    fn of(inputs: &FlashInputs<Flex>) -> Option<Self> {
        let forbid = inputs.forbid.clone().map(|forbid| {
            let shape = forbid.shape();
            let zeros = Flex::float_zeros(shape, &inputs.query.device(), DType::F32.into());
            Flex::float_mask_fill(zeros, forbid, f32::NEG_INFINITY.into())
        });
        let tensor = match (inputs.bias.clone(), forbid) {
            (None, None) => return None,
            (Some(bias), None) => bias,
            (None, Some(forbid)) => forbid,
            (Some(bias), Some(forbid)) => Flex::float_add(bias, forbid),
        };
        let tensor = tensor.to_contiguous();
        let shape = tensor.shape();
        let mut strides = [0; 4];
        let mut stride = 1;
        for axis in (0..4).rev() {
            strides[axis] = if shape[axis] == 1 { 0 } else { stride };
            stride *= shape[axis];
        }
        Some(Self { tensor, strides })
    }

    /// Adds the bias row of query `query` of head `(batch, head)` to `scores`.
    fn add_row(&self, scores: &mut [f32], batch: usize, head: usize, query: usize) {
        let values = slice(&self.tensor);
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
    fn of(
        query: &FlexTensor,
        key: &FlexTensor,
        value: &FlexTensor,
        inputs: &FlashInputs<Flex>,
    ) -> Self {
        let (q, k, v) = (query.shape(), key.shape(), value.shape());
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

    fn kv_head(&self, head: usize) -> usize {
        head / (self.n_heads / self.n_kv_heads)
    }
}

/// `dst = beta · lhs · rhs (+ dst when accumulate)`, all row-major with the given row strides
/// (a transposed operand is a swapped pair of strides).
#[allow(clippy::too_many_arguments)]
fn gemm(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    dst_row: usize,
    accumulate: bool,
    lhs: &[f32],
    (lhs_rs, lhs_cs): (usize, usize),
    rhs: &[f32],
    (rhs_rs, rhs_cs): (usize, usize),
    beta: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    // Bounds: the last element each operand is read or written at.
    debug_assert!(dst.len() > (m - 1) * dst_row + n - 1);
    if k > 0 {
        debug_assert!(lhs.len() > (m - 1) * lhs_rs + (k - 1) * lhs_cs);
        debug_assert!(rhs.len() > (k - 1) * rhs_rs + (n - 1) * rhs_cs);
    }
    // SAFETY: every index the strides reach is inside its slice (checked above in debug
    // builds, guaranteed by the callers' shapes), and `dst` does not alias `lhs` or `rhs`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_row as isize,
            accumulate,
            lhs.as_ptr(),
            lhs_cs as isize,
            lhs_rs as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            1.0,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// A buffer that GEMMs accumulate into, filled with `-0.0` (`-0.0 + x = x`). Zeros would be
/// allocated as untouched pages that the first accumulating read maps to the shared zero page,
/// so that the write after it takes a copy-on-write fault and a TLB shootdown of every other
/// core, page by page: 15% of a training step at batch 4, 512 tokens, d_model 512 on flex.
fn accumulator(length: usize) -> Vec<f32> {
    vec![-0.0; length]
}

pub(crate) fn forward(inputs: &FlashInputs<Flex>) -> Option<FlashForward<Flex>> {
    let query = contiguous_f32(&inputs.query)?;
    let key = contiguous_f32(&inputs.key)?;
    let value = contiguous_f32(&inputs.value)?;
    if inputs
        .bias
        .as_ref()
        .is_some_and(|bias| bias.dtype() != DType::F32)
    {
        return None;
    }
    let sizes = Sizes::of(&query, &key, &value, inputs);
    let bias = Bias::of(inputs);
    let Sizes {
        batch,
        n_heads,
        seq_q,
        head_dim,
        value_dim,
        ..
    } = sizes;
    let (q, k, v) = (slice(&query), slice(&key), slice(&value));
    let mut output = vec![0.0f32; batch * n_heads * seq_q * value_dim];
    let mut log_sum_exp = vec![0.0f32; batch * n_heads * seq_q];
    output
        .par_chunks_mut(seq_q * value_dim)
        .zip(log_sum_exp.par_chunks_mut(seq_q))
        .enumerate()
        .for_each_init(Vec::new, |scores, (index, (output, log_sum_exp))| {
            let (b, h) = (index / n_heads, index % n_heads);
            let kv = b * sizes.n_kv_heads + sizes.kv_head(h);
            let head_q = &q[index * seq_q * head_dim..][..seq_q * head_dim];
            let head_k = &k[kv * sizes.seq_k * head_dim..][..sizes.seq_k * head_dim];
            let head_v = &v[kv * sizes.seq_k * value_dim..][..sizes.seq_k * value_dim];
            for q_start in (0..seq_q).step_by(sizes.query_block) {
                let q_len = sizes.query_block.min(seq_q - q_start);
                let keys = sizes.visible_keys(q_start + q_len - 1);
                let block_output = &mut output[q_start * value_dim..][..q_len * value_dim];
                if keys == 0 {
                    log_sum_exp[q_start..q_start + q_len].fill(f32::MIN);
                    continue;
                }
                scores.resize(q_len * keys, 0.0);
                // S = scale · Q Kᵀ
                gemm(
                    (q_len, keys, head_dim),
                    scores,
                    keys,
                    false,
                    &head_q[q_start * head_dim..],
                    (head_dim, 1),
                    head_k,
                    (1, head_dim),
                    sizes.scale,
                );
                let mut inverse_sums = [0.0f32; QUERY_BLOCK];
                for (row, inverse_sum) in inverse_sums.iter_mut().enumerate().take(q_len) {
                    let query_index = q_start + row;
                    let row_scores = &mut scores[row * keys..][..keys];
                    if let Some(bias) = &bias {
                        bias.add_row(row_scores, b, h, query_index);
                    }
                    let visible = sizes.visible_keys(query_index);
                    row_scores[visible..].fill(f32::NEG_INFINITY);
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
                // O = P V, then each row divided by its sum.
                gemm(
                    (q_len, value_dim, keys),
                    block_output,
                    value_dim,
                    false,
                    scores,
                    (keys, 1),
                    head_v,
                    (value_dim, 1),
                    1.0,
                );
                for (row, inverse_sum) in inverse_sums.iter().enumerate().take(q_len) {
                    block_output[row * value_dim..][..value_dim]
                        .iter_mut()
                        .for_each(|x| *x *= inverse_sum);
                }
            }
        });
    Some(FlashForward {
        output: flex_tensor(output, [batch, n_heads, seq_q, value_dim]),
        log_sum_exp: flex_tensor(log_sum_exp, [batch, n_heads, seq_q, 1]),
    })
}

pub(crate) fn backward(
    state: &FlashState<Flex>,
    output_grad: &FlexTensor,
) -> Option<FlashGrads<Flex>> {
    let inputs = &state.inputs;
    let query = contiguous_f32(&inputs.query)?;
    let key = contiguous_f32(&inputs.key)?;
    let value = contiguous_f32(&inputs.value)?;
    let output = contiguous_f32(&state.output)?;
    let log_sum_exp = contiguous_f32(&state.log_sum_exp)?;
    let output_grad = contiguous_f32(output_grad)?;
    if inputs
        .bias
        .as_ref()
        .is_some_and(|bias| bias.dtype() != DType::F32)
    {
        return None;
    }
    let sizes = Sizes::of(&query, &key, &value, inputs);
    let bias = Bias::of(inputs);
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
    let (q, k, v) = (slice(&query), slice(&key), slice(&value));
    let (o, lse, d_o) = (slice(&output), slice(&log_sum_exp), slice(&output_grad));
    let mut query_grad = vec![0.0f32; batch * n_heads * seq_q * head_dim];
    let mut key_grad = accumulator(batch * n_kv_heads * seq_k * head_dim);
    let mut value_grad = accumulator(batch * n_kv_heads * seq_k * value_dim);
    query_grad
        .par_chunks_mut(groups * seq_q * head_dim)
        .zip(key_grad.par_chunks_mut(seq_k * head_dim))
        .zip(value_grad.par_chunks_mut(seq_k * value_dim))
        .enumerate()
        .for_each_init(
            || (Vec::new(), Vec::new()),
            |(probabilities, score_grads), (kv, ((query_grad, key_grad), value_grad))| {
                let b = kv / n_kv_heads;
                let head_k = &k[kv * seq_k * head_dim..][..seq_k * head_dim];
                let head_v = &v[kv * seq_k * value_dim..][..seq_k * value_dim];
                for group_head in 0..groups {
                    let h = kv % n_kv_heads * groups + group_head;
                    let index = b * n_heads + h;
                    let head_q = &q[index * seq_q * head_dim..][..seq_q * head_dim];
                    let head_o = &o[index * seq_q * value_dim..][..seq_q * value_dim];
                    let head_d_o = &d_o[index * seq_q * value_dim..][..seq_q * value_dim];
                    let head_lse = &lse[index * seq_q..][..seq_q];
                    let head_query_grad =
                        &mut query_grad[group_head * seq_q * head_dim..][..seq_q * head_dim];
                    for q_start in (0..seq_q).step_by(sizes.query_block) {
                        let q_len = sizes.query_block.min(seq_q - q_start);
                        let keys = sizes.visible_keys(q_start + q_len - 1);
                        if keys == 0 {
                            continue;
                        }
                        let block_q = &head_q[q_start * head_dim..];
                        let block_d_o = &head_d_o[q_start * value_dim..];
                        probabilities.resize(q_len * keys, 0.0);
                        score_grads.resize(q_len * keys, 0.0);
                        // P = exp(scale · Q Kᵀ + bias - lse)
                        gemm(
                            (q_len, keys, head_dim),
                            probabilities,
                            keys,
                            false,
                            block_q,
                            (head_dim, 1),
                            head_k,
                            (1, head_dim),
                            sizes.scale,
                        );
                        for row in 0..q_len {
                            let query_index = q_start + row;
                            let row_p = &mut probabilities[row * keys..][..keys];
                            if let Some(bias) = &bias {
                                bias.add_row(row_p, b, h, query_index);
                            }
                            row_p[sizes.visible_keys(query_index)..].fill(f32::NEG_INFINITY);
                            crate::simd::exp_shifted(row_p, head_lse[query_index]);
                        }
                        // dV += Pᵀ dO
                        gemm(
                            (keys, value_dim, q_len),
                            value_grad,
                            value_dim,
                            true,
                            probabilities,
                            (1, keys),
                            block_d_o,
                            (value_dim, 1),
                            1.0,
                        );
                        // dP = dO Vᵀ
                        gemm(
                            (q_len, keys, value_dim),
                            score_grads,
                            keys,
                            false,
                            block_d_o,
                            (value_dim, 1),
                            head_v,
                            (1, value_dim),
                            1.0,
                        );
                        // dS = P ∘ (dP - rowsum(dO ∘ O))
                        for row in 0..q_len {
                            let query_index = q_start + row;
                            let row_dot = crate::simd::dot(
                                &head_d_o[query_index * value_dim..][..value_dim],
                                &head_o[query_index * value_dim..][..value_dim],
                            );
                            crate::simd::softmax_grad(
                                &mut score_grads[row * keys..][..keys],
                                &probabilities[row * keys..][..keys],
                                row_dot,
                            );
                        }
                        // dQ = scale · dS K
                        gemm(
                            (q_len, head_dim, keys),
                            &mut head_query_grad[q_start * head_dim..],
                            head_dim,
                            false,
                            score_grads,
                            (keys, 1),
                            head_k,
                            (head_dim, 1),
                            sizes.scale,
                        );
                        // dK += scale · dSᵀ Q
                        gemm(
                            (keys, head_dim, q_len),
                            key_grad,
                            head_dim,
                            true,
                            score_grads,
                            (1, keys),
                            block_q,
                            (head_dim, 1),
                            sizes.scale,
                        );
                    }
                }
            },
        );
    // Query heads were processed grouped by key/value head, which is their natural order
    // (head h belongs to key/value head h / groups), so `query_grad` is already
    // `[batch, n_heads, seq_q, head_dim]`.
    Some(FlashGrads {
        query: flex_tensor(query_grad, [batch, n_heads, seq_q, head_dim]),
        key: flex_tensor(key_grad, [batch, n_kv_heads, seq_k, head_dim]),
        value: flex_tensor(value_grad, [batch, n_kv_heads, seq_k, value_dim]),
    })
}
