//! The flash op written once in backend primitives (`B::float_matmul`, …), blocked by
//! [`BlockSizes`](crate::BlockSizes): what every backend without a native kernel runs, and
//! what the native kernels fall back to for dtypes they do not take.
//!
//! Forward: per query block, an online softmax over the visible key blocks (running maximum,
//! sum of exponentials and weighted values; started from the head's sink logit when there is
//! one), then each query's maximum `m` and inverse sum. Backward (FlashAttention-2, Dao 2023,
//! Algorithm 2): `D = rowsum(dO ∘ O)`, then per query block and key block
//! `P = exp(S - m) / Σ`, `dV += Pᵀ dO`, `dS = P ∘ (dO Vᵀ - D)` (times `1 - tanh²` under a soft
//! cap), `dQ += dS K · scale`, `dK += dSᵀ Q · scale`; a sink's gradient is
//! `-Σ P_sink · D`.
//!
//! The rules of a call (causal, window, segments, ALiBi) are made for each block on the host
//! and uploaded, never for the whole score matrix.

use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{Backend, Shape, Slice, TensorData, TensorMetadata};

use super::{FlashForward, FlashGrads, FlashInputs, FlashState};
use crate::geometry::Geometry;

pub(super) fn forward<B: Backend>(inputs: &FlashInputs<B>) -> FlashForward<B> {
    let geometry = inputs.geometry();
    let (outputs, softmax_stats): (Vec<_>, Vec<_>) =
        blocks(geometry.seq_q, inputs.params.blocks.query)
            .map(|queries| forward_query_block(&ScoreBlock::new(inputs, geometry, queries)))
            .unzip();
    FlashForward {
        output: B::float_cat(outputs, 2),
        softmax_stats: B::float_cat(softmax_stats, 2),
    }
}

/// The output and the attention weights `[batch, n_heads, seq_q, seq_k]`: the forward, then
/// every score block again, normalised by the final statistics (`P = exp(S - m) / Σ`, zero for
/// hidden keys).
pub(super) fn forward_with_weights<B: Backend>(
    inputs: &FlashInputs<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let FlashForward {
        output,
        softmax_stats,
    } = forward(inputs);
    let geometry = inputs.geometry();
    let rows = blocks(geometry.seq_q, inputs.params.blocks.query)
        .map(|queries| {
            let block = ScoreBlock::new(inputs, geometry, queries);
            let stats = narrow_float::<B>(softmax_stats.clone(), 2, queries.0, queries.1);
            let max = narrow_float::<B>(stats.clone(), 3, 0, 1);
            let inverse_sum = narrow_float::<B>(stats, 3, 1, 1);
            let columns = blocks(geometry.seq_k, inputs.params.blocks.key)
                .map(|keys| {
                    let key_block = narrow_float::<B>(inputs.key.clone(), 2, keys.0, keys.1);
                    let (scores, _) = block.scores(keys, &key_block);
                    B::float_mul(
                        B::float_exp(B::float_sub(scores, max.clone())),
                        inverse_sum.clone(),
                    )
                })
                .collect();
            B::float_cat(columns, 3)
        })
        .collect();
    (output, B::float_cat(rows, 2))
}

/// The output `[batch, n_heads, q_len, value_dim]` and softmax statistics
/// `[batch, n_heads, q_len, 2]` of one query block.
fn forward_query_block<B: Backend>(block: &ScoreBlock<B>) -> (FloatTensor<B>, FloatTensor<B>) {
    let inputs = block.inputs;
    let mut softmax: Option<OnlineSoftmax<B>> = OnlineSoftmax::from_sinks(block);
    for keys in block.visible_key_blocks() {
        let (k_start, k_len) = keys;
        let key_block = narrow_float::<B>(inputs.key.clone(), 2, k_start, k_len);
        let value_block = narrow_float::<B>(inputs.value.clone(), 2, k_start, k_len);
        let (scores, _) = block.scores(keys, &key_block);
        softmax = Some(OnlineSoftmax::update(softmax, block, scores, value_block));
    }
    // No visible key block (and no sink): every key is hidden from every query of this block
    // (more queries than keys under a causal mask, say).
    softmax
        .unwrap_or_else(|| OnlineSoftmax::empty(block))
        .finish()
}

