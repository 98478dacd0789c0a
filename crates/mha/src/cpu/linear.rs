//! `x · W + b` on the CPU backends' f32 storage, as one op that writes a buffer the result then
//! owns, with an autodiff node whose backward does the same for `dx`, `dW` and `db`.
//!
//! Burn's `Linear` on flex is a matmul and a bias add, each with a fresh output, and burn-flex
//! 0.22.1 allocates every output as a zeroed `Vec<u8>` copied into an aligned allocation
//! (`FlexTensor::empty`): a `memcpy` and twice the page faults per projection, 16% of a
//! forward at batch 8, 128 tokens, d_model 256 (`perf record`). Here the bias is written into
//! the output rows and the product accumulated onto it by one GEMM; in training the input and
//! weight gradients are one GEMM each on strided views (no transposed copies), and the bias
//! gradient one pass over the rows.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, backend_extension};
use burn::nn::Linear;
use burn::tensor::{DType, Tensor};
use rayon::prelude::*;

use super::matrix::{HeadIndex, Matrix, MatrixMut, Write, gemm_on};
use super::storage::{CpuStorage, native_storage};
use crate::execution::{Body, Execution};
use crate::extension::MaybeFloat;

/// Backends with the projection op: the CPU backends whose f32 storage the native kernels read,
/// and autodiff over them.
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray"),
    Autodiff
)]
pub(crate) trait ProjectionBackend: Backend {
    /// `x · weight + bias`.
    ///
    /// # Shapes
    ///
    /// - x: `[1, 1, rows, d_input]`
    /// - weight: `[1, 1, d_input, d_output]`
    /// - bias: `[1, 1, 1, d_output]`
    /// - output: `[1, 1, rows, d_output]`, contiguous
    fn project(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        #[extension_type] bias: MaybeFloat<Self>,
        execution: Execution,
    ) -> FloatTensor<Self> {
        let _ = execution;
        product::<Self>(Factor::as_is(x), Factor::as_is(weight), bias.into_option())
    }

    /// `[x · Wq + bq | x · Wk + bk | x · Wv + bv]`: self-attention's three projections of one
    /// input, side by side in one output.
    ///
    /// # Shapes
    ///
    /// - x: `[1, 1, rows, d_input]`
    /// - query_weight, key_weight, value_weight: `[1, 1, d_input, d_query]`, `d_key`, `d_value`
    /// - query_bias, key_bias, value_bias: `[1, 1, 1, d_query]`, `d_key`, `d_value`
    /// - output: `[1, 1, rows, d_query + d_key + d_value]`, contiguous
    // Eight arguments: the macro maps tensors and enums of tensors one by one, not arrays.
    #[allow(clippy::too_many_arguments)]
    fn project_packed(
        x: FloatTensor<Self>,
        query_weight: FloatTensor<Self>,
        key_weight: FloatTensor<Self>,
        value_weight: FloatTensor<Self>,
        #[extension_type] query_bias: MaybeFloat<Self>,
        #[extension_type] key_bias: MaybeFloat<Self>,
        #[extension_type] value_bias: MaybeFloat<Self>,
        execution: Execution,
    ) -> FloatTensor<Self> {
        let _ = execution;
        packed_product::<Self>(
            x,
            [
                (query_weight, query_bias.into_option()),
                (key_weight, key_bias.into_option()),
                (value_weight, value_bias.into_option()),
            ],
        )
    }
}

/// How a product reads one of its factors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Orientation {
    AsIs,
    Transposed,
}

/// A factor of a product (a `[1, 1, rows, columns]` tensor) and how it is read.
#[derive(Clone, Debug)]
pub(crate) struct Factor<T> {
    pub matrix: T,
    pub orientation: Orientation,
}

impl<T> Factor<T> {
    pub fn as_is(matrix: T) -> Self {
        Self {
            matrix,
            orientation: Orientation::AsIs,
        }
    }

    pub fn transposed(matrix: T) -> Self {
        Self {
            matrix,
            orientation: Orientation::Transposed,
        }
    }
}

