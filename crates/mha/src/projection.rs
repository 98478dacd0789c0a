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
#[cfg(any(feature = "flex", feature = "ndarray"))]
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, backend_extension};
use burn::nn::Linear;
use burn::tensor::{DType, Tensor};

use crate::flash::{FlashKernel, MaybeFloat, flash_kernel};

/// Backends with the projection op: the CPU backends whose f32 storage the native kernels read,
/// and autodiff over them.
#[cfg(any(feature = "flex", feature = "ndarray"))]
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
    ) -> FloatTensor<Self> {
        product::<Self>((x, false), (weight, false), bias.into_option())
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
    fn project_packed(
        x: FloatTensor<Self>,
        query_weight: FloatTensor<Self>,
        key_weight: FloatTensor<Self>,
        value_weight: FloatTensor<Self>,
        #[extension_type] query_bias: MaybeFloat<Self>,
        #[extension_type] key_bias: MaybeFloat<Self>,
        #[extension_type] value_bias: MaybeFloat<Self>,
    ) -> FloatTensor<Self> {
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

/// The products a projection and its gradients need, native where a backend has them.
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) trait ProjectionKernels: Backend {
    /// `lhs · rhs (+ bias)`, either factor transposed first (matrices `[1, 1, rows, columns]`).
    fn product(
        lhs: (FloatTensor<Self>, bool),
        rhs: (FloatTensor<Self>, bool),
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        product::<Self>(lhs, rhs, bias)
    }

    /// The sum of a matrix's rows, `[1, 1, 1, columns]`.
    fn row_sum(matrix: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_sum_dim(matrix, 2)
    }
}

/// Gives a CPU backend the native products of `flash/cpu.rs`, with the default ones for the
/// dtypes they do not take.
#[cfg(any(feature = "flex", feature = "ndarray"))]
macro_rules! native_projection {
    ($backend:ty) => {
        impl ProjectionKernels for $backend {
            fn product(
                lhs: (FloatTensor<Self>, bool),
                rhs: (FloatTensor<Self>, bool),
                bias: Option<FloatTensor<Self>>,
            ) -> FloatTensor<Self> {
                crate::flash::cpu_product::<Self>((&lhs.0, lhs.1), (&rhs.0, rhs.1), bias.as_ref())
                    .unwrap_or_else(|| product::<Self>(lhs, rhs, bias))
            }

            fn row_sum(matrix: FloatTensor<Self>) -> FloatTensor<Self> {
                crate::flash::cpu_row_sum::<Self>(&matrix)
                    .unwrap_or_else(|| Self::float_sum_dim(matrix, 2))
            }
        }

        impl ProjectionBackend for $backend {
            fn project(
                x: FloatTensor<Self>,
                weight: FloatTensor<Self>,
                bias: MaybeFloat<Self>,
            ) -> FloatTensor<Self> {
                <Self as ProjectionKernels>::product(
                    (x, false),
                    (weight, false),
                    bias.into_option(),
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
            ) -> FloatTensor<Self> {
                let parts = [
                    (query_weight, query_bias.into_option()),
                    (key_weight, key_bias.into_option()),
                    (value_weight, value_bias.into_option()),
                ];
                let borrowed = parts
                    .each_ref()
                    .map(|(weight, bias)| (weight, bias.as_ref()));
                crate::flash::cpu_packed_product::<Self>(&x, &borrowed)
                    .unwrap_or_else(|| packed_product::<Self>(x, parts))
            }
        }
    };
}

#[cfg(feature = "flex")]
native_projection!(burn::backend::Flex);
#[cfg(feature = "ndarray")]
native_projection!(burn::backend::NdArray);

/// The default body, and what the native one falls back to for another dtype.
#[cfg(any(feature = "flex", feature = "ndarray"))]
fn product<B: Backend>(
    (lhs, transpose_lhs): (FloatTensor<B>, bool),
    (rhs, transpose_rhs): (FloatTensor<B>, bool),
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let oriented = |matrix: FloatTensor<B>, transpose: bool| match transpose {
        true => B::float_swap_dims(matrix, 2, 3),
        false => matrix,
    };
    let product = B::float_matmul(oriented(lhs, transpose_lhs), oriented(rhs, transpose_rhs));
    match bias {
        Some(bias) => B::float_add(product, bias),
        None => product,
    }
}

/// The default body of [`ProjectionBackend::project_packed`]: each product, then one
/// concatenation.
#[cfg(any(feature = "flex", feature = "ndarray"))]
fn packed_product<B: Backend>(
    x: FloatTensor<B>,
    parts: [(FloatTensor<B>, Option<FloatTensor<B>>); 3],
) -> FloatTensor<B> {
    let products = parts
        .into_iter()
        .map(|(weight, bias)| product::<B>((x.clone(), false), (weight, false), bias))
        .collect();
    B::float_cat(products, 3)
}

/// Under autodiff the packed projection keeps the default body (Burn's own ops and their
/// backward): the module packs only where nothing is tracked, and trains through
/// [`ProjectionBackend::project`], whose backward is native.
#[cfg(any(feature = "flex", feature = "ndarray"))]
impl<B: ProjectionKernels, C: CheckpointStrategy> ProjectionBackend for Autodiff<B, C> {
    fn project(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: MaybeFloat<Self>,
    ) -> FloatTensor<Self> {
        let bias = bias.into_option();
        let [x_node, weight_node] = [x.node(), weight.node()];
        let operands = ProjectionOperands::<B> {
            x: x.into_primitive(),
            weight: weight.into_primitive(),
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

/// What a projection's backward reads: the factors of `x · W` (the bias's gradient needs none).
#[cfg(any(feature = "flex", feature = "ndarray"))]
#[derive(Debug, Clone)]
pub(crate) struct ProjectionOperands<B: Backend> {
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
}

/// Runs the forward and, when a parent is tracked, records the node that will run the
/// backward: parents x, weight, and the bias when there is one.
#[cfg(any(feature = "flex", feature = "ndarray"))]
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
            (operands.x.clone(), false),
            (operands.weight.clone(), false),
            bias,
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
#[cfg(any(feature = "flex", feature = "ndarray"))]
#[derive(Debug)]
pub(crate) struct ProjectionBackward<const N: usize>;

#[cfg(any(feature = "flex", feature = "ndarray"))]
impl<B: ProjectionKernels, const N: usize> Backward<B, N> for ProjectionBackward<N> {
    type State = ProjectionOperands<B>;

    /// `dx = dY · Wᵀ`, `dW = xᵀ · dY`, `db = Σ_rows dY`, each for a tracked parent only and
    /// registered once (what data-parallel training's per-parameter gradient sync counts on).
    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let output_grad = grads.consume::<B>(&ops.node);
        let ProjectionOperands { x, weight } = ops.state;
        #[cfg(test)]
        let mut registered = Vec::new();
        for (index, node) in ops.parents.into_iter().enumerate() {
            let Some(node) = node else { continue };
            let grad = match index {
                0 => B::product((output_grad.clone(), false), (weight.clone(), true), None),
                1 => B::product((x.clone(), true), (output_grad.clone(), false), None),
                _ => B::row_sum(output_grad.clone()),
            };
            #[cfg(test)]
            registered.push(node.id.value);
            grads.register::<B>(node.id, grad);
        }
        #[cfg(test)]
        crate::flash::registrations::record(
            ops.node
                .parents
                .iter()
                .map(|parent| parent.id.value)
                .collect(),
            registered,
        );
    }
}

#[cfg(not(any(feature = "flex", feature = "ndarray")))]
pub(crate) fn native_linear(_: &Linear, _: &Tensor<3>) -> Option<Tensor<3>> {
    None
}

/// `linear(x)`, `[batch, seq, d_output]`, through the projection op where it runs natively (an
/// f32 input on flex or ndarray, with or without autodiff); `None` elsewhere, for
/// `Linear::forward`.
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) fn native_linear(linear: &Linear, x: &Tensor<3>) -> Option<Tensor<3>> {
    if !runs_natively(x) {
        return None;
    }
    let [batch, seq, d_input] = x.dims();
    let (weight, bias, d_output) = operands(linear, d_input);
    let output = <burn::backend::Dispatch as ProjectionBackend>::project(rows_of(x), weight, bias);
    Some(Tensor::<4>::from_dispatch(output).reshape([batch, seq, d_output]))
}

/// Self-attention's three projections of `x`, side by side: `[batch, seq, d_query + d_key +
/// d_value]`, in one op and one pass over rayon's threads, where the projection op runs
/// natively and nothing is tracked (inference); `None` elsewhere, for three
/// [`native_linear`]s or `Linear::forward`s.
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) fn native_packed_linear(linears: [&Linear; 3], x: &Tensor<3>) -> Option<Tensor<3>> {
    if !runs_natively(x) || x.device().is_autodiff() {
        return None;
    }
    let [batch, seq, d_input] = x.dims();
    let [
        (query_weight, query_bias, d_query),
        (key_weight, key_bias, d_key),
        (value_weight, value_bias, d_value),
    ] = linears.map(|linear| operands(linear, d_input));
    let output = <burn::backend::Dispatch as ProjectionBackend>::project_packed(
        rows_of(x),
        query_weight,
        key_weight,
        value_weight,
        query_bias,
        key_bias,
        value_bias,
    );
    Some(Tensor::<4>::from_dispatch(output).reshape([batch, seq, d_query + d_key + d_value]))
}

/// Whether the projection op runs natively on `x`: an f32 input on a backend whose flash
/// kernel is this crate's native one.
#[cfg(any(feature = "flex", feature = "ndarray"))]
fn runs_natively(x: &Tensor<3>) -> bool {
    flash_kernel(&x.device()) == Some(FlashKernel::Native) && x.dtype() == DType::F32
}

/// `x` (`[batch, seq, d_input]`) as the op's `[1, 1, batch · seq, d_input]` matrix.
#[cfg(any(feature = "flex", feature = "ndarray"))]
fn rows_of(x: &Tensor<3>) -> FloatTensor<burn::backend::Dispatch> {
    let [batch, seq, d_input] = x.dims();
    x.clone()
        .reshape([1, 1, batch * seq, d_input])
        .into_dispatch()
}

/// `linear`'s weight and bias as the op takes them, and its output width.
///
/// # Panics
///
/// If the weight does not take inputs of width `d_input`.
#[cfg(any(feature = "flex", feature = "ndarray"))]
fn operands(
    linear: &Linear,
    d_input: usize,
) -> (
    FloatTensor<burn::backend::Dispatch>,
    MaybeFloat<burn::backend::Dispatch>,
    usize,
) {
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
    (weight, MaybeFloat::from_option(bias), d_output)
}

#[cfg(not(any(feature = "flex", feature = "ndarray")))]
pub(crate) fn native_packed_linear(_: [&Linear; 3], _: &Tensor<3>) -> Option<Tensor<3>> {
    None
}

#[cfg(all(test, feature = "flex", feature = "ndarray"))]
mod tests {
    use super::*;
    use burn::module::Module;
    use burn::nn::LinearConfig;
    use burn::tensor::{Device, Distribution, FloatDType};

    #[allow(deprecated)]
    fn devices() -> [Device; 2] {
        [Device::flex(), Device::ndarray()]
    }

    fn max_difference(actual: Tensor<3>, expected: Tensor<3>) -> f32 {
        (actual - expected).abs().max().into_scalar::<f32>()
    }

    /// The sizes `(seq, d_input, d_output)` the tests run: one below the threshold for rayon's
    /// threads, one above it whose rows do not split evenly between the threads.
    const SIZES: [(usize, usize, usize); 2] = [(7, 12, 20), (301, 128, 64)];

    /// The op equals `Linear::forward` with and without a bias, on a contiguous input and on a
    /// transposed view, on one thread and on several, on both CPU backends; for f64 it is not
    /// taken.
    #[test]
    fn the_native_projection_equals_linear() {
        for device in devices() {
            device.seed(41);
            for (bias, (seq, d_input, d_output)) in [true, false]
                .into_iter()
                .flat_map(|bias| SIZES.map(|size| (bias, size)))
            {
                let linear = LinearConfig::new(d_input, d_output)
                    .with_bias(bias)
                    .init(&device);
                let normal = Distribution::Normal(0.0, 1.0);
                let x = Tensor::<3>::random([2, seq, d_input], normal, &device);
                let transposed =
                    Tensor::<3>::random([2, d_input, seq], normal, &device).swap_dims(1, 2);
                for input in [x, transposed] {
                    let expected = linear.forward(input.clone());
                    // Output buffers NaN: an element the op does not write shows.
                    let actual = crate::flash::recycle::poison::with(|| {
                        native_linear(&linear, &input).expect("the native op runs")
                    });
                    let difference = max_difference(actual, expected);
                    assert!(
                        difference <= 1e-5,
                        "{device:?} bias {bias} seq {seq}: {difference}"
                    );
                }
            }
            let x = Tensor::<3>::zeros([1, 2, 12], &device);
            let linear = LinearConfig::new(12, 20).init(&device);
            assert!(native_linear(&linear, &x.cast(FloatDType::F64)).is_none());
        }
    }

    /// The packed op equals the three `Linear::forward`s side by side: with and without biases
    /// (and with one missing), parts of different widths (GQA's narrower key and value), on one
    /// thread and on several, on both CPU backends; it is not taken for f64 or under autodiff.
    #[test]
    fn the_packed_projection_equals_three_linears() {
        for device in devices() {
            device.seed(47);
            let biases = [
                [true, true, true],
                [false, false, false],
                [true, false, true],
            ];
            for (bias, (seq, d_input, d_output)) in biases
                .into_iter()
                .flat_map(|bias| SIZES.map(|size| (bias, size)))
            {
                let widths = [d_output, d_output / 2, d_output / 4 + 1];
                let linears = [0, 1, 2].map(|part| {
                    LinearConfig::new(d_input, widths[part])
                        .with_bias(bias[part])
                        .init(&device)
                });
                let linears = linears.each_ref();
                let x =
                    Tensor::<3>::random([2, seq, d_input], Distribution::Normal(0.0, 1.0), &device);
                let expected =
                    Tensor::cat(linears.map(|linear| linear.forward(x.clone())).into(), 2);
                // Output buffers NaN: an element the op does not write shows.
                let actual = crate::flash::recycle::poison::with(|| {
                    native_packed_linear(linears, &x).expect("the native op runs")
                });
                let difference = max_difference(actual, expected);
                assert!(
                    difference <= 1e-5,
                    "{device:?} biases {bias:?} seq {seq}: {difference}"
                );
            }
            let x = Tensor::<3>::zeros([1, 2, 12], &device);
            let linear = LinearConfig::new(12, 20).init(&device);
            let linears = [&linear, &linear, &linear];
            assert!(native_packed_linear(linears, &x.clone().cast(FloatDType::F64)).is_none());
            let tracked = LinearConfig::new(12, 20).init(&device.clone().autodiff());
            let x = Tensor::<3>::zeros([1, 2, 12], &device.autodiff());
            assert!(native_packed_linear([&tracked, &tracked, &tracked], &x).is_none());
        }
    }

    /// Under autodiff the op's output and the gradients of the input, the weight and the bias
    /// equal `Linear`'s (Burn's own backward), with and without a bias, for a contiguous and a
    /// transposed input, with the input tracked or not, on both CPU backends, each tracked
    /// parent's gradient registered exactly once (what data-parallel training's gradient sync
    /// counts); a frozen module gets no gradient through it.
    #[test]
    fn the_native_projection_trains_as_linear_does() {
        for device in devices() {
            let device = device.autodiff();
            device.seed(43);
            let cases = [
                (true, false, true),
                (false, false, true),
                (true, true, true),
                (true, false, false),
            ];
            let sized = SIZES
                .into_iter()
                .flat_map(|size| cases.map(|case| (size, case)));
            for ((seq, d_input, d_output), (bias, transposed, input_tracked)) in sized {
                let linear = LinearConfig::new(d_input, d_output)
                    .with_bias(bias)
                    .init(&device);
                let normal = Distribution::Normal(0.0, 1.0);
                let x = match transposed {
                    false => Tensor::<3>::random([2, seq, d_input], normal, &device),
                    true => Tensor::<3>::random([2, d_input, seq], normal, &device).swap_dims(1, 2),
                };
                // The gradients' rounding grows with the square root of the rows they sum.
                let tolerance = 1e-4 * ((2 * seq) as f32 / 14.0).sqrt();
                let x = x.set_require_grad(input_tracked);
                // A loss whose gradient differs per element, so that a transposed or summed
                // gradient cannot pass.
                let weights = Tensor::<3>::random([2, seq, d_output], normal, &device);
                // Output buffers NaN: an element the op does not write shows.
                let ours = crate::flash::recycle::poison::with(|| {
                    native_linear(&linear, &x).expect("the native op runs")
                });
                let burns = linear.forward(x.clone());
                let case = format!("{device:?} seq {seq} bias {bias} transposed {transposed}");
                assert!(
                    max_difference(ours.clone(), burns.clone()) <= 1e-5,
                    "{case}: output"
                );
                crate::flash::registrations::take();
                let ours = crate::flash::recycle::poison::with(|| {
                    (ours * weights.clone()).sum().backward()
                });
                let log = crate::flash::registrations::take();
                assert_eq!(log.len(), 1, "{case}: one projection node ran its backward");
                for (mut declared, mut registered) in log {
                    declared.sort_unstable();
                    registered.sort_unstable();
                    assert_eq!(registered, declared, "{case}: each parent registered once");
                }
                let burns = (burns * weights).sum().backward();
                let [actual, expected] = [&ours, &burns].map(|grads| {
                    linear
                        .weight
                        .grad(grads)
                        .expect("a weight gradient")
                        .unsqueeze()
                });
                let difference = max_difference(actual, expected);
                assert!(
                    difference <= tolerance,
                    "{case}: weight gradient off by {difference}"
                );
                if let Some(bias_param) = &linear.bias {
                    let [actual, expected] = [&ours, &burns]
                        .map(|grads| bias_param.grad(grads).expect("a bias gradient").unsqueeze());
                    let difference = max_difference(actual, expected);
                    assert!(
                        difference <= tolerance,
                        "{case}: bias gradient off by {difference}"
                    );
                }
                match input_tracked {
                    true => {
                        let [actual, expected] =
                            [&ours, &burns].map(|grads| x.grad(grads).expect("an input gradient"));
                        let difference = max_difference(actual, expected);
                        assert!(
                            difference <= tolerance,
                            "{case}: input gradient off by {difference}"
                        );
                    }
                    false => assert!(x.grad(&ours).is_none(), "{case}: untracked input"),
                }
            }
            let frozen = LinearConfig::new(12, 20).init(&device).no_grad();
            let x = Tensor::<3>::ones([1, 3, 12], &device).require_grad();
            let grads = native_linear(&frozen, &x).expect("runs").sum().backward();
            assert!(
                frozen.weight.grad(&grads).is_none(),
                "a frozen weight got a gradient"
            );
            assert!(x.grad(&grads).is_some(), "the input lost its gradient");
        }
    }
}