/// The running state of a query block's softmax over the key blocks seen so far.
struct OnlineSoftmax<B: Backend> {
    /// `[batch, n_heads, q_len, 1]`; finite even where no key was allowed yet.
    max: FloatTensor<B>,
    /// `Σ exp(score - max)`, `[batch, n_heads, q_len, 1]`.
    sum: FloatTensor<B>,
    /// `Σ exp(score - max) · value`, `[batch, n_heads, q_len, value_dim]`.
    accumulated: FloatTensor<B>,
}

impl<B: Backend> OnlineSoftmax<B> {
    /// The softmax of the head's sink logit alone (one more logit with no value), or `None`
    /// without sinks.
    fn from_sinks(block: &ScoreBlock<B>) -> Option<Self> {
        let sinks = block.inputs.sinks.clone()?;
        let (_, q_len) = block.queries;
        let geometry = &block.geometry;
        let query = &block.inputs.query;
        let (device, dtype) = (query.device(), query.dtype().into());
        let per_query = per_head(geometry, q_len, 1);
        Some(Self {
            max: B::float_expand(
                B::float_reshape(sinks, Shape::new([1, geometry.n_heads, 1, 1])),
                per_query.clone(),
            ),
            sum: B::float_ones(per_query, &device, dtype),
            accumulated: B::float_zeros(
                per_head(geometry, q_len, geometry.value_dim),
                &device,
                dtype,
            ),
        })
    }

    fn update(
        previous: Option<Self>,
        block: &ScoreBlock<B>,
        scores: FloatTensor<B>,
        value_block: FloatTensor<B>,
    ) -> Self {
        let geometry = &block.geometry;
        let (_, q_len) = block.queries;
        let k_len = scores.shape()[3];
        let block_max = B::float_max_dim(scores.clone(), 3);
        let max = match &previous {
            None => block_max,
            Some(previous) => {
                B::float_max_dim(B::float_cat(vec![previous.max.clone(), block_max], 3), 3)
            }
        };
        // A query with no allowed key so far keeps a finite maximum, so that
        // `exp(-inf - max)` is 0 rather than NaN.
        let max = B::float_clamp_min(max, lowest_finite::<B>(&scores).into());
        let probabilities = B::float_exp(B::float_sub(scores, max.clone()));
        let sum = B::float_sum_dim(probabilities.clone(), 3);
        let weighted = B::float_reshape(
            B::float_matmul(
                B::float_reshape(probabilities, grouped(geometry, q_len, k_len)),
                value_block,
            ),
            per_head(geometry, q_len, geometry.value_dim),
        );
        match previous {
            None => Self {
                max,
                sum,
                accumulated: weighted,
            },
            Some(previous) => {
                let correction = B::float_exp(B::float_sub(previous.max, max.clone()));
                Self {
                    max,
                    sum: B::float_add(B::float_mul(previous.sum, correction.clone()), sum),
                    accumulated: B::float_add(
                        B::float_mul(previous.accumulated, correction),
                        weighted,
                    ),
                }
            }
        }
    }

    /// The lowest finite maximum, sum 0 and accumulator 0 for queries that see no key.
    fn empty(block: &ScoreBlock<B>) -> Self {
        let (_, q_len) = block.queries;
        let geometry = &block.geometry;
        let query = &block.inputs.query;
        let (device, dtype) = (query.device(), query.dtype().into());
        Self {
            max: B::float_full(
                per_head(geometry, q_len, 1),
                lowest_finite::<B>(query).into(),
                &device,
                dtype,
            ),
            sum: B::float_zeros(per_head(geometry, q_len, 1), &device, dtype),
            accumulated: B::float_zeros(
                per_head(geometry, q_len, geometry.value_dim),
                &device,
                dtype,
            ),
        }
    }