/// The products a projection and its gradients need, native where a backend has them.
pub(crate) trait ProjectionKernels: Backend {
    /// `lhs · rhs (+ bias)`.
    fn product(
        lhs: Factor<FloatTensor<Self>>,
        rhs: Factor<FloatTensor<Self>>,
        bias: Option<FloatTensor<Self>>,
        execution: &Execution,
    ) -> FloatTensor<Self> {
        let _ = execution;
        product::<Self>(lhs, rhs, bias)
    }

    /// The sum of a matrix's rows, `[1, 1, 1, columns]`.
    fn row_sum(matrix: FloatTensor<Self>, execution: &Execution) -> FloatTensor<Self> {
        let _ = execution;
        Self::float_sum_dim(matrix, 2)
    }
}

/// Gives a CPU backend the native products below, with the default ones for the dtypes they do
/// not take and where the execution asks for the generic body.
macro_rules! native_projection {
    ($backend:ty) => {
        impl ProjectionKernels for $backend {
            fn product(
                lhs: Factor<FloatTensor<Self>>,
                rhs: Factor<FloatTensor<Self>>,
                bias: Option<FloatTensor<Self>>,
                execution: &Execution,
            ) -> FloatTensor<Self> {
                let native = match execution.body {
                    Body::Native => native_product::<Self>(&lhs, &rhs, bias.as_ref(), execution),
                    Body::Generic => None,
                };
                native.unwrap_or_else(|| product::<Self>(lhs, rhs, bias))
            }

            fn row_sum(matrix: FloatTensor<Self>, execution: &Execution) -> FloatTensor<Self> {
                let native = match execution.body {
                    Body::Native => native_row_sum::<Self>(&matrix),
                    Body::Generic => None,
                };
                native.unwrap_or_else(|| Self::float_sum_dim(matrix, 2))
            }
        }

        impl ProjectionBackend for $backend {
            fn project(
                x: FloatTensor<Self>,
                weight: FloatTensor<Self>,
                bias: MaybeFloat<Self>,
                execution: Execution,
            ) -> FloatTensor<Self> {
                <Self as ProjectionKernels>::product(
                    Factor::as_is(x),
                    Factor::as_is(weight),
                    bias.into_option(),
                    &execution,
                )
            }

            fn project_packed(
                x: FloatTensor<Self>,
                query_weight: FloatTensor<Self>,
                key_weight: FloatTensor<Self>,
                value_weight: FloatTensor<Self>,
                query_bias: MaybeFloat<Self>,
                key_bias: MaybeFloat<Self>,
                value_bias: MaybeFloat<Self>,
                execution: Execution,
            ) -> FloatTensor<Self> {
                let parts = [
                    (query_weight, query_bias.into_option()),
                    (key_weight, key_bias.into_option()),
                    (value_weight, value_bias.into_option()),
                ];
                let borrowed = parts
                    .each_ref()
                    .map(|(weight, bias)| (weight, bias.as_ref()));
                let native = match execution.body {
                    Body::Native => native_packed_product::<Self>(&x, &borrowed, &execution),
                    Body::Generic => None,
                };
                native.unwrap_or_else(|| packed_product::<Self>(x, parts))
            }
        }
    };
}

#[cfg(feature = "flex")]
native_projection!(burn::backend::Flex);
#[cfg(feature = "ndarray")]
native_projection!(burn::backend::NdArray);

/// The default body, and what the native one falls back to for another dtype.
fn product<B: Backend>(
    lhs: Factor<FloatTensor<B>>,
    rhs: Factor<FloatTensor<B>>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let oriented = |factor: Factor<FloatTensor<B>>| match factor.orientation {
        Orientation::Transposed => B::float_swap_dims(factor.matrix, 2, 3),
        Orientation::AsIs => factor.matrix,
    };
    let product = B::float_matmul(oriented(lhs), oriented(rhs));
    match bias {
        Some(bias) => B::float_add(product, bias),
        None => product,
    }
}

/// The default body of [`ProjectionBackend::project_packed`]: each product, then one
/// concatenation.
fn packed_product<B: Backend>(
    x: FloatTensor<B>,
    parts: [(FloatTensor<B>, Option<FloatTensor<B>>); 3],
) -> FloatTensor<B> {
    let products = parts
        .into_iter()
        .map(|(weight, bias)| product::<B>(Factor::as_is(x.clone()), Factor::as_is(weight), bias))
        .collect();
    B::float_cat(products, 3)
}

