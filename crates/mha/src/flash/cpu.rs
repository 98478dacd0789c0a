//! The flash op on the f32 storage of the CPU backends (flex, ndarray): the computation of
//! `generic.rs`, with the matmuls handed to the `gemm` crate (flex's own GEMM) on strided views
//! (no transposed or head-split copies), the scale folded into the score GEMM, a vectorised
//! `exp`, keys past a query block's causal horizon never computed, results written
//! sequence-major (the layout the head merge reads without a copy), and every intermediate in
//! one reused per-thread buffer instead of fresh tensors.
//!
//! Each query block takes all its visible keys in one pass (a `query block × keys` score
//! buffer per thread), so a row's softmax needs no running rescale.
//!
//! Parallel over `(batch, head)` in the forward and over `(batch, key/value head)` in the
//! backward, where each task owns its key/value gradients outright.
//!
//! Soundness: every matrix a GEMM reads or writes ([`Matrix`], [`MatrixMut`]) is checked, when
//! it is made, to lie inside the buffer it borrows; the entry points check the inputs' shapes
//! against each other ([`FlashInputs::geometry`]). The one obligation left to callers is that
//! two tasks never take the same head of a shared output buffer ([`SharedBuffer::matrix`]).

use std::marker::PhantomData;
use std::ops::Range;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, DType, TensorData, TensorMetadata};
use rayon::prelude::*;

use super::{FlashForward, FlashGrads, FlashInputs, FlashParams, FlashState};
use super::{recycle, simd};
use crate::geometry::Geometry;

/// A CPU backend whose float tensors this kernel reads and writes in place.
pub(crate) trait CpuStorage: Backend {
    /// `tensor` itself, or a copy in a layout [`CpuStorage::strided`] reads, for f32.
    fn readable(tensor: &FloatTensor<Self>) -> Option<FloatTensor<Self>>;

    /// The f32 elements from the tensor's first one on, and its four strides, if all are
    /// non-negative and the last is 1.
    fn strided(tensor: &FloatTensor<Self>) -> Option<(&[f32], [usize; 4])>;

    /// A tensor of logical shape `[batch, heads, seq, dim]` over `values` laid out
    /// `[batch, seq, heads, dim]`: an output handed over to the caller.
    fn sequence_major(values: Vec<f32>, shape: [usize; 4]) -> FloatTensor<Self> {
        recycle::handed_over(&values, Self::OUTPUT_FATE);
        Self::sequence_major_storage(values, shape)
    }

    /// A contiguous tensor of `shape` over `values`, without a copy: an output handed over to
    /// the caller.
    fn contiguous(values: Vec<f32>, shape: [usize; 4]) -> FloatTensor<Self> {
        recycle::handed_over(&values, Self::OUTPUT_FATE);
        Self::contiguous_storage(values, shape)
    }

    /// [`CpuStorage::sequence_major`]'s tensor, in the backend's storage.
    fn sequence_major_storage(values: Vec<f32>, shape: [usize; 4]) -> FloatTensor<Self>;

    /// [`CpuStorage::contiguous`]'s tensor, in the backend's storage.
    fn contiguous_storage(values: Vec<f32>, shape: [usize; 4]) -> FloatTensor<Self>;

    /// What becomes of an output's buffer when its tensor drops.
    const OUTPUT_FATE: recycle::Fate;

    /// A buffer for an output of `length` elements, every one of which the caller writes (its
    /// values are unspecified).
    fn output_buffer(length: usize) -> Vec<f32> {
        recycle::buffer(length, Self::OUTPUT_FATE)
    }

    /// A buffer of `length` elements, each `value`.
    fn filled_buffer(length: usize, value: f32) -> Vec<f32> {
        recycle::filled(length, value, Self::OUTPUT_FATE)
    }
}

#[cfg(feature = "flex")]
impl CpuStorage for burn::backend::Flex {
    /// Flex's storage of an output hands its buffer back to the pool ([`recycle::into_bytes`]).
    const OUTPUT_FATE: recycle::Fate = recycle::Fate::Recycled;

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
        if tensor.dtype() != DType::F32 {
            return None;
        }
        let layout = tensor.layout();
        let strides = layout.strides();
        if strides.len() != 4 || strides[3] != 1 || strides.iter().any(|&s| s < 0) {
            return None;
        }
        let values = tensor.storage::<f32>().get(layout.start_offset()..)?;
        Some((values, [0, 1, 2, 3].map(|axis| strides[axis] as usize)))
    }

    fn sequence_major_storage(values: Vec<f32>, shape: [usize; 4]) -> FloatTensor<Self> {
        use burn::backend::flex::{FlexTensor, Layout};
        let [_, heads, seq, dim] = shape;
        let strides = [seq * heads * dim, dim, heads * dim, 1].map(|s| s as isize);
        FlexTensor::new(
            recycle::into_bytes(values),
            Layout::new(burn::backend::Shape::new(shape), strides.to_vec(), 0),
            DType::F32,
        )
    }

    fn contiguous_storage(values: Vec<f32>, shape: [usize; 4]) -> FloatTensor<Self> {
        use burn::backend::flex::{FlexTensor, Layout};
        FlexTensor::new(
            recycle::into_bytes(values),
            Layout::contiguous(burn::backend::Shape::new(shape)),
            DType::F32,
        )
    }
}

#[cfg(feature = "ndarray")]
impl CpuStorage for burn::backend::NdArray {
    /// ndarray's tensors own plain vectors, freed when they drop.
    const OUTPUT_FATE: recycle::Fate = recycle::Fate::Freed;

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

    fn sequence_major_storage(values: Vec<f32>, shape: [usize; 4]) -> FloatTensor<Self> {
        use burn::backend::ndarray::NdArrayTensor;
        use ndarray::{ArcArray, IxDyn, ShapeBuilder};
        let [_, heads, seq, dim] = shape;
        let strides = [seq * heads * dim, dim, heads * dim, 1];
        let array = ArcArray::from_shape_vec(IxDyn(&shape).strides(IxDyn(&strides)), values)
            .expect("sequence-major strides fit the buffer");
        NdArrayTensor::from(array)
    }

    fn contiguous_storage(values: Vec<f32>, shape: [usize; 4]) -> FloatTensor<Self> {
        use burn::backend::ndarray::NdArrayTensor;
        use ndarray::{ArcArray, IxDyn};
        let array =
            ArcArray::from_shape_vec(IxDyn(&shape), values).expect("the shape fits the buffer");
        NdArrayTensor::from(array)
    }
}

/// The forward on f32 storage; `None` for inputs it does not take (another dtype), which the
/// generic body then computes.
///
/// # Panics
///
/// If the inputs' shapes do not fit together ([`FlashInputs::geometry`]).
pub(super) fn forward<B: CpuStorage>(inputs: &FlashInputs<B>) -> Option<FlashForward<B>> {
    forward_writing_weights(inputs, false).map(|(forward, _)| forward)
}

/// The forward and the attention weights `[batch, n_heads, seq_q, seq_k]`, written as each
/// query block's probabilities are found (no second pass over the scores); `None` for inputs
/// it does not take.
///
/// # Panics
///
/// As [`forward`].
pub(super) fn forward_with_weights<B: CpuStorage>(
    inputs: &FlashInputs<B>,
) -> Option<(FlashForward<B>, FloatTensor<B>)> {
    let (forward, weights) = forward_writing_weights(inputs, true)?;
    Some((forward, weights.expect("weights were asked for")))
}

