//! The GELU (exact, `x · Φ(x)`, or its tanh approximation) as one op on the CPU backends' f32
//! storage, vectorised, with an autodiff node whose backward is one vectorised pass too.
//!
//! Why: flex computes each element's `erf` with a scalar call into its maths library; in the
//! serving example the feed-forward's GELU took 11% of the samples (`perf record`), about as
//! much as its two projections. Burn's tanh approximation is eight tensor ops.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, backend_extension};
use burn::tensor::{DType, Tensor};
use rayon::prelude::*;

use super::matrix::{HeadIndex, Matrix};
use super::simd;
use super::storage::{CpuStorage, native_storage};
use crate::execution::FreshOutputs;

/// Which GELU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GeluKind {
    /// `x · Φ(x)`, Φ the standard normal distribution function.
    Exact,
    /// `x · (1 + tanh(√(2/π) (x + 0.044715 x³))) / 2` (burn-nn's `Gelu { approximate: true }`,
    /// PyTorch's `approximate="tanh"`, GPT-2's).
    Tanh,
}

/// Backends with the GELU op: the CPU backends whose f32 storage it reads, and autodiff over
/// them.
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray"),
    Autodiff
)]
pub(crate) trait GeluBackend: Backend {
    /// The GELU of `kind` of each element.
    ///
    /// # Shapes
    ///
    /// - x: `[1, 1, rows, columns]`, f32
    /// - output: `[1, 1, rows, columns]`, contiguous
    fn gelu(x: FloatTensor<Self>, kind: GeluKind) -> FloatTensor<Self>;
}

/// What the GELU's forward and backward compute where they run natively.
pub(crate) trait GeluKernels: Backend {
    /// [`GeluBackend::gelu`].
    fn gelu_forward(x: FloatTensor<Self>, kind: GeluKind) -> FloatTensor<Self>;

    /// `grad` times the GELU's derivative at `x` (`Φ(x) + x · φ(x)` for the exact one), of
    /// the shapes of [`GeluBackend::gelu`].
    fn gelu_gradient(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        kind: GeluKind,
    ) -> FloatTensor<Self>;
}

macro_rules! native_gelu_backend {
    ($backend:ty) => {
        impl GeluKernels for $backend {
            fn gelu_forward(x: FloatTensor<Self>, kind: GeluKind) -> FloatTensor<Self> {
                elementwise::<Self>(&x, None, kind)
            }

            fn gelu_gradient(
                x: FloatTensor<Self>,
                grad: FloatTensor<Self>,
                kind: GeluKind,
            ) -> FloatTensor<Self> {
                elementwise::<Self>(&x, Some(&grad), kind)
            }
        }

        impl GeluBackend for $backend {
            fn gelu(x: FloatTensor<Self>, kind: GeluKind) -> FloatTensor<Self> {
                Self::gelu_forward(x, kind)
            }
        }
    };
}

#[cfg(feature = "flex")]
native_gelu_backend!(burn::backend::Flex);
#[cfg(feature = "ndarray")]
native_gelu_backend!(burn::backend::NdArray);

/// The GELU of `kind` of `x` where the op runs natively (an f32 tensor on flex or ndarray, with
/// or without autodiff); `None` elsewhere, for Burn's.
pub(crate) fn native_gelu(x: &Tensor<3>, kind: GeluKind) -> Option<Tensor<3>> {
    if !native_storage(&x.device()) || x.dtype() != DType::F32 {
        return None;
    }
    let [batch, seq, width] = x.dims();
    let rows = x
        .clone()
        .reshape([1, 1, batch * seq, width])
        .into_dispatch();
    let output = <Dispatch as GeluBackend>::gelu(rows, kind);
    Some(Tensor::<4>::from_dispatch(output).reshape([batch, seq, width]))
}

/// Passes over at least this many elements go to rayon's threads: below it (a decoding
/// step's rows), waking the workers costs more than the pass.
const PARALLEL_ELEMENTS: usize = 1 << 16;

