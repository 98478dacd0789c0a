//! The float type a flash call is computed in, and the casts there and back, in one place for
//! every body: the CPU kernels and the generic body compute in f32 what comes in f16 or bf16
//! (the CubeCL kernels read halves themselves and accumulate in f32, and use this for their
//! fallback to the generic body).
//!
//! Why f32: the softmax statistics and the sums over key and query blocks lose too much in 8 or
//! 11 bits of mantissa. The results are returned in the inputs' type, as mixed-precision
//! training expects; the softmax statistics stay f32.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, DType, FloatDType, TensorMetadata};

use super::inputs::{FlashForward, FlashGrads, FlashInputs, FlashState};

/// The type a call whose query is in `dtype` is computed in.
fn compute_type(dtype: DType) -> DType {
    match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        other => other,
    }
}

/// `tensor` in `dtype`, cast only if it is in another type.
fn cast_to<B: Backend>(tensor: &FloatTensor<B>, dtype: DType) -> FloatTensor<B> {
    if tensor.dtype() == dtype {
        tensor.clone()
    } else {
        B::float_cast(tensor.clone(), FloatDType::from(dtype))
    }
}

/// `inputs` with every float tensor in the call's compute type, if one is in another type.
fn in_compute_type<B: Backend>(inputs: &FlashInputs<B>) -> Option<FlashInputs<B>> {
    let dtype = compute_type(inputs.query.dtype());
    let floats = [Some(&inputs.query), Some(&inputs.key), Some(&inputs.value)]
        .into_iter()
        .chain([inputs.bias.as_ref(), inputs.sinks.as_ref()]);
    if floats.flatten().all(|tensor| tensor.dtype() == dtype) {
        return None;
    }
    Some(FlashInputs {
        query: cast_to::<B>(&inputs.query, dtype),
        key: cast_to::<B>(&inputs.key, dtype),
        value: cast_to::<B>(&inputs.value, dtype),
        bias: inputs.bias.as_ref().map(|bias| cast_to::<B>(bias, dtype)),
        forbid: inputs.forbid.clone(),
        sinks: inputs
            .sinks
            .as_ref()
            .map(|sinks| cast_to::<B>(sinks, dtype)),
        params: inputs.params.clone(),
    })
}

/// `body`'s forward of `inputs` computed in the compute type, its output in the query's type.
pub(super) fn forward<B: Backend>(
    inputs: &FlashInputs<B>,
    body: impl FnOnce(&FlashInputs<B>) -> FlashForward<B>,
) -> FlashForward<B> {
    let Some(computed) = in_compute_type(inputs) else {
        return body(inputs);
    };
    let FlashForward {
        output,
        softmax_stats,
    } = body(&computed);
    FlashForward {
        output: cast_to::<B>(&output, inputs.query.dtype()),
        softmax_stats,
    }
}

/// `body`'s output and weights of `inputs` computed in the compute type, both in the query's
/// type.
pub(super) fn weights<B: Backend>(
    inputs: &FlashInputs<B>,
    body: impl FnOnce(&FlashInputs<B>) -> (FloatTensor<B>, FloatTensor<B>),
) -> (FloatTensor<B>, FloatTensor<B>) {
    let Some(computed) = in_compute_type(inputs) else {
        return body(inputs);
    };
    let (output, weights) = body(&computed);
    let dtype = inputs.query.dtype();
    (cast_to::<B>(&output, dtype), cast_to::<B>(&weights, dtype))
}

/// `body`'s gradients of `state` computed in the compute type, each in its input's type.
pub(super) fn backward<B: Backend>(
    state: &FlashState<B>,
    output_grad: FloatTensor<B>,
    body: impl FnOnce(&FlashState<B>, FloatTensor<B>) -> FlashGrads<B>,
) -> FlashGrads<B> {
    let Some(inputs) = in_compute_type(&state.inputs) else {
        return body(state, output_grad);
    };
    let dtype = compute_type(state.inputs.query.dtype());
    let computed = FlashState {
        inputs,
        output: cast_to::<B>(&state.output, dtype),
        softmax_stats: state.softmax_stats.clone(),
    };
    let grads = body(&computed, cast_to::<B>(&output_grad, dtype));
    let original = &state.inputs;
    FlashGrads {
        query: cast_to::<B>(&grads.query, original.query.dtype()),
        key: cast_to::<B>(&grads.key, original.key.dtype()),
        value: cast_to::<B>(&grads.value, original.value.dtype()),
        sinks: grads
            .sinks
            .zip(original.sinks.as_ref())
            .map(|(grad, sinks)| cast_to::<B>(&grad, sinks.dtype())),
    }
}