    /// The block's output and softmax statistics (maximum, inverse sum).
    fn finish(self) -> (FloatTensor<B>, FloatTensor<B>) {
        // The sum is at least 1 wherever a key is allowed (the maximum contributes exp(0)), and
        // 0 with a zero accumulator where none is, so clamping to 1 zeros exactly those rows
        // (their recomputed probabilities are exp(-inf - max) = 0 whatever the inverse sum).
        let sum = B::float_clamp_min(self.sum, 1.0.into());
        let output = B::float_div(self.accumulated, sum.clone());
        let inverse_sum = B::float_recip(sum);
        (output, B::float_cat(vec![self.max, inverse_sum], 3))
    }
}

pub(super) fn backward<B: Backend>(
    state: &FlashState<B>,
    output_grad: FloatTensor<B>,
) -> FlashGrads<B> {
    let inputs = &state.inputs;
    let geometry = inputs.geometry();
    state.check_output_grad(&output_grad);
    // D_i = Σ_d dO_id · O_id = Σ_j P_ij dP_ij, the softmax Jacobian's row term.
    let row_dot = B::float_sum_dim(B::float_mul(output_grad.clone(), state.output.clone()), 3);
    let key_blocks: Vec<(usize, usize)> =
        blocks(geometry.seq_k, inputs.params.blocks.key).collect();
    let mut key_grads: Vec<Option<FloatTensor<B>>> = vec![None; key_blocks.len()];
    let mut value_grads: Vec<Option<FloatTensor<B>>> = vec![None; key_blocks.len()];
    let query_grads = blocks(geometry.seq_q, inputs.params.blocks.query)
        .map(|queries| {
            let block = ScoreBlock::new(inputs, geometry, queries);
            let row_terms = RowTerms::of_block(state, &output_grad, &row_dot, &block);
            let mut query_grad = None;
            for keys in block.visible_key_blocks() {
                let index = keys.0 / inputs.params.blocks.key;
                let grads = block_grads(&block, &row_terms, keys);
                accumulate::<B>(&mut query_grad, grads.query);
                accumulate::<B>(&mut key_grads[index], grads.key);
                accumulate::<B>(&mut value_grads[index], grads.value);
            }
            let (_, q_len) = queries;
            let shape = per_head(&geometry, q_len, geometry.head_dim);
            match query_grad {
                Some(grad) => {
                    B::float_reshape(B::float_mul_scalar(grad, inputs.params.scale.into()), shape)
                }
                None => zeros_like::<B>(&inputs.query, shape),
            }
        })
        .collect();
    let concat_key_blocks = |grads: Vec<Option<FloatTensor<B>>>, cols: usize| {
        let grads = grads
            .into_iter()
            .zip(&key_blocks)
            .map(|(grad, &(_, k_len))| {
                grad.unwrap_or_else(|| {
                    let shape = Shape::new([geometry.batch, geometry.n_kv_heads, k_len, cols]);
                    zeros_like::<B>(&inputs.key, shape)
                })
            })
            .collect();
        B::float_cat(grads, 2)
    };
    FlashGrads {
        query: B::float_cat(query_grads, 2),
        key: concat_key_blocks(key_grads, geometry.head_dim),
        value: concat_key_blocks(value_grads, geometry.value_dim),
        sinks: sinks_grad(state, row_dot),
    }
}

