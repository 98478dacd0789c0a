//! RoPE's tests: against Burn's and Hugging Face's references, and the native op against the
//! tensor ops.

use super::*;
use burn::tensor::{Distribution, Tolerance};

fn x(device: &Device) -> Tensor<4> {
    Tensor::<1>::from_data([5.0, 6.0, 7.0, 8.0], device).reshape([1, 1, 1, 4])
}

#[test]
fn interleaved_matches_burns_rotary_encoding_reference() {
    // Burn's RotaryEncoding test: position 1 of [5, 6, 7, 8] is
    // [5cos1 - 6sin1, 6cos1 + 5sin1, 7cos(0.01) - 8sin(0.01), 8cos(0.01) + 7sin(0.01)].
    let device = Device::flex();
    let rotated = RopeConfig::new().apply(x(&device), 1);
    let (c1, s1, c2, s2) = (1f32.cos(), 1f32.sin(), 0.01f32.cos(), 0.01f32.sin());
    let expected = [[[[
        5.0 * c1 - 6.0 * s1,
        6.0 * c1 + 5.0 * s1,
        7.0 * c2 - 8.0 * s2,
        8.0 * c2 + 7.0 * s2,
    ]]]];
    rotated
        .into_data()
        .assert_approx_eq::<f32>(&expected.into(), Tolerance::absolute(1e-5));
}

/// The interleaved layout is Burn's `RotaryEncoding`, run as Burn runs it, at every offset.
#[test]
fn interleaved_equals_burns_rotary_encoding_module() {
    use burn::nn::RotaryEncodingConfig;
    use burn::tensor::Distribution;
    let device = Device::flex();
    let x = Tensor::<4>::random([2, 3, 5, 8], Distribution::Normal(0.0, 1.0), &device);
    let burns = RotaryEncodingConfig::new(32, 8).init(&device);
    let rope = Rope::new(RopeConfig::new());
    for start in [0, 1, 7, 20, 3] {
        let ours = rope.apply(x.clone(), start);
        ours.into_data().assert_approx_eq::<f32>(
            &burns.apply(x.clone(), start).into_data(),
            Tolerance::absolute(1e-5),
        );
    }
}

#[test]
fn half_split_rotates_the_two_halves_together() {
    let device = Device::flex();
    let rotated = RopeConfig::new()
        .with_layout(RopeLayout::HalfSplit)
        .apply(x(&device), 1);
    let (c1, s1, c2, s2) = (1f32.cos(), 1f32.sin(), 0.01f32.cos(), 0.01f32.sin());
    // Pairs (x0, x2) at frequency 1 and (x1, x3) at frequency 0.01.
    let expected = [[[[
        5.0 * c1 - 7.0 * s1,
        6.0 * c2 - 8.0 * s2,
        7.0 * c1 + 5.0 * s1,
        8.0 * c2 + 6.0 * s2,
    ]]]];
    rotated
        .into_data()
        .assert_approx_eq::<f32>(&expected.into(), Tolerance::absolute(1e-5));
}

#[test]
fn rows_at_their_own_positions_rotate_as_each_alone() {
    let device = Device::flex();
    for layout in [RopeLayout::Interleaved, RopeLayout::HalfSplit] {
        let rope = Rope::new(RopeConfig::new().with_layout(layout));
        let seq = 6;
        let values: Vec<f32> = (0..2 * seq * 8).map(|i| (i as f32 * 0.37).sin()).collect();
        let x = Tensor::<1>::from_data(values.as_slice(), &device).reshape([1, 2, seq, 8]);
        let positions: Vec<usize> = (0..seq).map(|row| 7 * row % 5 + 3 * row).collect();
        let together = rope.apply_at(x.clone(), &positions);
        for (row, &position) in positions.iter().enumerate() {
            let alone = rope.apply(x.clone().narrow(2, row, 1), position);
            together
                .clone()
                .narrow(2, row, 1)
                .into_data()
                .assert_approx_eq::<f32>(&alone.into_data(), Tolerance::absolute(1e-6));
        }
    }
}

#[test]
fn position_zero_is_the_identity() {
    let device = Device::flex();
    for layout in [RopeLayout::Interleaved, RopeLayout::HalfSplit] {
        let rotated = RopeConfig::new().with_layout(layout).apply(x(&device), 0);
        rotated
            .into_data()
            .assert_approx_eq::<f32>(&x(&device).into_data(), Tolerance::absolute(1e-6));
    }
}

/// The two bodies of a rotation on flex: the native op and the tensor ops.
#[derive(Clone, Copy, Debug)]
enum Body {
    Native,
    TensorOps,
}