/// The matrix of a readable `[1, 1, rows, columns]` tensor.
fn matrix_of<B: CpuStorage>(readable: &FloatTensor<B>) -> Option<Matrix<'_>> {
    Some(B::heads_view(readable)?.head(HeadIndex { batch: 0, head: 0 }))
}

/// The row of a readable `[1, 1, 1, columns]` tensor.
fn row_of<B: CpuStorage>(readable: &FloatTensor<B>) -> Option<&[f32]> {
    Some(B::heads_view(readable)?.row(HeadIndex { batch: 0, head: 0 }, 0))
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
fn native_product<B: CpuStorage>(
    lhs: &Factor<FloatTensor<B>>,
    rhs: &Factor<FloatTensor<B>>,
    bias: Option<&FloatTensor<B>>,
    execution: &Execution,
) -> Option<FloatTensor<B>> {
    let [lhs_tensor, rhs_tensor] = [B::readable(&lhs.matrix)?, B::readable(&rhs.matrix)?];
    let bias = match bias {
        Some(bias) => Some(B::readable(bias)?),
        None => None,
    };
    fn oriented(matrix: Matrix<'_>, orientation: Orientation) -> Matrix<'_> {
        match orientation {
            Orientation::Transposed => matrix.transposed(),
            Orientation::AsIs => matrix,
        }
    }
    let lhs = oriented(matrix_of::<B>(&lhs_tensor)?, lhs.orientation);
    let rhs = oriented(matrix_of::<B>(&rhs_tensor)?, rhs.orientation);
    let bias = match &bias {
        Some(bias) => Some(row_of::<B>(bias)?),
        None => None,
    };
    let (rows, columns) = (lhs.rows, rhs.columns);
    let output = products_side_by_side::<B>(lhs, &[Part { rhs, bias }], execution);
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
fn native_packed_product<B: CpuStorage>(
    x: &FloatTensor<B>,
    weights: &[(&FloatTensor<B>, Option<&FloatTensor<B>>)],
    execution: &Execution,
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
            Some(bias) => Some(row_of::<B>(bias)?),
            None => None,
        };
        parts.push(Part {
            rhs: matrix_of::<B>(weight)?,
            bias,
        });
    }
    let x = matrix_of::<B>(&x)?;
    let (rows, columns) = (x.rows, parts.iter().map(|part| part.rhs.columns).sum());
    let output = products_side_by_side::<B>(x, &parts, execution);
    Some(B::contiguous(output, [1, 1, rows, columns]))
}

/// One part of [`products_side_by_side`]: `lhs · rhs (+ bias in every row)`.
#[derive(Clone, Copy)]
struct Part<'a> {
    rhs: Matrix<'a>,
    bias: Option<&'a [f32]>,
}