/// `d sink_h = -Σ_{b,i} P_sink · D`: a sink's probability `exp(sink - m) / Σ` against each
/// row's `D = rowsum(dO ∘ O)` (the sink has no value, so `dP_sink = 0`); `[n_heads]`.
fn sinks_grad<B: Backend>(
    state: &FlashState<B>,
    row_dot: FloatTensor<B>,
) -> Option<FloatTensor<B>> {
    let sinks = state.inputs.sinks.clone()?;
    let stats = state.softmax_stats.clone();
    let [batch, n_heads, seq_q, _] = super::inputs::dims(&stats.shape());
    let per_query = Shape::new([batch, n_heads, seq_q, 1]);
    let max = narrow_float::<B>(stats.clone(), 3, 0, 1);
    let inverse_sum = narrow_float::<B>(stats, 3, 1, 1);
    let sinks = B::float_expand(
        B::float_reshape(sinks, Shape::new([1, n_heads, 1, 1])),
        per_query,
    );
    let sink_probability = B::float_mul(B::float_exp(B::float_sub(sinks, max)), inverse_sum);
    let terms = B::float_neg(B::float_mul(sink_probability, row_dot));
    let per_head = B::float_sum_dim(B::float_sum_dim(terms, 2), 0);
    Some(B::float_reshape(per_head, Shape::new([n_heads])))
}

/// What the backward of one query block reads per query: its softmax statistics, `D`, and the
/// grouped output gradient.
struct RowTerms<B: Backend> {
    /// `[batch, n_heads, q_len, 1]`
    max: FloatTensor<B>,
    /// `[batch, n_heads, q_len, 1]`
    inverse_sum: FloatTensor<B>,
    /// `[batch, n_heads, q_len, 1]`
    row_dot: FloatTensor<B>,
    /// `[batch, n_kv_heads, groups · q_len, value_dim]`
    output_grad: FloatTensor<B>,
}

impl<B: Backend> RowTerms<B> {
    fn of_block(
        state: &FlashState<B>,
        output_grad: &FloatTensor<B>,
        row_dot: &FloatTensor<B>,
        block: &ScoreBlock<B>,
    ) -> Self {
        let (q_start, q_len) = block.queries;
        let rows = |tensor: &FloatTensor<B>| narrow_float::<B>(tensor.clone(), 2, q_start, q_len);
        let stats = rows(&state.softmax_stats);
        Self {
            max: narrow_float::<B>(stats.clone(), 3, 0, 1),
            inverse_sum: narrow_float::<B>(stats, 3, 1, 1),
            row_dot: rows(row_dot),
            output_grad: B::float_reshape(
                rows(output_grad),
                grouped(&block.geometry, q_len, block.geometry.value_dim),
            ),
        }
    }
}

/// One query block × key block's share of the gradients: `dQ` (before the scale)
/// `[batch, n_kv_heads, groups · q_len, head_dim]`, `dK` and `dV`
/// `[batch, n_kv_heads, k_len, head_dim | value_dim]`.
struct BlockGrads<B: Backend> {
    query: FloatTensor<B>,
    key: FloatTensor<B>,
    value: FloatTensor<B>,
}

fn block_grads<B: Backend>(
    block: &ScoreBlock<B>,
    rows: &RowTerms<B>,
    keys: (usize, usize),
) -> BlockGrads<B> {
    let (k_start, k_len) = keys;
    let inputs = block.inputs;
    let geometry = &block.geometry;
    let (_, q_len) = block.queries;
    let key_block = narrow_float::<B>(inputs.key.clone(), 2, k_start, k_len);
    let value_block = narrow_float::<B>(inputs.value.clone(), 2, k_start, k_len);
    let (scores, cap_derivative) = block.scores((k_start, k_len), &key_block);
    let probabilities = B::float_mul(
        B::float_exp(B::float_sub(scores, rows.max.clone())),
        rows.inverse_sum.clone(),
    );
    let grouped_probabilities =
        B::float_reshape(probabilities.clone(), grouped(geometry, q_len, k_len));
    // dV = Pᵀ dO, summed over the query heads of each key/value head by the grouping.
    let value = B::float_matmul(
        B::float_swap_dims(grouped_probabilities, 2, 3),
        rows.output_grad.clone(),
    );
    // dS = P ∘ (dO Vᵀ - D)
    let probability_grad = B::float_reshape(
        B::float_matmul(
            rows.output_grad.clone(),
            B::float_swap_dims(value_block, 2, 3),
        ),
        per_head(geometry, q_len, k_len),
    );
    let mut score_grad = B::float_mul(
        probabilities,
        B::float_sub(probability_grad, rows.row_dot.clone()),
    );
    if let Some(derivative) = cap_derivative {
        score_grad = B::float_mul(score_grad, derivative);
    }
    let score_grad = B::float_reshape(score_grad, grouped(geometry, q_len, k_len));
    // dK = dSᵀ (scale · Q); dQ = dS K (the caller multiplies by the scale).
    let key = B::float_matmul(
        B::float_swap_dims(score_grad.clone(), 2, 3),
        block.scaled_query.clone(),
    );
    BlockGrads {
        query: B::float_matmul(score_grad, key_block),
        key,
        value,
    }
}