impl Body {
    fn apply(self, rope: &Rope, x: Tensor<4>, start: usize) -> Tensor<4> {
        match self {
            Body::Native => {
                let [_, _, seq, head_dim] = x.dims();
                native_rotation(&x, || {
                    rope.rotation(head_dim, (start..start + seq).collect())
                })
                .expect("flex rotates natively")
            }
            Body::TensorOps => rope.apply_with_tensor_ops(x, start),
        }
    }

    fn apply_at(self, rope: &Rope, x: Tensor<4>, positions: &[usize]) -> Tensor<4> {
        match self {
            Body::Native => {
                let head_dim = x.dims()[3];
                native_rotation(&x, || rope.rotation(head_dim, positions.to_vec()))
                    .expect("flex rotates natively")
            }
            Body::TensorOps => rope.apply_at_with_tensor_ops(x, positions),
        }
    }

    /// The positions its table covers (`None` before it has one).
    fn table_len(self, rope: &Rope) -> Option<usize> {
        match self {
            Body::Native => rope.host_table.lock().unwrap().as_ref().map(|t| t.len),
            Body::TensorOps => rope.table.lock().unwrap().as_ref().map(|t| t.len),
        }
    }
}

/// The table grows when a later call needs more positions, and a grown table gives what a
/// fresh one gives, in both bodies.
#[test]
fn the_table_grows_and_gives_the_same_angles() {
    let device = Device::flex();
    for body in [Body::Native, Body::TensorOps] {
        let rope = Rope::new(RopeConfig::new());
        let x = Tensor::<4>::ones([1, 1, 3, 8], &device);
        let early = body.apply(&rope, x.clone(), 60);
        assert_eq!(body.table_len(&rope), Some(64), "{body:?}");
        let late = body.apply(&rope, x.clone(), 200);
        let fresh = |start| body.apply(&Rope::new(RopeConfig::new()), x.clone(), start);
        early
            .into_data()
            .assert_approx_eq::<f32>(&fresh(60).into_data(), Tolerance::absolute(1e-6));
        late.into_data()
            .assert_approx_eq::<f32>(&fresh(200).into_data(), Tolerance::absolute(1e-6));
        assert_eq!(body.table_len(&rope), Some(256), "{body:?}");
    }
}

/// Past the table's positions the angles are computed per call, the table stops growing,
/// and the rotations are those the table gives, bit for bit (contiguous and ragged rows), in
/// both bodies.
#[test]
fn positions_past_the_table_rotate_as_the_table_does_without_growing_it() {
    let device = Device::flex();
    let x = Tensor::<4>::random([2, 3, 5, 8], Distribution::Normal(0.0, 1.0), &device);
    for body in [Body::Native, Body::TensorOps] {
        let bounded = Rope::with_table_positions(RopeConfig::new(), 64);
        let table = Rope::new(RopeConfig::new());
        for start in [0, 60, 100, 1000] {
            assert_eq!(
                body.apply(&bounded, x.clone(), start).into_data(),
                body.apply(&table, x.clone(), start).into_data(),
                "{body:?} from position {start}"
            );
        }
        let ragged = [3, 70, 64, 5000, 2];
        assert_eq!(
            body.apply_at(&bounded, x.clone(), &ragged).into_data(),
            body.apply_at(&table, x.clone(), &ragged).into_data(),
            "{body:?} ragged"
        );
        assert_eq!(body.table_len(&bounded), Some(64), "{body:?}");
    }
}

/// The native op gives the tensor ops' rotations, on flex and ndarray, in both layouts, for
/// heads stored contiguously and sequence-major (as the projections give them), at a start
/// and at ragged positions past the table.
#[test]
fn the_native_op_rotates_as_the_tensor_ops() {
    // ndarray is deprecated in Burn 0.22 but still one of the two native backends.
    #[allow(deprecated)]
    let devices = [Device::flex(), Device::ndarray()];
    for device in devices {
        let contiguous = Tensor::<4>::random([2, 3, 5, 8], Distribution::Normal(0.0, 1.0), &device);
        let sequence_major =
            Tensor::<4>::random([2, 5, 3, 8], Distribution::Default, &device).swap_dims(1, 2);
        for layout in [RopeLayout::Interleaved, RopeLayout::HalfSplit] {
            let rope = Rope::with_table_positions(RopeConfig::new().with_layout(layout), 64);
            for x in [contiguous.clone(), sequence_major.clone()] {
                let what = format!("{device:?}, {layout:?}");
                Body::Native
                    .apply(&rope, x.clone(), 9)
                    .into_data()
                    .assert_approx_eq::<f32>(
                        &Body::TensorOps.apply(&rope, x.clone(), 9).into_data(),
                        Tolerance::absolute(1e-6),
                    );
                let ragged = [3, 70, 0, 63, 9];
                let native = Body::Native.apply_at(&rope, x.clone(), &ragged);
                let tensor_ops = Body::TensorOps.apply_at(&rope, x, &ragged);
                assert_eq!(native.dims(), tensor_ops.dims(), "{what}");
                native
                    .into_data()
                    .assert_approx_eq::<f32>(&tensor_ops.into_data(), Tolerance::absolute(1e-6));
            }
        }
    }
}