/// The products of at least this many multiply-adds go to rayon's threads: below it, waking
/// the workers costs more than it saves.
const PARALLEL_MULTIPLY_ADDS: usize = 1 << 21;

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
    parts: &[Part],
    execution: &Execution,
) -> Vec<f32> {
    for part in parts {
        assert_eq!(
            part.rhs.rows, lhs.columns,
            "projection: a {}x{} by {}x{} product",
            lhs.rows, lhs.columns, part.rhs.rows, part.rhs.columns
        );
        if let Some(bias) = part.bias {
            assert_eq!(
                bias.len(),
                part.rhs.columns,
                "projection: a bias of {} for {} outputs",
                bias.len(),
                part.rhs.columns
            );
        }
    }
    let rows = lhs.rows;
    let columns: usize = parts.iter().map(|part| part.rhs.columns).sum();
    // Every element is written: the bias rows, or the product alone.
    let mut output = B::output_buffer(rows * columns, execution.fresh_outputs);
    let threads = rayon::current_num_threads();
    let parallel = rows * columns * lhs.columns >= PARALLEL_MULTIPLY_ADDS;
    let write_rows = |block: &mut [f32], lhs: Matrix, parallelism| {
        let mut block = MatrixMut::dense(block, lhs.rows, columns);
        let mut first_column = 0;
        for part in parts {
            let mut columns = block.columns(first_column, part.rhs.columns);
            product_into(&mut columns, lhs, *part, parallelism);
            first_column += part.rhs.columns;
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
        let parallelism = if parallel {
            gemm::Parallelism::Rayon(0)
        } else {
            gemm::Parallelism::None
        };
        write_rows(&mut output, lhs, parallelism);
    }
    output
}

/// `dst ← lhs · rhs (+ bias in every row)`.
fn product_into(dst: &mut MatrixMut, lhs: Matrix, part: Part, parallelism: gemm::Parallelism) {
    let write = match part.bias {
        Some(bias) => {
            for row in 0..dst.rows {
                dst.row(row).copy_from_slice(bias);
            }
            Write::Accumulate
        }
        None => Write::Overwrite,
    };
    gemm_on(dst, write, lhs, part.rhs, 1.0, parallelism);
}

/// The sum of a `[1, 1, rows, columns]` f32 matrix's rows, `[1, 1, 1, columns]` (a
/// projection's bias gradient); `None` for inputs it does not take.
fn native_row_sum<B: CpuStorage>(matrix: &FloatTensor<B>) -> Option<FloatTensor<B>> {
    let readable = B::readable(matrix)?;
    let matrix = matrix_of::<B>(&readable)?;
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

/// Under autodiff the packed projection keeps the default body (Burn's own ops and their
/// backward): the module packs only where nothing is tracked, and trains through
/// [`ProjectionBackend::project`], whose backward is native.
impl<B: ProjectionKernels, C: CheckpointStrategy> ProjectionBackend for Autodiff<B, C> {
    fn project(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: MaybeFloat<Self>,
        execution: Execution,
    ) -> FloatTensor<Self> {
        let bias = bias.into_option();
        let [x_node, weight_node] = [x.node(), weight.node()];
        let operands = ProjectionOperands::<B> {
            x: x.into_primitive(),
            weight: weight.into_primitive(),
            execution,
        };
        match bias {
            None => record::<B, C, 2>([x_node, weight_node], operands, None),
            Some(bias) => {
                let nodes = [x_node, weight_node, bias.node()];
                record::<B, C, 3>(nodes, operands, Some(bias.into_primitive()))
            }
        }
    }
}

/// What a projection's backward reads: the factors of `x · W` (the bias's gradient needs none)
/// and how the call runs.
#[derive(Debug, Clone)]
pub(crate) struct ProjectionOperands<B: Backend> {
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    execution: Execution,
}

/// Runs the forward and, when a parent is tracked, records the node that will run the
/// backward: parents x, weight, and the bias when there is one.
fn record<B: ProjectionKernels, C: CheckpointStrategy, const N: usize>(
    nodes: [burn::backend::autodiff::ops::NodeGuard; N],
    operands: ProjectionOperands<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<Autodiff<B, C>>
where
    ProjectionBackward<N>: Backward<B, N, State = ProjectionOperands<B>>,
{
    let forward = |operands: &ProjectionOperands<B>| {
        B::product(
            Factor::as_is(operands.x.clone()),
            Factor::as_is(operands.weight.clone()),
            bias,
            &operands.execution,
        )
    };
    match ProjectionBackward::<N>
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let output = forward(&operands);
            prep.finish(operands, output)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(&operands)),
    }
}

/// The projection's autodiff node over `N` parents: x, weight, and the bias when there is one.
#[derive(Debug)]
pub(crate) struct ProjectionBackward<const N: usize>;

impl<B: ProjectionKernels, const N: usize> Backward<B, N> for ProjectionBackward<N> {
    type State = ProjectionOperands<B>;

    /// `dx = dY · Wᵀ`, `dW = xᵀ · dY`, `db = Σ_rows dY`, each for a tracked parent only and
    /// registered once (what data-parallel training's per-parameter gradient sync counts on).
    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let output_grad = grads.consume::<B>(&ops.node);
        let ProjectionOperands {
            x,
            weight,
            execution,
        } = ops.state;
        let declared = ops
            .node
            .parents
            .iter()
            .map(|parent| parent.id.value)
            .collect();
        let mut registered = Vec::new();
        for (index, node) in ops.parents.into_iter().enumerate() {
            let Some(node) = node else { continue };
            let grad = match index {
                0 => B::product(
                    Factor::as_is(output_grad.clone()),
                    Factor::transposed(weight.clone()),
                    None,
                    &execution,
                ),
                1 => B::product(
                    Factor::transposed(x.clone()),
                    Factor::as_is(output_grad.clone()),
                    None,
                    &execution,
                ),
                _ => B::row_sum(output_grad.clone(), &execution),
            };
            registered.push(node.id.value);
            grads.register::<B>(node.id, grad);
        }
        execution.note_registered(declared, registered);
    }
}