fn forward_writing_weights<B: CpuStorage>(
    inputs: &FlashInputs<B>,
    with_weights: bool,
) -> Option<(FlashForward<B>, Option<FloatTensor<B>>)> {
    let geometry = inputs.geometry();
    let readable = Readable::of(inputs)?;
    let kernel = Kernel::new(&readable, geometry, &inputs.params)?;
    let Geometry {
        batch,
        n_heads,
        seq_q,
        seq_k,
        value_dim,
        ..
    } = geometry;
    let output_shape = [batch, n_heads, seq_q, value_dim];
    // Every element of these is written (recycled buffers hold an earlier call's values).
    let mut output = B::output_buffer(batch * n_heads * seq_q * value_dim);
    // Per query: the score maximum and the inverse sum of exponentials.
    let stats_shape = [batch, n_heads, seq_q, 2];
    let mut softmax_stats = B::output_buffer(stats_shape.iter().product());
    let weights_shape = [batch, n_heads, seq_q, seq_k];
    let mut weights = B::output_buffer(match with_weights {
        true => weights_shape.iter().product(),
        false => 0,
    });
    let head_weights: Vec<Option<&mut [f32]>> = match with_weights && seq_q * seq_k > 0 {
        true => weights.chunks_mut(seq_q * seq_k).map(Some).collect(),
        false => (0..batch * n_heads).map(|_| None).collect(),
    };
    let shared_output = SharedBuffer::new(&mut output);
    let per_head = softmax_stats.chunks_mut(seq_q * 2).zip(head_weights);
    if kernel.reads_values_once_per_group() {
        let groups = geometry.groups();
        let mut tasks: Vec<Vec<_>> = Vec::with_capacity(batch * geometry.n_kv_heads);
        for (index, head) in per_head.enumerate() {
            if index % groups == 0 {
                tasks.push(Vec::with_capacity(groups));
            }
            tasks.last_mut().expect("pushed above").push(head);
        }
        for_each_task(
            tasks.into_iter().enumerate().collect(),
            kernel.parallel(),
            ForwardScratch::default,
            |scratch, (index, group)| {
                let (b, kv_head) = (index / geometry.n_kv_heads, index % geometry.n_kv_heads);
                let mut head_outputs: Vec<MatrixMut> = (0..groups)
                    // SAFETY: task `index` alone takes the query heads of key/value head
                    // (b, kv_head) of the output.
                    .map(|g| unsafe { shared_output.head(output_shape, b, kv_head * groups + g) })
                    .collect();
                let heads = group
                    .into_iter()
                    .zip(head_outputs.iter_mut())
                    .map(|((stats, weights), output)| HeadOutputs {
                        stats,
                        output,
                        weights,
                    })
                    .collect();
                kernel.forward_group(scratch, (b, kv_head), heads);
            },
        );
    } else {
        for_each_task(
            per_head.enumerate().collect(),
            kernel.parallel(),
            ForwardScratch::default,
            |scratch, (index, (head_stats, head_weights))| {
                let (b, h) = (index / n_heads, index % n_heads);
                // SAFETY: task `index` alone takes head (b, h) of the output.
                let mut head_output = unsafe { shared_output.head(output_shape, b, h) };
                let head = HeadOutputs {
                    stats: head_stats,
                    output: &mut head_output,
                    weights: head_weights,
                };
                kernel.forward_head(scratch, (b, h), head);
            },
        );
    }
    let forward = FlashForward {
        output: B::sequence_major(output, output_shape),
        softmax_stats: B::contiguous(softmax_stats, stats_shape),
    };
    let weights = with_weights.then(|| B::contiguous(weights, weights_shape));
    Some((forward, weights))
}

/// `lhs · rhs (+ bias)` on f32 storage, either factor read transposed through its strides:
/// matrices are `[1, 1, rows, columns]` tensors, the bias `[1, 1, 1, columns]` written into
/// each output row and the product accumulated onto it, on rayon's threads. A projection
/// (`x · W + b`) and its input and weight gradients (`dY · Wᵀ`, `xᵀ · dY`), each into a buffer
/// the result then owns; `None` for inputs it does not take.
///
/// # Panics
///
/// If the shapes do not fit a product.
pub(crate) fn product<B: CpuStorage>(
    (lhs, transpose_lhs): (&FloatTensor<B>, bool),
    (rhs, transpose_rhs): (&FloatTensor<B>, bool),
    bias: Option<&FloatTensor<B>>,
) -> Option<FloatTensor<B>> {
    let [lhs, rhs] = [B::readable(lhs)?, B::readable(rhs)?];
    let bias = match bias {
        Some(bias) => Some(B::readable(bias)?),
        None => None,
    };
    let lhs = HeadsView::of::<B>(&lhs)?
        .head(0, 0)
        .transposed_if(transpose_lhs);
    let rhs = HeadsView::of::<B>(&rhs)?
        .head(0, 0)
        .transposed_if(transpose_rhs);
    let bias = match &bias {
        Some(bias) => Some(HeadsView::of::<B>(bias)?.row(0, 0, 0)),
        None => None,
    };
    let (rows, columns) = (lhs.rows, rhs.columns);
    let output = products_side_by_side::<B>(lhs, &[(rhs, bias)]);
    Some(B::contiguous(output, [1, 1, rows, columns]))
}

/// `x · [W₁ | W₂ | …] + [b₁ | b₂ | …]`: the projections of one input by several weights, side by
/// side in one `[1, 1, rows, Σ columns]` output, in one pass over rayon's threads (one wake-up
/// of the workers instead of one per weight: self-attention's query, key and value); `None` for
/// inputs it does not take.
///
/// # Panics
///
/// If a weight's rows are not the input's columns, or a bias's length not its weight's columns.
pub(crate) fn packed_product<B: CpuStorage>(
    x: &FloatTensor<B>,
    weights: &[(&FloatTensor<B>, Option<&FloatTensor<B>>)],
) -> Option<FloatTensor<B>> {
    let x = B::readable(x)?;
    let mut readable = Vec::with_capacity(weights.len());
    for (weight, bias) in weights {
        let bias = match bias {
            Some(bias) => Some(B::readable(bias)?),
            None => None,
        };
        readable.push((B::readable(weight)?, bias));
    }
    let mut parts = Vec::with_capacity(weights.len());
    for (weight, bias) in &readable {
        let bias = match bias {
            Some(bias) => Some(HeadsView::of::<B>(bias)?.row(0, 0, 0)),
            None => None,
        };
        parts.push((HeadsView::of::<B>(weight)?.head(0, 0), bias));
    }
    let x = HeadsView::of::<B>(&x)?.head(0, 0);
    let (rows, columns) = (x.rows, parts.iter().map(|(rhs, _)| rhs.columns).sum());
    let output = products_side_by_side::<B>(x, &parts);
    Some(B::contiguous(output, [1, 1, rows, columns]))
}

/// `[lhs · rhs₁ + bias₁ | lhs · rhs₂ + bias₂ | …]`, row-major, in a buffer the caller then
/// owns. Above a size, one task per thread, each writing its own rows of every part: the bias
/// rows (filled on the calling thread, they were serial work between parallel GEMMs, 5% of a
/// forward's wall time at (8, 128, 256, 8), both workers idle meanwhile) and the products
/// accumulated onto them.
///
/// # Panics
///
/// If a part's rows are not `lhs`'s columns, or its bias's length not its columns.
fn products_side_by_side<B: CpuStorage>(
    lhs: Matrix,
    parts: &[(Matrix, Option<&[f32]>)],
) -> Vec<f32> {
    for (rhs, bias) in parts {
        assert_eq!(
            rhs.rows, lhs.columns,
            "projection: a {}x{} by {}x{} product",
            lhs.rows, lhs.columns, rhs.rows, rhs.columns
        );
        if let Some(bias) = bias {
            assert_eq!(
                bias.len(),
                rhs.columns,
                "projection: a bias of {} for {} outputs",
                bias.len(),
                rhs.columns
            );
        }
    }
    let rows = lhs.rows;
    let columns: usize = parts.iter().map(|(rhs, _)| rhs.columns).sum();
    // Every element is written: the bias rows, or the product alone.
    let mut output = B::output_buffer(rows * columns);
    let threads = rayon::current_num_threads();
    let parallel = rows * columns * lhs.columns >= 1 << 21;
    let write_rows = |block: &mut [f32], lhs: Matrix, parallelism| {
        let mut block = MatrixMut::from_slice(block, lhs.rows, columns, columns);
        let mut first_column = 0;
        for &(rhs, bias) in parts {
            let mut part = block.columns(first_column, rhs.columns);
            product_into(&mut part, bias, lhs, rhs, parallelism);
            first_column += rhs.columns;
        }
    };
    if parallel && rows >= threads && columns > 0 {
        let task_rows = rows.div_ceil(threads);
        output
            .par_chunks_mut(task_rows * columns)
            .enumerate()
            .for_each(|(task, block)| {
                let lhs_rows = lhs.rows(task * task_rows, block.len() / columns);
                write_rows(block, lhs_rows, gemm::Parallelism::None);
            });
    } else {
        let parallelism = match parallel {
            true => gemm::Parallelism::Rayon(0),
            false => gemm::Parallelism::None,
        };
        write_rows(&mut output, lhs, parallelism);
    }
    output
}

/// `dst ← lhs · rhs (+ bias in every row)`.
fn product_into(
    dst: &mut MatrixMut,
    bias: Option<&[f32]>,
    lhs: Matrix,
    rhs: Matrix,
    parallelism: gemm::Parallelism,
) {
    if let Some(bias) = bias {
        for row in 0..dst.rows {
            dst.row(row).copy_from_slice(bias);
        }
    }
    gemm_with(dst, bias.is_some(), lhs, rhs, 1.0, parallelism);
}

