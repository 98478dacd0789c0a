//! `x · W + b` for inference on the CPU backends' f32 storage, as one op that writes a buffer
//! the result then owns.
//!
//! Burn's `Linear` on flex is a matmul and a bias add, each with a fresh output, and burn-flex
//! 0.22.1 allocates every output as a zeroed `Vec<u8>` copied into an aligned allocation
//! (`FlexTensor::empty`): a `memcpy` and twice the page faults per projection, 16% of a
//! forward at batch 8, 128 tokens, d_model 256 (`perf record`). Here the bias is written into
//! the output rows and the product accumulated onto it by one GEMM.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, backend_extension};
use burn::nn::Linear;
use burn::tensor::{DType, Tensor};

use crate::flash::{FlashKernel, MaybeFloat, flash_kernel};

/// Backends with the projection op: the CPU backends whose f32 storage the native kernels read.
#[cfg(any(feature = "flex", feature = "ndarray"))]
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray")
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
        generic::<Self>(x, weight, bias.into_option())
    }
}

/// Gives a CPU backend the native body of `flash/cpu.rs`, with the default one for the dtypes
/// it does not take.
#[cfg(any(feature = "flex", feature = "ndarray"))]
macro_rules! native_projection {
    ($backend:ty) => {
        impl ProjectionBackend for $backend {
            fn project(
                x: FloatTensor<Self>,
                weight: FloatTensor<Self>,
                bias: MaybeFloat<Self>,
            ) -> FloatTensor<Self> {
                let bias = bias.into_option();
                crate::flash::cpu_project::<Self>(&x, &weight, bias.as_ref())
                    .unwrap_or_else(|| generic::<Self>(x, weight, bias))
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
fn generic<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let product = B::float_matmul(x, weight);
    match bias {
        Some(bias) => B::float_add(product, bias),
        None => product,
    }
}

#[cfg(not(any(feature = "flex", feature = "ndarray")))]
pub(crate) fn native_linear(_: &Linear, _: &Tensor<3>) -> Option<Tensor<3>> {
    None
}

/// `linear(x)`, `[batch, seq, d_output]`, through the projection op where it runs natively (an
/// f32 input on flex or ndarray without autodiff); `None` elsewhere, for `Linear::forward`.
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) fn native_linear(linear: &Linear, x: &Tensor<3>) -> Option<Tensor<3>> {
    let device = x.device();
    if device.is_autodiff()
        || flash_kernel(&device) != Some(FlashKernel::Native)
        || x.dtype() != DType::F32
    {
        return None;
    }
    let [batch, seq, d_input] = x.dims();
    let [weight_rows, d_output] = linear.weight.dims();
    assert_eq!(
        weight_rows, d_input,
        "MultiHeadAttention: a projection of width {weight_rows} got an input of width {d_input}"
    );
    let bias = linear
        .bias
        .as_ref()
        .map(|bias| bias.val().reshape([1, 1, 1, d_output]).into_dispatch());
    let output = <burn::backend::Dispatch as ProjectionBackend>::project(
        x.clone()
            .reshape([1, 1, batch * seq, d_input])
            .into_dispatch(),
        linear
            .weight
            .val()
            .reshape([1, 1, d_input, d_output])
            .into_dispatch(),
        MaybeFloat::from_option(bias),
    );
    Some(Tensor::<4>::from_dispatch(output).reshape([batch, seq, d_output]))
}

#[cfg(all(test, feature = "flex", feature = "ndarray"))]
mod tests {
    use super::*;
    use burn::nn::LinearConfig;
    use burn::tensor::{Device, Distribution};

    /// The op equals `Linear::forward` with and without a bias, on a contiguous input and on a
    /// transposed view, on both CPU backends; under autodiff and for f64 it is not taken.
    #[test]
    fn the_native_projection_equals_linear() {
        #[allow(deprecated)]
        let devices = [Device::flex(), Device::ndarray()];
        for device in devices {
            device.seed(41);
            for bias in [true, false] {
                let linear = LinearConfig::new(12, 20).with_bias(bias).init(&device);
                let x = Tensor::<3>::random([2, 7, 12], Distribution::Normal(0.0, 1.0), &device);
                let transposed =
                    Tensor::<3>::random([2, 12, 7], Distribution::Normal(0.0, 1.0), &device)
                        .swap_dims(1, 2);
                for input in [x, transposed] {
                    let expected = linear.forward(input.clone());
                    let actual = native_linear(&linear, &input).expect("the native op runs");
                    let difference = (actual - expected).abs().max().into_scalar::<f32>();
                    assert!(difference <= 1e-5, "{device:?} bias {bias}: {difference}");
                }
            }
            let x = Tensor::<3>::zeros([1, 2, 12], &device);
            let tracked = Tensor::<3>::zeros([1, 2, 12], &device.clone().autodiff());
            let linear = LinearConfig::new(12, 20).init(&device);
            assert!(native_linear(&linear, &x.cast(burn::tensor::FloatDType::F64)).is_none());
            let on_autodiff = LinearConfig::new(12, 20).init(&device.clone().autodiff());
            assert!(native_linear(&on_autodiff, &tracked).is_none());
        }
    }
}