/// Under autodiff the native op's gradient (the inverse rotation) is the tensor ops'.
#[test]
fn the_native_op_gradient_is_the_tensor_ops_gradient() {
    #[allow(deprecated)]
    let devices = [Device::flex().autodiff(), Device::ndarray().autodiff()];
    for device in devices {
        for layout in [RopeLayout::Interleaved, RopeLayout::HalfSplit] {
            let rope = Rope::new(RopeConfig::new().with_layout(layout));
            let weights = Tensor::<4>::random([2, 3, 5, 8], Distribution::Default, &device);
            let x = Tensor::<4>::random([2, 3, 5, 8], Distribution::Default, &device);
            let gradient = |body: Body| {
                let x = x.clone().require_grad();
                let loss = (body.apply(&rope, x.clone(), 11) * weights.clone()).sum();
                let grads = loss.backward();
                x.grad(&grads).expect("x is tracked")
            };
            gradient(Body::Native).into_data().assert_approx_eq::<f32>(
                &gradient(Body::TensorOps).into_data(),
                Tolerance::absolute(1e-6),
            );
        }
    }
}

#[test]
#[should_panic(expected = "RoPE: 4 table rows of 4 pairs")]
fn the_native_op_refuses_a_table_row_count_unlike_the_rows() {
    let x = Tensor::<4>::ones([1, 2, 3, 8], &Device::flex());
    let rope = Rope::new(RopeConfig::new());
    native_rotation(&x, || rope.rotation(8, vec![0, 1, 2, 3]));
}

/// Linear and Llama 3 scaling give the frequencies Hugging Face's `rope_type` "linear" and
/// "llama3" give (`tests/fixtures/rope_scaling.json`, written by
/// `generate_pytorch_fixtures.py --only rope`).
#[test]
fn scaled_frequencies_match_hugging_faces() {
    let fixture: serde_json::Value =
        serde_json::from_str(include_str!("../../tests/fixtures/rope_scaling.json")).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 9);
    for case in cases {
        let scaling = match &case["scaling"] {
            serde_json::Value::Null => None,
            scaling if scaling.get("linear").is_some() => Some(RopeScaling::Linear {
                factor: scaling["linear"].as_f64().unwrap(),
            }),
            scaling => {
                let values = scaling["llama3"].as_array().unwrap();
                Some(RopeScaling::Llama3 {
                    factor: values[0].as_f64().unwrap(),
                    low_freq_factor: values[1].as_f64().unwrap(),
                    high_freq_factor: values[2].as_f64().unwrap(),
                    original_max_position: values[3].as_u64().unwrap() as usize,
                })
            }
        };
        let config = RopeConfig::new()
            .with_theta(case["theta"].as_f64().unwrap())
            .with_scaling(scaling);
        let ours = config.frequencies(case["head_dim"].as_u64().unwrap() as usize);
        let expected: Vec<f64> = case["frequencies"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_f64().unwrap())
            .collect();
        assert_eq!(ours.len(), expected.len());
        for (a, b) in ours.iter().zip(&expected) {
            assert!((a - b).abs() <= 1e-12 * b.abs(), "{scaling:?}: {a} vs {b}");
        }
    }
}

/// The rotation uses the scaled frequencies: under linear scaling by 4, position `4p`
/// rotates as position `p` does unscaled (both layouts).
#[test]
fn linear_scaling_rotates_position_4p_as_p() {
    let device = Device::flex();
    for layout in [RopeLayout::Interleaved, RopeLayout::HalfSplit] {
        let plain = RopeConfig::new().with_layout(layout);
        let scaled = plain
            .clone()
            .with_scaling(Some(RopeScaling::Linear { factor: 4.0 }));
        for position in [1, 7, 300] {
            let x = x(&device).narrow(2, 0, 1);
            scaled
                .apply(x.clone(), 4 * position)
                .into_data()
                .assert_approx_eq::<f32>(
                    &plain.apply(x, position).into_data(),
                    Tolerance::absolute(1e-4),
                );
        }
    }
}