/// The GELU of `x` (`grad` absent), or the gradient it passes back for `grad`, each row
/// written whole into a contiguous output.
///
/// # Panics
///
/// If the tensors are not f32 `[1, 1, rows, columns]` of one shape.
fn elementwise<B: CpuStorage>(
    x: &FloatTensor<B>,
    grad: Option<&FloatTensor<B>>,
    kind: GeluKind,
) -> FloatTensor<B> {
    let readable = |tensor: &FloatTensor<B>| B::readable(tensor).expect("GELU: an f32 tensor");
    let readable_x = readable(x);
    let readable_grad = grad.map(readable);
    let x = rows_of::<B>(&readable_x);
    let grad = readable_grad.as_ref().map(rows_of::<B>);
    if let Some(grad) = &grad {
        assert!(
            grad.rows == x.rows && grad.columns == x.columns,
            "GELU: a gradient of {}x{} for an input of {}x{}",
            grad.rows,
            grad.columns,
            x.rows,
            x.columns
        );
    }
    let (rows, columns) = (x.rows, x.columns);
    let mut output = B::output_buffer(rows * columns, FreshOutputs::Unspecified);
    let mut scratch = Vec::new();
    let pass = |row: usize, out: &mut [f32], scratch: &mut Vec<f32>| match &grad {
        None => {
            x.copy_row(row, out);
            simd::gelu(out, kind == GeluKind::Tanh);
        }
        Some(grad) => {
            grad.copy_row(row, out);
            simd::gelu_grad(out, x.row_or_copy(row, scratch), kind == GeluKind::Tanh);
        }
    };
    if columns > 0 && output.len() >= PARALLEL_ELEMENTS {
        output
            .par_chunks_mut(columns)
            .enumerate()
            .for_each_init(Vec::new, |scratch, (row, out)| pass(row, out, scratch));
    } else if columns > 0 {
        for (row, out) in output.chunks_mut(columns).enumerate() {
            pass(row, out, &mut scratch);
        }
    }
    B::contiguous(output, [1, 1, rows, columns])
}

/// The matrix of a readable `[1, 1, rows, columns]` tensor.
fn rows_of<B: CpuStorage>(readable: &FloatTensor<B>) -> Matrix<'_> {
    let view = B::heads_view(readable).expect("GELU: a readable layout");
    let [batch, heads, _, _] = view.shape();
    assert!(
        batch == 1 && heads == 1,
        "GELU: a [1, 1, rows, columns] tensor, got {:?}",
        view.shape()
    );
    view.head(HeadIndex { batch: 0, head: 0 })
}

/// Under autodiff the GELU's backward is the native gradient pass over the saved input.
impl<B: GeluKernels, C: CheckpointStrategy> GeluBackend for Autodiff<B, C> {
    fn gelu(x: FloatTensor<Self>, kind: GeluKind) -> FloatTensor<Self> {
        match GeluBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let x = x.into_primitive();
                let output = B::gelu_forward(x.clone(), kind);
                prep.finish((x, kind), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::gelu_forward(x.into_primitive(), kind)),
        }
    }
}

/// The GELU's autodiff node: one parent, its input and the GELU's kind (the state).
#[derive(Debug)]
struct GeluBackward;