/// The sum of a `[1, 1, rows, columns]` f32 matrix's rows, `[1, 1, 1, columns]` (a
/// projection's bias gradient); `None` for inputs it does not take.
pub(crate) fn row_sum<B: CpuStorage>(matrix: &FloatTensor<B>) -> Option<FloatTensor<B>> {
    let readable = B::readable(matrix)?;
    let matrix = HeadsView::of::<B>(&readable)?.head(0, 0);
    let mut sums = vec![0.0f32; matrix.columns];
    for row in 0..matrix.rows {
        let start = row * matrix.row_stride;
        match matrix.column_stride {
            1 => {
                let values = &matrix.values[start..start + matrix.columns];
                sums.iter_mut()
                    .zip(values)
                    .for_each(|(sum, value)| *sum += value);
            }
            stride => sums
                .iter_mut()
                .enumerate()
                .for_each(|(column, sum)| *sum += matrix.values[start + column * stride]),
        }
    }
    Some(B::contiguous(sums, [1, 1, 1, matrix.columns]))
}

/// The backward on f32 storage; `None` for inputs it does not take.
///
/// # Panics
///
/// If the inputs' shapes do not fit together, or the output gradient's shape is not the
/// output's.
pub(super) fn backward<B: CpuStorage>(
    state: &FlashState<B>,
    output_grad: &FloatTensor<B>,
) -> Option<FlashGrads<B>> {
    let inputs = &state.inputs;
    let geometry = inputs.geometry();
    state.check_output_grad(output_grad);
    let readable = Readable::of(inputs)?;
    let kernel = Kernel::new(&readable, geometry, &inputs.params)?;
    let saved = [
        B::readable(output_grad)?,
        B::readable(&state.softmax_stats)?,
    ];
    let [output_grad, softmax_stats] = [0, 1].map(|i| HeadsView::of::<B>(&saved[i]));
    let rows = SavedRows {
        output_grad: output_grad?,
        softmax_stats: softmax_stats?,
    };
    let Geometry {
        batch,
        n_heads,
        n_kv_heads,
        seq_q,
        seq_k,
        head_dim,
        value_dim,
    } = geometry;
    let shapes = GradShapes {
        query: [batch, n_heads, seq_q, head_dim],
        key: [batch, n_kv_heads, seq_k, head_dim],
        value: [batch, n_kv_heads, seq_k, value_dim],
    };
    // Every element is written.
    let mut query_grad = B::output_buffer(batch * n_heads * seq_q * head_dim);
    // GEMMs accumulate into these, so they are filled with -0.0 (-0.0 + x = x): zeros would be
    // untouched pages that the first accumulating read maps to the shared zero page, and the
    // write after it would then take a copy-on-write fault and a TLB shootdown of every other
    // core, page by page (15% of a training step at batch 4, 512 tokens, d_model 512).
    let mut key_grad = B::filled_buffer(batch * n_kv_heads * seq_k * head_dim, -0.0);
    let mut value_grad = B::filled_buffer(batch * n_kv_heads * seq_k * value_dim, -0.0);
    let buffers = GradBuffers {
        query: SharedBuffer::new(&mut query_grad),
        key: SharedBuffer::new(&mut key_grad),
        value: SharedBuffer::new(&mut value_grad),
    };
    // Per (batch, head): the sink logit's gradient; each task owns its group's heads.
    let mut sink_grads = vec![0.0f32; batch * n_heads];
    for_each_task(
        sink_grads
            .chunks_mut(geometry.groups())
            .enumerate()
            .collect(),
        kernel.parallel(),
        BackwardScratch::default,
        |scratch, (index, group_sink_grads)| {
            let (b, kv_head) = (index / n_kv_heads, index % n_kv_heads);
            // SAFETY: task `index` alone takes key/value head (b, kv_head) of the key and value
            // gradients, and the query heads of its group of the query gradient.
            let mut grads =
                unsafe { buffers.of_kv_head(&shapes, &geometry, (b, kv_head), group_sink_grads) };
            kernel.backward_kv_head(scratch, &rows, (b, kv_head), &mut grads);
        },
    );
    let sinks = inputs.sinks.as_ref().map(|_| {
        let per_head: Vec<f32> = (0..n_heads)
            .map(|h| (0..batch).map(|b| sink_grads[b * n_heads + h]).sum())
            .collect();
        B::float_from_data(TensorData::new(per_head, [n_heads]), &inputs.query.device())
    });
    Some(FlashGrads {
        query: B::sequence_major(query_grad, shapes.query),
        key: B::sequence_major(key_grad, shapes.key),
        value: B::sequence_major(value_grad, shapes.value),
        sinks,
    })
}

/// The inputs in layouts [`HeadsView`] reads: query, key, value, and the masks as f32 (the
/// forbidden pairs as 1.0 flags).
struct Readable<B: CpuStorage> {
    heads: [FloatTensor<B>; 3],
    bias: Option<FloatTensor<B>>,
    forbid: Option<FloatTensor<B>>,
    /// `[1, 1, 1, n_heads]`
    sinks: Option<FloatTensor<B>>,
}

impl<B: CpuStorage> Readable<B> {
    /// `None` for a dtype this kernel does not take.
    fn of(inputs: &FlashInputs<B>) -> Option<Self> {
        let bias = match &inputs.bias {
            Some(bias) => Some(B::readable(bias)?),
            None => None,
        };
        let forbid = match &inputs.forbid {
            Some(forbid) => Some(B::readable(&B::bool_into_float(
                forbid.clone(),
                DType::F32.into(),
            ))?),
            None => None,
        };
        let sinks = match &inputs.sinks {
            Some(sinks) => {
                let heads = sinks.shape()[0];
                let row =
                    B::float_reshape(sinks.clone(), burn::backend::Shape::new([1, 1, 1, heads]));
                Some(B::readable(&row)?)
            }
            None => None,
        };
        Some(Self {
            heads: [
                B::readable(&inputs.query)?,
                B::readable(&inputs.key)?,
                B::readable(&inputs.value)?,
            ],
            bias,
            forbid,
            sinks,
        })
    }
}

/// A `[batch, heads, seq, dim]` f32 tensor read in place through its strides: the heads that
/// `Linear` + split produce (`[batch, seq, heads, dim]` memory) need no copy.
struct HeadsView<'a> {
    values: &'a [f32],
    shape: [usize; 4],
    strides: [usize; 4],
}

impl<'a> HeadsView<'a> {
    fn of<B: CpuStorage>(readable: &'a FloatTensor<B>) -> Option<Self> {
        let (values, strides) = B::strided(readable)?;
        let shape = readable.shape();
        let shape = [shape[0], shape[1], shape[2], shape[3]];
        let last = (0..4)
            .map(|axis| shape[axis].saturating_sub(1) * strides[axis])
            .sum::<usize>();
        assert!(
            last < values.len(),
            "flash attention: a tensor's strides reach past its storage"
        );
        Some(Self {
            values,
            shape,
            strides,
        })
    }

    /// Head `(batch, head)` as a `[seq, dim]` matrix.
    fn head(&self, batch: usize, head: usize) -> Matrix<'a> {
        let [_, _, seq, dim] = self.shape;
        assert!(batch < self.shape[0] && head < self.shape[1]);
        let start = batch * self.strides[0] + head * self.strides[1];
        Matrix::new(&self.values[start..], seq, dim, self.strides[2], 1)
    }

    /// Row `row` of head `(batch, head)`.
    fn row(&self, batch: usize, head: usize, row: usize) -> &'a [f32] {
        let [_, _, seq, dim] = self.shape;
        assert!(batch < self.shape[0] && head < self.shape[1] && row < seq);
        let start = batch * self.strides[0] + head * self.strides[1] + row * self.strides[2];
        &self.values[start..start + dim]
    }
}

/// A mask (`[batch | 1, heads | 1, seq_q | 1, seq_k | 1]`) read in place, with stride 0 on its
/// broadcast axes.
struct BroadcastView<'a> {
    values: &'a [f32],
    strides: [usize; 4],
}

/// One query's row of a [`BroadcastView`].
enum BroadcastRow<'a> {
    /// The same value for every key.
    Scalar(f32),
    Keys(&'a [f32]),
}