/// One query block's scores against any key block: `q kᵀ · scale + bias`, forbidden and
/// causal-future keys at `-inf`, `[batch, n_heads, q_len, k_len]`.
struct ScoreBlock<'a, B: Backend> {
    inputs: &'a FlashInputs<B>,
    geometry: Geometry,
    /// `(start, length)` of the query block.
    queries: (usize, usize),
    /// This query block, scaled and grouped: `[batch, n_kv_heads, groups · q_len, head_dim]`.
    scaled_query: FloatTensor<B>,
}

impl<'a, B: Backend> ScoreBlock<'a, B> {
    fn new(inputs: &'a FlashInputs<B>, geometry: Geometry, queries: (usize, usize)) -> Self {
        let (start, length) = queries;
        let block = narrow_float::<B>(inputs.query.clone(), 2, start, length);
        let scaled = B::float_mul_scalar(block, inputs.params.scale.into());
        Self {
            inputs,
            geometry,
            queries,
            scaled_query: B::float_reshape(scaled, grouped(&geometry, length, geometry.head_dim)),
        }
    }

    /// Key blocks `(start, length)` that some query of this block may see.
    fn visible_key_blocks(&self) -> impl Iterator<Item = (usize, usize)> + use<'a, B> {
        let (q_start, q_len) = self.queries;
        let rules = &self.inputs.params.rules;
        let visible = (0..self.geometry.batch)
            .map(|b| rules.key_range(b, q_start..q_start + q_len, self.geometry.seq_k))
            .filter(|range| !range.is_empty())
            .reduce(|a, b| a.start.min(b.start)..a.end.max(b.end))
            .unwrap_or(0..0);
        blocks(self.geometry.seq_k, self.inputs.params.blocks.key).filter(
            move |&(k_start, k_len)| k_start < visible.end && k_start + k_len > visible.start,
        )
    }

    /// The scores of this query block against keys `keys`: capped, biased, hidden keys at
    /// `-inf`, `[batch, n_heads, q_len, k_len]`; and under a soft cap its derivative
    /// `1 - tanh²`, which the backward multiplies `dS` by.
    fn scores(
        &self,
        keys: (usize, usize),
        key_block: &FloatTensor<B>,
    ) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
        let (q_start, q_len) = self.queries;
        let (k_start, k_len) = keys;
        let shape = per_head(&self.geometry, q_len, k_len);
        let transposed = B::float_swap_dims(key_block.clone(), 2, 3);
        let mut scores = B::float_reshape(
            B::float_matmul(self.scaled_query.clone(), transposed),
            shape.clone(),
        );
        let mut cap_derivative = None;
        if let Some(cap) = self.inputs.params.softcap {
            let tanh = B::float_tanh(B::float_div_scalar(scores, cap.into()));
            let squared = B::float_mul(tanh.clone(), tanh.clone());
            cap_derivative = Some(B::float_add_scalar(B::float_neg(squared), 1.0.into()));
            scores = B::float_mul_scalar(tanh, cap.into());
        }
        if let Some(bias) = &self.inputs.bias {
            let bias = narrow_float::<B>(
                narrow_float::<B>(bias.clone(), 2, q_start, q_len),
                3,
                k_start,
                k_len,
            );
            scores = B::float_add(scores, B::float_expand(bias, shape.clone()));
        }
        let device = scores.device();
        let rules = &self.inputs.params.rules;
        let (queries, keys) = (q_start..q_start + q_len, k_start..k_start + k_len);
        if let Some((values, bias_shape)) =
            rules.block_bias(self.geometry.n_heads, queries.clone(), keys.clone())
        {
            let data = TensorData::new(values, bias_shape).convert_dtype(scores.dtype());
            let alibi = B::float_from_data(data, &device);
            scores = B::float_add(scores, B::float_expand(alibi, shape.clone()));
        }
        // Masks replace the score rather than adding to it, so that a forbidden key drops out
        // whatever its score (an infinite one included).
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
        if let Some((values, forbid_shape)) = rules.block_forbid(self.geometry.batch, queries, keys)
        {
            let hidden = bool_from_flags::<B>(values, forbid_shape, &device);
            scores = B::float_mask_fill(
                scores,
                B::bool_expand(hidden, shape),
                f32::NEG_INFINITY.into(),
            );
        }
        (scores, cap_derivative)
    }
}

