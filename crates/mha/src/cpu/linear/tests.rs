use super::*;
use burn::module::Module;
use burn::nn::LinearConfig;
use burn::tensor::{Device, Distribution, FloatDType};

use crate::execution::{Event, FreshOutputs, Probe};

#[allow(deprecated)]
fn devices() -> [Device; 2] {
    [Device::flex(), Device::ndarray()]
}

fn max_difference(actual: Tensor<3>, expected: Tensor<3>) -> f32 {
    (actual - expected).abs().max().into_scalar::<f32>()
}

/// Fresh output buffers full of NaN: an element the op does not write shows.
fn poisoned() -> Execution {
    Execution {
        fresh_outputs: FreshOutputs::Nan,
        ..Execution::default()
    }
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
                let actual =
                    native_linear_with(&linear, &input, poisoned()).expect("the native op runs");
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
/// thread and on several, on both CPU backends, native and through the default body; it is not
/// taken for f64 or under autodiff.
#[test]
fn the_packed_projection_equals_three_linears() {
    let generic = Execution {
        body: Body::Generic,
        ..Execution::default()
    };
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
            let x = Tensor::<3>::random([2, seq, d_input], Distribution::Normal(0.0, 1.0), &device);
            let expected = Tensor::cat(linears.map(|linear| linear.forward(x.clone())).into(), 2);
            for execution in [poisoned(), generic.clone()] {
                let body = execution.body;
                let actual =
                    native_packed_linear_with(linears, &x, execution).expect("the native op runs");
                let difference = max_difference(actual, expected.clone());
                assert!(
                    difference <= 1e-5,
                    "{device:?} {body:?} biases {bias:?} seq {seq}: {difference}"
                );
            }
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
// Longer than most: one table of cases, each checked for the output and three gradients.
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
            let x = if transposed {
                Tensor::<3>::random([2, d_input, seq], normal, &device).swap_dims(1, 2)
            } else {
                Tensor::<3>::random([2, seq, d_input], normal, &device)
            };
            // The gradients' rounding grows with the square root of the rows they sum.
            let tolerance = 1e-4 * ((2 * seq) as f32 / 14.0).sqrt();
            let x = x.set_require_grad(input_tracked);
            // A loss whose gradient differs per element, so that a transposed or summed
            // gradient cannot pass.
            let weights = Tensor::<3>::random([2, seq, d_output], normal, &device);
            let probe = Probe::default();
            let execution = Execution {
                probe: Some(probe.clone()),
                ..poisoned()
            };
            let ours = native_linear_with(&linear, &x, execution).expect("the native op runs");
            let burns = linear.forward(x.clone());
            let case = format!("{device:?} seq {seq} bias {bias} transposed {transposed}");
            assert!(
                max_difference(ours.clone(), burns.clone()) <= 1e-5,
                "{case}: output"
            );
            let ours = (ours * weights.clone()).sum().backward();
            let log = probe.take();
            assert_eq!(log.len(), 1, "{case}: one projection node ran its backward");
            for event in log {
                let Event::Registered {
                    mut declared,
                    mut registered,
                } = event
                else {
                    panic!("{case}: {event:?}");
                };
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
            if input_tracked {
                let [actual, expected] =
                    [&ours, &burns].map(|grads| x.grad(grads).expect("an input gradient"));
                let difference = max_difference(actual, expected);
                assert!(
                    difference <= tolerance,
                    "{case}: input gradient off by {difference}"
                );
            } else {
                assert!(x.grad(&ours).is_none(), "{case}: untracked input");
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