impl<'a> BroadcastView<'a> {
    /// # Panics
    ///
    /// If the mask does not broadcast to `full`.
    fn of<B: CpuStorage>(readable: &'a FloatTensor<B>, full: [usize; 4]) -> Self {
        let shape = readable.shape();
        let (values, read_strides) = B::strided(readable).expect("made readable");
        assert!(
            (0..4).all(|axis| shape[axis] == full[axis] || shape[axis] == 1),
            "flash attention: mask {shape:?} does not broadcast to {full:?}"
        );
        let strides = [0, 1, 2, 3].map(|axis| match shape[axis] {
            1 => 0,
            _ => read_strides[axis],
        });
        let last = (0..4)
            .map(|axis| full[axis].saturating_sub(1) * strides[axis])
            .sum::<usize>();
        assert!(
            last < values.len(),
            "flash attention: a mask's strides reach past its storage"
        );
        Self { values, strides }
    }

    /// For a mask shared by every head and query (key padding), the keys of batch element
    /// `batch` between its first and last allowed one (`0..0` when it allows none): every key
    /// outside is hidden from every query, so a kernel may skip it. `None` for other masks.
    fn allowed_key_span(&self, batch: usize, seq_k: usize) -> Option<Range<usize>> {
        let [batch_stride, head_stride, query_stride, key_stride] = self.strides;
        if head_stride != 0 || query_stride != 0 || key_stride == 0 {
            return None;
        }
        let row = &self.values[batch * batch_stride..];
        let allowed = |key: &usize| row[key * key_stride] == 0.0;
        let Some(first) = (0..seq_k).find(allowed) else {
            return Some(0..0);
        };
        let last = (0..seq_k).rev().find(allowed).unwrap_or(first);
        Some(first..last + 1)
    }

    /// Keys `keys` of query `query`'s row in head `(batch, head)`.
    fn row(
        &self,
        batch: usize,
        head: usize,
        query: usize,
        keys: &Range<usize>,
    ) -> BroadcastRow<'a> {
        let [batch_stride, head_stride, query_stride, key_stride] = self.strides;
        let start = batch * batch_stride + head * head_stride + query * query_stride;
        match key_stride {
            0 => BroadcastRow::Scalar(self.values[start]),
            _ => BroadcastRow::Keys(&self.values[start + keys.start..start + keys.end]),
        }
    }
}

/// A read-only strided matrix inside a borrowed buffer: element `(i, j)` at
/// `values[i · row_stride + j · column_stride]`, every one of which was checked to lie in
/// `values` when the matrix was made.
#[derive(Clone, Copy)]
struct Matrix<'a> {
    values: &'a [f32],
    rows: usize,
    columns: usize,
    row_stride: usize,
    column_stride: usize,
}

impl<'a> Matrix<'a> {
    /// # Panics
    ///
    /// If an element lies outside `values`.
    fn new(
        values: &'a [f32],
        rows: usize,
        columns: usize,
        row_stride: usize,
        column_stride: usize,
    ) -> Self {
        let matrix = Self {
            values,
            rows,
            columns,
            row_stride,
            column_stride,
        };
        assert!(
            matrix.fits(values.len()),
            "flash attention: a {rows}x{columns} matrix does not fit its buffer"
        );
        matrix
    }

    /// Whether every element lies below `length`.
    fn fits(&self, length: usize) -> bool {
        self.rows == 0
            || self.columns == 0
            || (self.rows - 1) * self.row_stride + (self.columns - 1) * self.column_stride < length
    }

    fn transposed(self) -> Self {
        Self {
            rows: self.columns,
            columns: self.rows,
            row_stride: self.column_stride,
            column_stride: self.row_stride,
            ..self
        }
    }

    fn transposed_if(self, transpose: bool) -> Self {
        match transpose {
            true => self.transposed(),
            false => self,
        }
    }

    /// Columns `start..start + count`.
    ///
    /// # Panics
    ///
    /// If they are not columns of the matrix.
    fn columns(self, start: usize, count: usize) -> Self {
        self.transposed().rows(start, count).transposed()
    }

    /// Rows `start..start + count`.
    ///
    /// # Panics
    ///
    /// If they are not rows of the matrix.
    fn rows(self, start: usize, count: usize) -> Self {
        assert!(
            start + count <= self.rows,
            "flash attention: rows out of the matrix"
        );
        let offset = if count == 0 {
            0
        } else {
            start * self.row_stride
        };
        Self::new(
            &self.values[offset..],
            count,
            self.columns,
            self.row_stride,
            self.column_stride,
        )
    }
}

/// A writable matrix with unit column stride: element `(i, j)` at `pointer + i · row_stride +
/// j`, every one of which was checked, when the matrix was made, to lie in the buffer it
/// borrows, and which no other live matrix reaches.
struct MatrixMut<'a> {
    pointer: *mut f32,
    rows: usize,
    columns: usize,
    row_stride: usize,
    buffer: PhantomData<&'a mut [f32]>,
}

impl<'a> MatrixMut<'a> {
    /// # Panics
    ///
    /// If an element lies outside `values`.
    fn from_slice(values: &'a mut [f32], rows: usize, columns: usize, row_stride: usize) -> Self {
        Matrix::new(values, rows, columns, row_stride, 1);
        Self {
            pointer: values.as_mut_ptr(),
            rows,
            columns,
            row_stride,
            buffer: PhantomData,
        }
    }

    /// Rows `start..start + count`, borrowed from this matrix.
    ///
    /// # Panics
    ///
    /// If they are not rows of the matrix.
    fn rows(&mut self, start: usize, count: usize) -> MatrixMut<'_> {
        assert!(
            start + count <= self.rows,
            "flash attention: rows out of the matrix"
        );
        MatrixMut {
            // SAFETY: row `start` lies in the buffer (checked extent; `start < rows` when
            // `count > 0`, and the pointer is not used when `count == 0`).
            pointer: unsafe {
                self.pointer.add(if count == 0 {
                    0
                } else {
                    start * self.row_stride
                })
            },
            rows: count,
            columns: self.columns,
            row_stride: self.row_stride,
            buffer: PhantomData,
        }
    }

    /// Columns `start..start + count`, borrowed from this matrix.
    ///
    /// # Panics
    ///
    /// If they are not columns of the matrix.
    fn columns(&mut self, start: usize, count: usize) -> MatrixMut<'_> {
        assert!(
            start + count <= self.columns,
            "flash attention: columns out of the matrix"
        );
        MatrixMut {
            // SAFETY: when the matrix has a row, column `start` of its first row lies in the
            // checked extent (`start < columns` when `count > 0`; the pointer is not used when
            // `count == 0` or `rows == 0`), and so do the sub-matrix's other elements, which are
            // the matrix's.
            pointer: unsafe {
                self.pointer.add(match count == 0 || self.rows == 0 {
                    true => 0,
                    false => start,
                })
            },
            rows: self.rows,
            columns: count,
            row_stride: self.row_stride,
            buffer: PhantomData,
        }
    }

    /// Row `row`.
    ///
    /// # Panics
    ///
    /// If it is not a row of the matrix.
    fn row(&mut self, row: usize) -> &mut [f32] {
        assert!(row < self.rows, "flash attention: row out of the matrix");
        // SAFETY: the row's elements lie in the checked extent, which this matrix alone reaches
        // while the returned slice borrows it.
        unsafe {
            std::slice::from_raw_parts_mut(self.pointer.add(row * self.row_stride), self.columns)
        }
    }
}

/// A `[batch, seq, heads, dim]` buffer (sequence-major: the layout the head merge and
/// `Linear`'s backward read without a copy) shared by the tasks of one call, each of which
/// writes its own heads. A head's rows interleave with the other heads', so the tasks cannot
/// split the buffer into slices.
struct SharedBuffer<'a> {
    pointer: *mut f32,
    length: usize,
    buffer: PhantomData<&'a mut [f32]>,
}

// SAFETY: the buffer is only reached through `SharedBuffer::head`, whose contract gives each
// head to one task at a time.
unsafe impl Send for SharedBuffer<'_> {}
// SAFETY: as above.
unsafe impl Sync for SharedBuffer<'_> {}

impl<'a> SharedBuffer<'a> {
    fn new(values: &'a mut [f32]) -> Self {
        Self {
            pointer: values.as_mut_ptr(),
            length: values.len(),
            buffer: PhantomData,
        }
    }

    /// Head `(batch, head)` of the buffer seen as logical shape `[batch, heads, seq, dim]`, as a
    /// `[seq, dim]` matrix.
    ///
    /// # Panics
    ///
    /// If the shape does not fit the buffer or the head is not in it.
    ///
    /// # Safety
    ///
    /// While the returned matrix lives, no other matrix of this buffer may be of the same head.
    unsafe fn head(
        &self,
        [batches, heads, seq, dim]: [usize; 4],
        batch: usize,
        head: usize,
    ) -> MatrixMut<'_> {
        assert!(
            batch < batches && head < heads && batches * heads * seq * dim <= self.length,
            "flash attention: head ({batch}, {head}) is not in a {:?} buffer of {} elements",
            [batches, heads, seq, dim],
            self.length
        );
        let start = (batch * seq * heads + head) * dim;
        MatrixMut {
            // SAFETY: `start` and every element of the head lie below `length` (checked above:
            // the last is `start + (seq - 1) · heads · dim + dim - 1 < batches · seq · heads ·
            // dim`).
            pointer: unsafe { self.pointer.add(start) },
            rows: seq,
            columns: dim,
            row_stride: heads * dim,
            buffer: PhantomData,
        }
    }
}