/// `linear(x)`, `[batch, seq, d_output]`, through the projection op where it runs natively (an
/// f32 input on flex or ndarray, with or without autodiff); `None` elsewhere, for
/// `Linear::forward`.
pub(crate) fn native_linear(linear: &Linear, x: &Tensor<3>) -> Option<Tensor<3>> {
    native_linear_with(linear, x, Execution::default())
}

/// [`native_linear`] run as `execution` says.
pub(crate) fn native_linear_with(
    linear: &Linear,
    x: &Tensor<3>,
    execution: Execution,
) -> Option<Tensor<3>> {
    if !runs_natively(x) {
        return None;
    }
    let [batch, seq, d_input] = x.dims();
    let operands = operands(linear, d_input);
    let output = <Dispatch as ProjectionBackend>::project(
        rows_of(x),
        operands.weight,
        operands.bias,
        execution,
    );
    Some(Tensor::<4>::from_dispatch(output).reshape([batch, seq, operands.d_output]))
}

/// Self-attention's three projections of `x`, side by side: `[batch, seq, d_query + d_key +
/// d_value]`, in one op and one pass over rayon's threads, where the projection op runs
/// natively and nothing is tracked (inference); `None` elsewhere, for three
/// [`native_linear`]s or `Linear::forward`s.
pub(crate) fn native_packed_linear(linears: [&Linear; 3], x: &Tensor<3>) -> Option<Tensor<3>> {
    native_packed_linear_with(linears, x, Execution::default())
}

/// [`native_packed_linear`] run as `execution` says.
pub(crate) fn native_packed_linear_with(
    linears: [&Linear; 3],
    x: &Tensor<3>,
    execution: Execution,
) -> Option<Tensor<3>> {
    if !runs_natively(x) || x.device().is_autodiff() {
        return None;
    }
    let [batch, seq, d_input] = x.dims();
    let [query, key, value] = linears.map(|linear| operands(linear, d_input));
    let width = query.d_output + key.d_output + value.d_output;
    let output = <Dispatch as ProjectionBackend>::project_packed(
        rows_of(x),
        query.weight,
        key.weight,
        value.weight,
        query.bias,
        key.bias,
        value.bias,
        execution,
    );
    Some(Tensor::<4>::from_dispatch(output).reshape([batch, seq, width]))
}

/// Whether the projection op runs natively on `x`: an f32 input on a backend whose storage the
/// CPU kernels read.
fn runs_natively(x: &Tensor<3>) -> bool {
    native_storage(&x.device()) && x.dtype() == DType::F32
}

/// `x` (`[batch, seq, d_input]`) as the op's `[1, 1, batch · seq, d_input]` matrix.
fn rows_of(x: &Tensor<3>) -> FloatTensor<Dispatch> {
    let [batch, seq, d_input] = x.dims();
    x.clone()
        .reshape([1, 1, batch * seq, d_input])
        .into_dispatch()
}

/// A `Linear`'s weight and bias as the op takes them, and its output width.
struct Operands {
    weight: FloatTensor<Dispatch>,
    bias: MaybeFloat<Dispatch>,
    d_output: usize,
}

/// `linear`'s [`Operands`].
///
/// # Panics
///
/// If the weight does not take inputs of width `d_input`.
fn operands(linear: &Linear, d_input: usize) -> Operands {
    let [weight_rows, d_output] = linear.weight.dims();
    assert_eq!(
        weight_rows, d_input,
        "MultiHeadAttention: a projection of width {weight_rows} got an input of width {d_input}"
    );
    let weight = linear
        .weight
        .val()
        .reshape([1, 1, d_input, d_output])
        .into_dispatch();
    let bias = linear
        .bias
        .as_ref()
        .map(|bias| bias.val().reshape([1, 1, 1, d_output]).into_dispatch());
    Operands {
        weight,
        bias: MaybeFloat::from_option(bias),
        d_output,
    }
}

#[cfg(all(test, feature = "flex", feature = "ndarray"))]
mod tests;