impl<B: GeluKernels> Backward<B, 1> for GeluBackward {
    type State = (FloatTensor<B>, GeluKind);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let output_grad = grads.consume::<B>(&ops.node);
        let [parent] = ops.parents;
        if let Some(parent) = parent {
            let (x, kind) = ops.state;
            grads.register::<B>(parent.id, B::gelu_gradient(x, output_grad, kind));
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::DType;
    use burn::tensor::activation::{gelu, gelu_approximate};
    use burn::tensor::{Device, Distribution, Tolerance};

    use super::*;

    /// Inputs across GELU's range: both tails, around 0, and random ones, as a `[2, rows, 40]`
    /// tensor, read through strides where `transposed`.
    fn inputs(device: &Device, transposed: bool) -> Tensor<3> {
        let swept: Vec<f32> = (0..80).map(|i| -12.0 + 0.3 * i as f32).collect();
        let swept = Tensor::<1>::from_data(swept.as_slice(), device).reshape([2, 1, 40]);
        let random = Tensor::<3>::random([2, 6, 40], Distribution::Normal(0.0, 2.0), device);
        let x = Tensor::cat(vec![swept, random], 1);
        if transposed {
            Tensor::<3>::from_data(x.swap_dims(1, 2).into_data(), device).swap_dims(1, 2)
        } else {
            x
        }
    }

    /// The GELU of `kind` of `x`'s values and its gradient for `weights` (of `sum(weights ·
    /// gelu(x))`), computed in f64 by Burn on flex (its maths library's `erf` and `tanh`), as
    /// f32 on `device`.
    fn reference(
        x: &Tensor<3>,
        weights: &Tensor<3>,
        kind: GeluKind,
        device: &Device,
    ) -> [Tensor<3>; 2] {
        let f64_on_flex = |tensor: &Tensor<3>| {
            Tensor::<3>::from_data(tensor.to_data(), (&Device::flex().autodiff(), DType::F64))
        };
        let x = f64_on_flex(x).require_grad();
        let output = match kind {
            GeluKind::Exact => gelu(x.clone()),
            GeluKind::Tanh => gelu_approximate(x.clone()),
        };
        let grads = (output.clone() * f64_on_flex(weights)).sum().backward();
        let as_f32 = |tensor: Tensor<3>| {
            Tensor::<3>::from_data(tensor.inner().into_data(), (device, DType::F32))
        };
        [
            as_f32(output),
            as_f32(x.grad(&grads).expect("x is tracked")),
        ]
    }

    /// The native GELU (both kinds) and its gradient under autodiff give the f64 reference's
    /// values, on flex and ndarray, contiguous or strided. (Burn's own f32 GELU on ndarray is
    /// not held to: its gradient is off by up to 1e-3, e.g. -0.08610 for -0.08523 at x = -2.)
    #[test]
    fn the_native_gelu_and_its_gradient_equal_the_f64_reference() {
        // ndarray is deprecated in Burn 0.22 but still one of the two native backends.
        #[allow(deprecated)]
        let devices = [Device::flex(), Device::ndarray()];
        for device in devices {
            for (kind, transposed) in [
                (GeluKind::Exact, false),
                (GeluKind::Exact, true),
                (GeluKind::Tanh, false),
                (GeluKind::Tanh, true),
            ] {
                let x = inputs(&device, transposed);
                let weights = Tensor::<3>::random(x.dims(), Distribution::Default, &device);
                let [expected_output, expected_grad] = reference(&x, &weights, kind, &device);
                let ours = native_gelu(&x, kind).expect("a CPU backend runs the GELU natively");
                let tolerance = Tolerance::rel_abs(1e-5, 1e-6);
                ours.into_data()
                    .assert_approx_eq::<f32>(&expected_output.into_data(), tolerance);
                let tracked = x.clone().autodiff().require_grad();
                let output = native_gelu(&tracked, kind).expect("native");
                let grads = (output * weights.clone().autodiff()).sum().backward();
                let grad = tracked.grad(&grads).expect("x is tracked");
                grad.into_data()
                    .assert_approx_eq::<f32>(&expected_grad.into_data(), tolerance);
            }
        }
    }

    #[test]
    fn the_native_gelu_keeps_nan_and_infinities() {
        let x = Tensor::<1>::from_data([f32::NAN, f32::INFINITY, 0.0], &Device::flex())
            .reshape([1, 1, 3]);
        for kind in [GeluKind::Exact, GeluKind::Tanh] {
            let values = native_gelu(&x, kind)
                .expect("native")
                .into_data()
                .to_vec::<f32>()
                .expect("f32");
            assert!(values[0].is_nan(), "{kind:?}");
            assert_eq!(values[1..], [f32::INFINITY, 0.0], "{kind:?}");
        }
    }
}