/// `dst (+)= beta · lhs · rhs`.
///
/// # Panics
///
/// If the three matrices' sizes do not fit a product.
fn gemm(dst: &mut MatrixMut, accumulate: bool, lhs: Matrix, rhs: Matrix, beta: f32) {
    gemm_with(dst, accumulate, lhs, rhs, beta, gemm::Parallelism::None);
}

/// [`gemm`] on `parallelism`'s threads.
fn gemm_with(
    dst: &mut MatrixMut,
    accumulate: bool,
    lhs: Matrix,
    rhs: Matrix,
    beta: f32,
    parallelism: gemm::Parallelism,
) {
    assert!(
        lhs.rows == dst.rows && rhs.columns == dst.columns && lhs.columns == rhs.rows,
        "flash attention: a {}x{} by {}x{} product into {}x{}",
        lhs.rows,
        lhs.columns,
        rhs.rows,
        rhs.columns,
        dst.rows,
        dst.columns
    );
    if dst.rows == 0 || dst.columns == 0 {
        return;
    }
    // SAFETY: every element the strides reach lies in its buffer (checked when each matrix was
    // made), and `dst` is borrowed mutably from a buffer no `Matrix` reads.
    unsafe {
        gemm::gemm(
            dst.rows,
            dst.columns,
            lhs.columns,
            dst.pointer,
            1,
            dst.row_stride as isize,
            accumulate,
            lhs.values.as_ptr(),
            lhs.column_stride as isize,
            lhs.row_stride as isize,
            rhs.values.as_ptr(),
            rhs.column_stride as isize,
            rhs.row_stride as isize,
            1.0,
            beta,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// Runs `task(scratch, item)` for every item, on rayon's threads when `parallel`, each thread
/// with its own scratch from `init`.
fn for_each_task<T: Send, S>(
    items: Vec<T>,
    parallel: bool,
    init: impl Fn() -> S + Sync + Send,
    task: impl Fn(&mut S, T) + Sync + Send,
) {
    if parallel {
        items.into_par_iter().for_each_init(init, task);
    } else {
        let mut scratch = init();
        items.into_iter().for_each(|item| task(&mut scratch, item));
    }
}

/// One call's inputs as views, and what it computes with them.
struct Kernel<'a> {
    geometry: Geometry,
    params: &'a FlashParams,
    query: HeadsView<'a>,
    key: HeadsView<'a>,
    value: HeadsView<'a>,
    bias: Option<BroadcastView<'a>>,
    forbid: Option<BroadcastView<'a>>,
    /// One logit per query head.
    sinks: Option<&'a [f32]>,
    /// Per batch element, the keys between its first and last unpadded one (key padding).
    padding_spans: Option<Vec<Range<usize>>>,
}

/// What the forward writes for one head, or for one query block of it: softmax statistics
/// (`[rows, 2]` flattened), output rows, and the weights (`[rows, seq_k]` flattened) when they
/// are asked for.
struct HeadOutputs<'s, 'm, 'b> {
    stats: &'s mut [f32],
    output: &'m mut MatrixMut<'b>,
    weights: Option<&'s mut [f32]>,
}

#[derive(Default)]
struct ForwardScratch {
    block: ForwardBlockScratch,
    /// The head's keys as `[head_dim, seq_k]` ([`transposed_copy`]).
    transposed_key: Vec<f32>,
    /// The head's values as dense rows ([`dense_copy`]).
    dense_value: Vec<f32>,
    /// [`Kernel::forward_group`]: each query head's block, and the group's unscaled output rows.
    group_blocks: Vec<ForwardBlockScratch>,
    group_output: Vec<f32>,
}

#[derive(Default)]
struct ForwardBlockScratch {
    scores: Vec<f32>,
    inverse_sums: Vec<f32>,
}

#[derive(Default)]
struct BackwardScratch {
    block: BackwardBlockScratch,
    /// The key/value head's keys and values as `[dim, seq_k]` ([`transposed_copy`]).
    transposed_key: Vec<f32>,
    transposed_value: Vec<f32>,
    /// The key/value head's keys as dense rows ([`dense_copy`]).
    dense_key: Vec<f32>,
}

#[derive(Default)]
struct BackwardBlockScratch {
    probabilities: Vec<f32>,
    score_grads: Vec<f32>,
    /// `1 - tanh²` of the capped scores, under a soft cap.
    cap_derivatives: Vec<f32>,
}

/// A key/value head's keys and values as `[dim, seq_k]` matrices: the right-hand factors of
/// `Q Kᵀ` and `dO Vᵀ`.
#[derive(Clone, Copy)]
struct TransposedHead<'t> {
    key: Matrix<'t>,
    value: Matrix<'t>,
}

/// The fewest queries for which a head's keys and values are transposed once
/// ([`transposed_copy`]) rather than read in place.
const MIN_QUERIES_TO_TRANSPOSE: usize = 16;

/// `matrix` (`[rows, columns]`, any strides) copied into `buffer` as its `[columns, rows]`
/// transpose with unit column stride.
///
/// Why: `gemm` packs the left-hand factor of its (row-major destination) problems in panels
/// along the destination's columns, so `Q Kᵀ` and `dO Vᵀ` have it pack `K` and `V` with
/// each panel gathered element by element across rows `d_model` floats apart, which alias
/// in the L1 cache (1.7 ns an element; 14% of a training step at (1, 2048, 512, 8)), and
/// again for every query block of the head. From this copy, made once per head, the packing
/// is a sequence of contiguous copies.
fn transposed_copy<'b>(buffer: &'b mut Vec<f32>, matrix: Matrix) -> Matrix<'b> {
    let (rows, columns) = (matrix.rows, matrix.columns);
    // A row stride that is not a multiple of a large power of two, for the same aliasing.
    let stride = rows.next_multiple_of(16) + 16;
    let values = grown(buffer, columns * stride);
    const ROW_BLOCK: usize = 16;
    for first_row in (0..rows).step_by(ROW_BLOCK) {
        let block_rows = ROW_BLOCK.min(rows - first_row);
        let source = matrix.rows(first_row, block_rows);
        for (column, out) in values.chunks_exact_mut(stride).enumerate() {
            let out = &mut out[first_row..first_row + block_rows];
            for (row, slot) in out.iter_mut().enumerate() {
                *slot = source.values[row * source.row_stride + column * source.column_stride];
            }
        }
    }
    Matrix::new(values, columns, rows, stride, 1)
}

/// `matrix` (`[rows, columns]`, any strides) copied into `buffer` as dense rows.
///
/// Why: `dS K` and `P V` read a head's keys or values as their right-hand factor, which
/// `gemm` packs again for every query block; from rows `d_model` floats apart (2 KiB at
/// d_model 512) that packing gathers across lines that alias in the L1 cache. One-thread
/// microbenchmark of `dS K` at 128 queries × 8192 keys, head width 64: 171-177 GFLOP/s from
/// dense rows against 147-164 from the heads layout.
fn dense_copy<'b>(buffer: &'b mut Vec<f32>, matrix: Matrix) -> Matrix<'b> {
    let (rows, columns) = (matrix.rows, matrix.columns);
    let values = grown(buffer, rows * columns);
    for (row, out) in values.chunks_exact_mut(columns.max(1)).enumerate() {
        let source = matrix.rows(row, 1);
        match source.column_stride {
            1 => out.copy_from_slice(&source.values[..columns]),
            stride => {
                for (column, slot) in out.iter_mut().enumerate() {
                    *slot = source.values[column * stride];
                }
            }
        }
    }
    Matrix::new(values, rows, columns, columns, 1)
}

/// The first `length` elements of `buffer`, grown (zero-filled) if it is shorter: a scratch
/// buffer whose elements the caller overwrites, so the part reused from earlier calls is not
/// cleared again.
fn grown(buffer: &mut Vec<f32>, length: usize) -> &mut [f32] {
    if buffer.len() < length {
        buffer.resize(length, 0.0);
    }
    &mut buffer[..length]
}