/// A bool tensor of `shape` from flags: made from floats by a comparison, which gives the bool
/// storage the backend uses (CubeCL backends take no bool data of Rust's own layout).
fn bool_from_flags<B: Backend>(
    flags: Vec<bool>,
    shape: [usize; 4],
    device: &B::Device,
) -> BoolTensor<B> {
    let values: Vec<f32> = flags
        .into_iter()
        .map(|flag| f32::from(u8::from(flag)))
        .collect();
    let flags = B::float_from_data(TensorData::new(values, shape), device);
    let bool_dtype = burn::backend::get_device_settings::<B>(device).bool_dtype;
    B::float_greater_elem(flags, 0.5.into(), bool_dtype)
}

/// `(start, length)` of the blocks of `block` elements (the last one shorter) over `length`.
fn blocks(length: usize, block: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..length)
        .step_by(block)
        .map(move |start| (start, block.min(length - start)))
}

/// `[batch, n_heads, rows, cols]`.
fn per_head(geometry: &Geometry, rows: usize, cols: usize) -> Shape {
    Shape::new([geometry.batch, geometry.n_heads, rows, cols])
}

/// `[batch, n_kv_heads, groups · rows, cols]`: the query heads sharing a key/value head stacked,
/// so that one matmul per key/value head serves its whole group.
fn grouped(geometry: &Geometry, rows: usize, cols: usize) -> Shape {
    Shape::new([
        geometry.batch,
        geometry.n_kv_heads,
        geometry.groups() * rows,
        cols,
    ])
}

fn narrow_float<B: Backend>(
    tensor: FloatTensor<B>,
    axis: usize,
    start: usize,
    length: usize,
) -> FloatTensor<B> {
    let shape = tensor.shape();
    narrow_axis(tensor, &shape, axis, start, length, B::float_slice)
}

fn narrow_bool<B: Backend>(
    tensor: BoolTensor<B>,
    axis: usize,
    start: usize,
    length: usize,
) -> BoolTensor<B> {
    let shape = tensor.shape();
    narrow_axis(tensor, &shape, axis, start, length, B::bool_slice)
}

/// `tensor[.., start..start + length, ..]` along `axis` through the backend's `slice`, or the
/// tensor whole where that axis has size 1: either the range is that one element, or the axis
/// is a mask's broadcast axis, which covers every block.
fn narrow_axis<T>(
    tensor: T,
    shape: &Shape,
    axis: usize,
    start: usize,
    length: usize,
    slice: impl FnOnce(T, &[Slice]) -> T,
) -> T {
    if shape[axis] == 1 {
        return tensor;
    }
    let ranges: Vec<Slice> = (0..shape.num_dims())
        .map(|dim| {
            if dim == axis {
                Slice::from(start..start + length)
            } else {
                Slice::from(0..shape[dim])
            }
        })
        .collect();
    slice(tensor, &ranges)
}

/// The most negative finite value of the tensor's float type.
fn lowest_finite<B: Backend>(tensor: &FloatTensor<B>) -> f32 {
    crate::kernel::lowest_finite(tensor.dtype())
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