/// What the backward reads of the forward and of the output gradient.
struct SavedRows<'a> {
    output_grad: HeadsView<'a>,
    /// `[batch, n_heads, seq_q, 2]`: maximum and inverse sum per query.
    softmax_stats: HeadsView<'a>,
}

struct GradShapes {
    query: [usize; 4],
    key: [usize; 4],
    value: [usize; 4],
}

struct GradBuffers<'a> {
    query: SharedBuffer<'a>,
    key: SharedBuffer<'a>,
    value: SharedBuffer<'a>,
}

/// One backward task's gradients: the query heads of a group, their key/value head's, and the
/// group's sink logits'.
struct KvHeadGrads<'a, 's> {
    query: Vec<MatrixMut<'a>>,
    key: MatrixMut<'a>,
    value: MatrixMut<'a>,
    sinks: &'s mut [f32],
}

impl GradBuffers<'_> {
    /// # Safety
    ///
    /// No other live matrix of these buffers is of key/value head `(batch, kv_head)` or of one
    /// of its query heads.
    unsafe fn of_kv_head<'s>(
        &self,
        shapes: &GradShapes,
        geometry: &Geometry,
        (batch, kv_head): (usize, usize),
        sinks: &'s mut [f32],
    ) -> KvHeadGrads<'_, 's> {
        let groups = geometry.groups();
        // SAFETY: the caller's contract, head by head.
        unsafe {
            KvHeadGrads {
                query: (kv_head * groups..(kv_head + 1) * groups)
                    .map(|head| self.query.head(shapes.query, batch, head))
                    .collect(),
                key: self.key.head(shapes.key, batch, kv_head),
                value: self.value.head(shapes.value, batch, kv_head),
                sinks,
            }
        }
    }
}

impl<'a> Kernel<'a> {
    /// `None` when a tensor is not in a layout the views read.
    fn new<B: CpuStorage>(
        readable: &'a Readable<B>,
        geometry: Geometry,
        params: &'a FlashParams,
    ) -> Option<Self> {
        let [query, key, value] = &readable.heads;
        let full = [
            geometry.batch,
            geometry.n_heads,
            geometry.seq_q,
            geometry.seq_k,
        ];
        let sinks = match &readable.sinks {
            Some(sinks) => Some(HeadsView::of::<B>(sinks)?.row(0, 0, 0)),
            None => None,
        };
        let forbid = readable
            .forbid
            .as_ref()
            .map(|forbid| BroadcastView::of::<B>(forbid, full));
        let padding_spans = forbid.as_ref().and_then(|forbid| {
            (0..geometry.batch)
                .map(|b| forbid.allowed_key_span(b, geometry.seq_k))
                .collect::<Option<Vec<_>>>()
        });
        Some(Self {
            geometry,
            params,
            query: HeadsView::of::<B>(query)?,
            key: HeadsView::of::<B>(key)?,
            value: HeadsView::of::<B>(value)?,
            bias: readable
                .bias
                .as_ref()
                .map(|bias| BroadcastView::of::<B>(bias, full)),
            forbid,
            sinks,
            padding_spans,
        })
    }

    /// Whether the call is worth rayon's threads: a decoding step (one query) is not.
    fn parallel(&self) -> bool {
        let g = &self.geometry;
        let work = g.score_elements() * (g.head_dim + g.value_dim);
        g.batch * g.n_heads > 1 && work >= 1 << 22
    }

    /// Query blocks `(start, length)`.
    fn query_blocks(&self) -> impl Iterator<Item = (usize, usize)> + use<> {
        let (seq_q, block) = (self.geometry.seq_q, self.params.blocks.query);
        (0..seq_q)
            .step_by(block)
            .map(move |start| (start, block.min(seq_q - start)))
    }

    /// Every key a query of block `(q_start, q_len)` of batch element `b` may see lies in the
    /// returned range.
    fn key_range(&self, b: usize, (q_start, q_len): (usize, usize)) -> Range<usize> {
        let range = self
            .params
            .rules
            .key_range(b, q_start..q_start + q_len, self.geometry.seq_k);
        match &self.padding_spans {
            Some(spans) => {
                let span = &spans[b];
                let (start, end) = (range.start.max(span.start), range.end.min(span.end));
                if start < end { start..end } else { 0..0 }
            }
            None => range,
        }
    }

    /// The `[q_len, keys.len()]` score block of queries `q_start..q_start + q_len` of head
    /// `(b, h)` over keys `keys`, in `scores`: `cap(scale · Q Kᵀ) + bias`, hidden keys at
    /// `-inf`; `key_t` is the head's `Kᵀ`. Under a soft cap, `cap_derivatives` (if given) ←
    /// `1 - tanh²` of the same block.
    fn score_block<'s>(
        &self,
        scores: &'s mut Vec<f32>,
        cap_derivatives: Option<&mut Vec<f32>>,
        (b, h): (usize, usize),
        (q_start, q_len): (usize, usize),
        (keys, key_t): (&Range<usize>, Matrix),
    ) -> &'s mut [f32] {
        let width = keys.len();
        let scores = grown(scores, q_len * width);
        let query = self.query.head(b, h).rows(q_start, q_len);
        let mut block = MatrixMut::from_slice(scores, q_len, width, width);
        gemm(
            &mut block,
            false,
            query,
            key_t.columns(keys.start, width),
            self.params.scale as f32,
        );
        if let Some(cap) = self.params.softcap {
            let cap = cap as f32;
            let mut derivatives = cap_derivatives;
            if let Some(derivatives) = derivatives.as_deref_mut() {
                derivatives.clear();
            }
            soft_cap(scores, cap, derivatives);
        }
        for (row, row_scores) in scores.chunks_exact_mut(width).enumerate() {
            self.mask_row(row_scores, (b, h), q_start + row, keys);
        }
        scores
    }

    /// Head `(b, kv_head)`'s keys and values as `[dim, seq_k]`: copied ([`transposed_copy`])
    /// when the backward reads them for more than one score block (the query blocks of every
    /// query head of the group) of at least [`MIN_QUERIES_TO_TRANSPOSE`] queries, their strided
    /// views otherwise (a copy would cost what the one packing saves, and `gemm` reads a factor
    /// of a few rows in place, without packing it: a decoding step with one query per head took
    /// 5.7 ms at 16384 cached positions with the copy, against 1.7 ms without).
    ///
    /// The forward makes the same choice although it reads a copy for one query head only:
    /// `gemm` may round a score differently from the two layouts (another kernel, FMA or not),
    /// and the backward's recomputed probabilities must be the forward's to the last bit, or a
    /// saturated row's gradient stops being exactly zero.
    fn transposed_head<'t>(
        &'t self,
        (transposed_key, transposed_value): (&'t mut Vec<f32>, Option<&'t mut Vec<f32>>),
        (b, kv_head): (usize, usize),
    ) -> TransposedHead<'t> {
        let [key, value] = [&self.key, &self.value].map(|view| view.head(b, kv_head));
        match self.copies_heads() {
            true => TransposedHead {
                key: transposed_copy(transposed_key, key),
                value: match transposed_value {
                    Some(buffer) => transposed_copy(buffer, value),
                    None => value.transposed(),
                },
            },
            false => TransposedHead {
                key: key.transposed(),
                value: value.transposed(),
            },
        }
    }

    /// Whether a key/value head is read for more than one score block (the query blocks of
    /// every query head of its group) of at least [`MIN_QUERIES_TO_TRANSPOSE`] queries, which
    /// pays for copying it once ([`Kernel::transposed_head`], [`Kernel::dense_rows`]).
    fn copies_heads(&self) -> bool {
        self.geometry.groups() * self.query_blocks().count() > 1
            && self.geometry.seq_q >= MIN_QUERIES_TO_TRANSPOSE
    }

    /// Whether the forward serves a key/value head's query heads together
    /// ([`Kernel::forward_group`]): under grouped-query attention when each head's keys and
    /// values are read in place ([`Kernel::copies_heads`] false: fewer than
    /// [`MIN_QUERIES_TO_TRANSPOSE`] queries, a decoding step).
    fn reads_values_once_per_group(&self) -> bool {
        self.geometry.groups() > 1 && !self.copies_heads()
    }

    /// `head` (a key or value head) as dense rows in `buffer` ([`dense_copy`]) when
    /// [`Kernel::copies_heads`], else as it is.
    fn dense_rows<'t>(&self, buffer: &'t mut Vec<f32>, head: Matrix<'t>) -> Matrix<'t> {
        match self.copies_heads() {
            true => dense_copy(buffer, head),
            false => head,
        }
    }

    /// Adds the biases (the caller's, ALiBi) to one query's scores over keys `keys`, then hides
    /// the keys its masks and the rules forbid. Hiding replaces the score, so that a forbidden
    /// key drops out whatever its score.
    fn mask_row(
        &self,
        scores: &mut [f32],
        (b, h): (usize, usize),
        query: usize,
        keys: &Range<usize>,
    ) {
        let rules = &self.params.rules;
        if let Some(bias) = &self.bias {
            match bias.row(b, h, query, keys) {
                BroadcastRow::Scalar(value) => scores.iter_mut().for_each(|s| *s += value),
                BroadcastRow::Keys(row) => scores.iter_mut().zip(row).for_each(|(s, v)| *s += v),
            }
        }
        if let Some(slopes) = &rules.alibi {
            for (run, distance) in rules.distance_runs(query, keys) {
                simd::add_distance_penalty(
                    &mut scores[run.start - keys.start..run.end - keys.start],
                    distance as f32,
                    -slopes[h],
                );
            }
        }
        if let Some(forbid) = &self.forbid {
            match forbid.row(b, h, query, keys) {
                BroadcastRow::Scalar(flag) if flag != 0.0 => scores.fill(f32::NEG_INFINITY),
                BroadcastRow::Scalar(_) => {}
                BroadcastRow::Keys(flags) => {
                    for (score, &flag) in scores.iter_mut().zip(flags) {
                        if flag != 0.0 {
                            *score = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
        if !rules.hides_keys() {
            return;
        }
        let positional = keys
            .end
            .min(rules.positional_keys)
            .saturating_sub(keys.start);
        match rules.contiguous_range(b, query) {
            Some(visible) => {
                // Hide the positional keys of the block outside `visible`.
                let local =
                    |key: usize| key.clamp(keys.start, keys.start + positional) - keys.start;
                let (lo, hi) = (
                    local(visible.start),
                    local(visible.end).max(local(visible.start)),
                );
                scores[..lo].fill(f32::NEG_INFINITY);
                scores[hi..positional].fill(f32::NEG_INFINITY);
            }
            None => {
                for (score, key) in scores[..positional].iter_mut().zip(keys.clone()) {
                    if !rules.visible(b, query, key) {
                        *score = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }

    /// Writes head `(b, h)`'s outputs, query block by query block.
    fn forward_head(
        &self,
        scratch: &mut ForwardScratch,
        head: (usize, usize),
        outputs: HeadOutputs,
    ) {
        let seq_k = self.geometry.seq_k;
        let HeadOutputs {
            stats,
            output,
            mut weights,
        } = outputs;
        let ForwardScratch {
            block: block_scratch,
            transposed_key,
            dense_value,
            ..
        } = scratch;
        let (b, h) = head;
        let kv_head = self.geometry.kv_head(h);
        let key_t = self
            .transposed_head((transposed_key, None), (b, kv_head))
            .key;
        let value = self.dense_rows(dense_value, self.value.head(b, kv_head));
        for (q_start, q_len) in self.query_blocks() {
            let mut output_rows = output.rows(q_start, q_len);
            let block = HeadOutputs {
                stats: &mut stats[2 * q_start..2 * (q_start + q_len)],
                output: &mut output_rows,
                weights: weights
                    .as_deref_mut()
                    .map(|weights| &mut weights[q_start * seq_k..(q_start + q_len) * seq_k]),
            };
            self.forward_query_block(block_scratch, (head, key_t, value), (q_start, q_len), block);
        }
    }

    /// Writes one query block's output rows, softmax statistics and, when asked for, weights.
    fn forward_query_block(
        &self,
        scratch: &mut ForwardBlockScratch,
        (head, key_t, value): ((usize, usize), Matrix, Matrix),
        queries: (usize, usize),
        outputs: HeadOutputs,
    ) {
        let HeadOutputs {
            stats,
            output,
            weights,
        } = outputs;
        let keys = self.key_range(head.0, queries);
        if !self.block_probabilities(scratch, (head, key_t), queries, &keys, (stats, weights)) {
            for row in 0..queries.1 {
                output.row(row).fill(0.0);
            }
            return;
        }
        let (q_len, width) = (queries.1, keys.len());
        // O = P V, then each row divided by its sum.
        gemm(
            output,
            false,
            Matrix::new(&scratch.scores, q_len, width, width, 1),
            value.rows(keys.start, width),
            1.0,
        );
        for (row, inverse_sum) in scratch.inverse_sums.iter().enumerate() {
            output.row(row).iter_mut().for_each(|x| *x *= inverse_sum);
        }
    }

    /// One query block's softmax numerators over `keys` (`[q_len, keys.len()]` in
    /// `scratch.scores`) and the inverse of each row's sum (`scratch.inverse_sums`); writes the
    /// rows' statistics and, when asked for, weights. False when no query of the block sees a
    /// key: the statistics then make every recomputed probability 0 (the sink's alone is 1),
    /// the weights are zeros, and the caller writes zero output rows.
    fn block_probabilities(
        &self,
        scratch: &mut ForwardBlockScratch,
        (head, key_t): ((usize, usize), Matrix),
        queries: (usize, usize),
        keys: &Range<usize>,
        (stats, weights): (&mut [f32], Option<&mut [f32]>),
    ) -> bool {
        let sink = self.sinks.map(|sinks| sinks[head.1]);
        if keys.is_empty() {
            let row_stats = match sink {
                Some(sink) => [sink, 1.0],
                None => [f32::MIN, 0.0],
            };
            for stats in stats.chunks_exact_mut(2) {
                stats.copy_from_slice(&row_stats);
            }
            if let Some(weights) = weights {
                weights.fill(0.0);
            }
            return false;
        }
        let width = keys.len();
        let ForwardBlockScratch {
            scores,
            inverse_sums,
        } = scratch;
        let scores = self.score_block(scores, None, head, queries, (keys, key_t));
        inverse_sums.clear();
        for (row_scores, row_stats) in scores
            .chunks_exact_mut(width)
            .zip(stats.chunks_exact_mut(2))
        {
            let (max, inverse_sum) = softmax_numerators(row_scores, sink);
            inverse_sums.push(inverse_sum);
            row_stats.copy_from_slice(&[max, inverse_sum]);
        }
        if let Some(weights) = weights {
            let seq_k = self.geometry.seq_k;
            for ((weights_row, numerators), inverse_sum) in weights
                .chunks_exact_mut(seq_k)
                .zip(scores.chunks_exact(width))
                .zip(inverse_sums.iter())
            {
                weights_row[..keys.start].fill(0.0);
                weights_row[keys.end..].fill(0.0);
                simd::scaled_copy(&mut weights_row[keys.clone()], numerators, *inverse_sum);
            }
        }
        true
    }

    /// Writes the outputs of key/value head `(b, kv_head)`'s query heads (`heads`, in order),
    /// query block by query block: each head's scores and probabilities as
    /// [`Kernel::forward_query_block`] finds them, then `P V` for all of them in one pass over
    /// the value rows ([`simd::weighted_row_sums`]), where a product per head would read them
    /// once per query head. The scores go through the same code as the backward's, which
    /// recomputes them head by head; only the output's summation order differs.
    fn forward_group(
        &self,
        scratch: &mut ForwardScratch,
        (b, kv_head): (usize, usize),
        mut heads: Vec<HeadOutputs>,
    ) {
        let (groups, seq_k, value_dim) = (
            self.geometry.groups(),
            self.geometry.seq_k,
            self.geometry.value_dim,
        );
        assert_eq!(
            heads.len(),
            groups,
            "forward_group: one output per query head"
        );
        let ForwardScratch {
            transposed_key,
            dense_value,
            group_blocks,
            group_output,
            ..
        } = scratch;
        let key_t = self
            .transposed_head((transposed_key, None), (b, kv_head))
            .key;
        let value = self.dense_rows(dense_value, self.value.head(b, kv_head));
        group_blocks.resize_with(groups, ForwardBlockScratch::default);
        for (q_start, q_len) in self.query_blocks() {
            let keys = self.key_range(b, (q_start, q_len));
            for (group_index, (head, block)) in
                heads.iter_mut().zip(group_blocks.iter_mut()).enumerate()
            {
                let stats = &mut head.stats[2 * q_start..2 * (q_start + q_len)];
                let weights = head
                    .weights
                    .as_deref_mut()
                    .map(|weights| &mut weights[q_start * seq_k..(q_start + q_len) * seq_k]);
                let h = kv_head * groups + group_index;
                self.block_probabilities(
                    block,
                    ((b, h), key_t),
                    (q_start, q_len),
                    &keys,
                    (stats, weights),
                );
            }
            if keys.is_empty() {
                for head in &mut heads {
                    for row in q_start..q_start + q_len {
                        head.output.row(row).fill(0.0);
                    }
                }
                continue;
            }
            let width = keys.len();
            let probability_rows: Vec<&[f32]> = group_blocks
                .iter()
                .flat_map(|block| block.scores[..q_len * width].chunks_exact(width))
                .collect();
            let sums = grown(group_output, probability_rows.len() * value_dim);
            let values = value.rows(keys.start, width);
            debug_assert_eq!(
                values.column_stride, 1,
                "heads are read with unit column stride"
            );
            simd::weighted_row_sums(sums, &probability_rows, values.values, values.row_stride);
            let mut sum_rows = sums.chunks_exact(value_dim);
            for (head, block) in heads.iter_mut().zip(group_blocks.iter()) {
                for (row, inverse_sum) in (q_start..).zip(&block.inverse_sums) {
                    let sum_row = sum_rows.next().expect("one sum row per query row");
                    for (out, &sum) in head.output.row(row).iter_mut().zip(sum_row) {
                        *out = sum * inverse_sum;
                    }
                }
            }
        }
    }

    /// Every query head of key/value head `(b, kv_head)`: its query gradients, its share of the
    /// key/value head's, and its sink logit's.
    fn backward_kv_head(
        &self,
        scratch: &mut BackwardScratch,
        rows: &SavedRows,
        (b, kv_head): (usize, usize),
        grads: &mut KvHeadGrads,
    ) {
        let groups = self.geometry.groups();
        let KvHeadGrads {
            query,
            key,
            value,
            sinks,
        } = grads;
        let BackwardScratch {
            block: block_scratch,
            transposed_key,
            transposed_value,
            dense_key,
        } = scratch;
        let transposed =
            self.transposed_head((transposed_key, Some(transposed_value)), (b, kv_head));
        let key_rows = self.dense_rows(dense_key, self.key.head(b, kv_head));
        for (group_index, query_grad) in query.iter_mut().enumerate() {
            let h = kv_head * groups + group_index;
            for queries in self.query_blocks() {
                let mut block_grads = BlockGrads {
                    query: query_grad.rows(queries.0, queries.1),
                    key: &mut *key,
                    value: &mut *value,
                    sink: match self.sinks {
                        Some(_) => sinks.get_mut(group_index),
                        None => None,
                    },
                };
                self.backward_query_block(
                    block_scratch,
                    rows,
                    ((b, h), transposed, key_rows),
                    queries,
                    &mut block_grads,
                );
            }
        }
    }

    /// One query block of head `(b, h)`: `P = exp(S - max) / Σ`, `dV += Pᵀ dO`,
    /// `dS = P ∘ (dO Vᵀ - D)` with `D = rowsum(P ∘ dO Vᵀ)` (times `1 - tanh²` under a soft
    /// cap), `dQ = scale · dS K`, `dK += scale · dSᵀ Q`, `d sink -= P_sink · D`.
    // Longer than most: the steps share the block's scratch buffers and views, and read best
    // in the order of the formulas above.
    fn backward_query_block(
        &self,
        scratch: &mut BackwardBlockScratch,
        rows: &SavedRows,
        ((b, h), transposed, key_rows): ((usize, usize), TransposedHead, Matrix),
        queries: (usize, usize),
        grads: &mut BlockGrads,
    ) {
        let (q_start, q_len) = queries;
        let keys = self.key_range(b, queries);
        if keys.is_empty() {
            // Zero query gradient rows; nothing reaches the keys or the sink (D = 0).
            for row in 0..q_len {
                grads.query.row(row).fill(0.0);
            }
            return;
        }
        let width = keys.len();
        let scale = self.params.scale as f32;
        let BackwardBlockScratch {
            probabilities,
            score_grads,
            cap_derivatives,
        } = scratch;
        let probabilities = self.score_block(
            probabilities,
            Some(cap_derivatives),
            (b, h),
            queries,
            (&keys, transposed.key),
        );
        let sink = self.sinks.map(|sinks| sinks[h]);
        let mut sink_probabilities = vec![0.0f32; q_len];
        for (row, row_p) in probabilities.chunks_exact_mut(width).enumerate() {
            let stats = rows.softmax_stats.row(b, h, q_start + row);
            let (max, inverse_sum) = (stats[0], stats[1]);
            simd::exp_shifted(row_p, max);
            row_p.iter_mut().for_each(|p| *p *= inverse_sum);
            if let Some(sink) = sink {
                sink_probabilities[row] = (sink - max).exp() * inverse_sum;
            }
        }
        let output_grad = rows.output_grad.head(b, h).rows(q_start, q_len);
        let probabilities = Matrix::new(probabilities, q_len, width, width, 1);
        gemm(
            &mut grads.value.rows(keys.start, width),
            true,
            probabilities.transposed(),
            output_grad,
            1.0,
        );
        let score_grads = grown(score_grads, q_len * width);
        let mut probability_grads = MatrixMut::from_slice(score_grads, q_len, width, width);
        gemm(
            &mut probability_grads,
            false,
            output_grad,
            transposed.value.columns(keys.start, width),
            1.0,
        );
        // D_i = Σ_j P_ij dP_ij from the row itself rather than FlashAttention-2's rowsum(dO ∘ O):
        // the two are equal in exact arithmetic, but this one is computed from the very dP the
        // row's dS subtracts it from, so a saturated row (P one-hot) gets dS = 0 exactly, as
        // autodiff through the explicit softmax does; dO · O, summed in another order, leaves
        // a rounding residue that large inputs amplify into the weight gradients. This kernel
        // holds a query block's whole rows, so the sum costs one pass over them.
        for (row, grad_row) in score_grads.chunks_exact_mut(width).enumerate() {
            let row_p = &probabilities.values[row * width..][..width];
            let row_dot = simd::dot(row_p, grad_row);
            simd::softmax_grad(grad_row, row_p, row_dot);
            if let Some(sink_grad) = grads.sink.as_deref_mut() {
                *sink_grad -= sink_probabilities[row] * row_dot;
            }
        }
        if self.params.softcap.is_some() {
            for (grad, derivative) in score_grads.iter_mut().zip(cap_derivatives.iter()) {
                *grad *= derivative;
            }
        }
        let score_grads = Matrix::new(score_grads, q_len, width, width, 1);
        let key = key_rows.rows(keys.start, width);
        let query = self.query.head(b, h).rows(q_start, q_len);
        gemm(&mut grads.query, false, score_grads, key, scale);
        gemm(
            &mut grads.key.rows(keys.start, width),
            true,
            score_grads.transposed(),
            query,
            scale,
        );
    }
}

/// One backward query block's gradient targets: its query rows, the whole key/value head, and
/// its head's sink logit.
struct BlockGrads<'q, 'k, 'b> {
    query: MatrixMut<'q>,
    key: &'k mut MatrixMut<'b>,
    value: &'k mut MatrixMut<'b>,
    sink: Option<&'k mut f32>,
}

/// Scores ← `cap · tanh(score / cap)`, and `derivatives` (if given) ← `1 - tanh²` of each.
fn soft_cap(scores: &mut [f32], cap: f32, derivatives: Option<&mut Vec<f32>>) {
    match derivatives {
        Some(derivatives) => {
            let start = derivatives.len();
            derivatives.resize(start + scores.len(), 0.0);
            simd::soft_cap_with_derivatives(scores, &mut derivatives[start..], cap);
        }
        None => simd::soft_cap(scores, cap),
    }
}

/// Turns one row of scores into `exp(score - max)` in place; returns the maximum and
/// `1 / Σ exp(score - max)`, the sum taking the head's sink logit (one more logit, with no
/// value) when there is one.
///
/// A row with no allowed key (and no sink) becomes zeros, with statistics (`f32::MIN`, 0)
/// that make every recomputed probability 0. A row holding NaN stays NaN, as in every other
/// path.
fn softmax_numerators(row: &mut [f32], sink: Option<f32>) -> (f32, f32) {
    let row_max = simd::max(row);
    if row_max == f32::NEG_INFINITY && row.iter().any(|score| score.is_nan()) {
        // `simd::max` skips NaN: tell an empty row from one of NaN scores.
        row.fill(f32::NAN);
        return (f32::NAN, f32::NAN);
    }
    let max = match sink {
        Some(sink) => row_max.max(sink),
        None => row_max,
    };
    if max == f32::NEG_INFINITY {
        row.fill(0.0);
        return (f32::MIN, 0.0);
    }
    let sum = simd::exp_shifted(row, max) + sink.map_or(0.0, |sink| (sink - max).exp());
    (max, 1.0 / sum)
}
