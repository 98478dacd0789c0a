//! The native kernel and the generic body against the explicit path on the CPU backends.

use burn::nn::DropoutConfig;
use burn::tensor::{FloatDType, Tolerance};

use super::*;
use crate::kernel::{chunked_attention, explicit_attention};

/// The generic body (forced where a native kernel exists) and the native kernel against
/// the explicit path, in the output and the gradients of q, k, v and the sinks: GQA, causal
/// with more queries than keys and fewer, broadcast key padding whose last query block
/// holds one query, a fully masked row, a float bias, windows one- and two-sided, ALiBi,
/// packed segments, a soft cap, sinks.
#[test]
fn both_bodies_equal_the_explicit_path_in_outputs_and_gradients() {
    let dropout = DropoutConfig::new(0.0).init();
    for device in cpu_devices() {
        let device = device.autodiff();
        device.seed(31);
        // seq_q 5 with query blocks of 4: the last block is query 4 alone. Under 16 queries a
        // key/value head's query heads are served together (`forward_group`); 20 queries take
        // the per-head path, whose first query blocks see no key under causal masking.
        for (seq_q, seq_k) in [(5, 7), (7, 3), (5, 5), (20, 9)] {
            let (batch, n_heads) = (2, 4);
            let ([query, key, value], sinks) = grouped_heads(&device, seq_q, seq_k);
            let heads = [&query, &key, &value];
            for case in cases(&device, [batch, n_heads, seq_q, seq_k]) {
                let expected =
                    outputs_and_grads(heads, case.sinks.then_some(&sinks), |q, k, v, s| {
                        explicit_attention(q, k, v, &case.masks, &options(&case, s), &dropout).0
                    });
                for blocks in [
                    BlockSizes { query: 4, key: 2 },
                    BlockSizes { query: 1, key: 7 },
                ] {
                    for body in BodyRun::both() {
                        let actual =
                            outputs_and_grads(heads, case.sinks.then_some(&sinks), |q, k, v, s| {
                                let options = options(&case, s);
                                flash_attention(
                                    q,
                                    k,
                                    v,
                                    &case.masks,
                                    &options,
                                    blocks,
                                    &body.execution,
                                )
                            });
                        let label = format!("{} {seq_q}x{seq_k} {blocks:?}", case.label);
                        body.assert_ran(&label);
                        assert_outputs_and_grads_close(actual, &expected, 1e-5, &label);
                    }
                }
            }
        }
    }
}

/// A decoding-like call under grouped-query attention (3 query heads per key/value head, 2
/// queries: 6 rows, a block of four and one of two) with value heads 80 wide (a 64-column
/// chunk and a remainder), where the native forward reads each value row once per group:
/// the explicit path's outputs and gradients on every case (the weights: below).
#[test]
fn grouped_query_heads_sharing_one_pass_over_wide_values_equal_the_explicit_path() {
    let dropout = DropoutConfig::new(0.0).init();
    let (batch, n_heads, n_kv_heads, seq_q, seq_k) = (2, 6, 2, 2, 37);
    for device in cpu_devices() {
        let device = device.autodiff();
        device.seed(34);
        let query = normal([batch, n_heads, seq_q, 16], &device);
        let key = normal([batch, n_kv_heads, seq_k, 16], &device);
        let value = normal([batch, n_kv_heads, seq_k, 80], &device);
        let sinks = normal([n_heads], &device);
        let heads = [&query, &key, &value];
        let blocks = BlockSizes { query: 4, key: 8 };
        for case in cases(&device, [batch, n_heads, seq_q, seq_k]) {
            let sinks = case.sinks.then_some(&sinks);
            let expected = outputs_and_grads(heads, sinks, |q, k, v, s| {
                explicit_attention(q, k, v, &case.masks, &options(&case, s), &dropout).0
            });
            let native = BodyRun::new("native", Body::Native, Ran::Cpu);
            let actual = outputs_and_grads(heads, sinks, |q, k, v, s| {
                let options = options(&case, s);
                flash_attention(q, k, v, &case.masks, &options, blocks, &native.execution)
            });
            native.assert_ran(case.label);
            assert_outputs_and_grads_close(actual, &expected, 2e-5, case.label);
        }
    }
}

/// Calls over one key (whose head has stride 1 along its length-1 axis) at head widths that
/// the CPU's in-place score path takes (16, 64): one or three queries per head, grouped and
/// not, plain, causal with sinks (the earlier queries see no key) and soft-capped, the
/// explicit path's outputs and gradients.
#[test]
fn calls_over_one_key_equal_the_explicit_path() {
    let dropout = DropoutConfig::new(0.0).init();
    let (batch, n_heads) = (2, 4);
    for device in cpu_devices() {
        let device = device.autodiff();
        device.seed(36);
        for (n_kv_heads, head_dim, seq_q) in [(2, 64, 1), (4, 16, 3), (1, 64, 3)] {
            let query = normal([batch, n_heads, seq_q, head_dim], &device);
            let key = normal([batch, n_kv_heads, 1, head_dim], &device);
            let value = normal([batch, n_kv_heads, 1, head_dim], &device);
            let sinks = normal([n_heads], &device);
            let heads = [&query, &key, &value];
            let causal = ScoreMasks {
                rules: ScoreRules {
                    query_start: 1 - seq_q as i64,
                    causal: true,
                    ..ScoreRules::none(1)
                },
                ..ScoreMasks::none(1)
            };
            let one_key_cases = [
                Case {
                    label: "none",
                    masks: ScoreMasks::none(1),
                    softcap: None,
                    sinks: false,
                },
                // The earlier queries see no key.
                Case {
                    label: "causal, sinks",
                    masks: causal,
                    softcap: None,
                    sinks: true,
                },
                Case {
                    label: "soft cap",
                    masks: ScoreMasks::none(1),
                    softcap: Some(5.0),
                    sinks: false,
                },
            ];
            for case in one_key_cases {
                let sinks = case.sinks.then_some(&sinks);
                let expected = outputs_and_grads(heads, sinks, |q, k, v, s| {
                    explicit_attention(q, k, v, &case.masks, &options(&case, s), &dropout).0
                });
                let native = BodyRun::new("native", Body::Native, Ran::Cpu);
                let actual = outputs_and_grads(heads, sinks, |q, k, v, s| {
                    let options = options(&case, s);
                    let blocks = BlockSizes::default();
                    flash_attention(q, k, v, &case.masks, &options, blocks, &native.execution)
                });
                let label = format!(
                    "{} {n_kv_heads} kv heads of {head_dim}, {seq_q} queries",
                    case.label
                );
                native.assert_ran(&label);
                assert_outputs_and_grads_close(actual, &expected, 2e-5, &label);
            }
        }
    }
}

/// A decoding step under grouped-query attention with a saturated softmax (query rows
/// whose weights are one-hot): the backward recomputes the probabilities the forward found
/// to the bit, so those rows' query gradients are exactly zero, as autodiff through the
/// explicit softmax gives. Scores computed one way forward and another backward leave a
/// rounding residue there.
#[test]
fn one_hot_rows_of_a_grouped_decoding_step_have_exactly_zero_query_gradients() {
    let (n_heads, seq_q, seq_k) = (4, 2, 40);
    for device in cpu_devices() {
        let device = device.autodiff();
        device.seed(35);
        let query = normal([1, n_heads, seq_q, 64], &device) * 30.0;
        let key = normal([1, 2, seq_k, 64], &device) * 30.0;
        let value = normal([1, 2, seq_k, 64], &device);
        let case = Case {
            label: "saturated",
            masks: ScoreMasks::none(seq_k),
            softcap: None,
            sinks: false,
        };
        let options = options(&case, None);
        let native = Execution::default();
        let grads = outputs_and_grads([&query, &key, &value], None, |q, k, v, _| {
            flash_attention(
                q,
                k,
                v,
                &case.masks,
                &options,
                BlockSizes::default(),
                &native,
            )
        });
        let [q, k, v] = [&query, &key, &value].map(|t| t.clone().detach());
        let blocks = BlockSizes::default();
        let (_, weights) =
            flash_attention_with_weights(q, k, v, &case.masks, &options, blocks, &native);
        let weights = weights.into_data().to_vec::<f32>().expect("f32 weights");
        let query_grad = grads[1]
            .clone()
            .into_data()
            .to_vec::<f32>()
            .expect("f32 grads");
        let mut one_hot_rows = 0;
        for (row, (row_weights, row_grad)) in
            weights.chunks(seq_k).zip(query_grad.chunks(64)).enumerate()
        {
            if row_weights.contains(&1.0) {
                one_hot_rows += 1;
                let largest = row_grad.iter().fold(0.0f32, |m, g| m.max(g.abs()));
                assert_eq!(
                    largest, 0.0,
                    "{device:?}: one-hot row {row}'s largest |d query|"
                );
            }
        }
        assert!(
            one_hot_rows >= n_heads * seq_q / 2,
            "{one_hot_rows} one-hot rows"
        );
    }
}

/// For inference, both bodies return the explicit path's weights beside its output on every
/// case: zero for hidden keys and for a row that sees no key, the sinks' share left out;
/// the last shape, 2 queries over value heads 80 wide, is a decoding step's grouped pass.
#[test]
fn both_bodies_return_the_explicit_paths_weights() {
    let dropout = DropoutConfig::new(0.0).init();
    for device in cpu_devices() {
        device.seed(33);
        for (seq_q, seq_k, value_dim) in [(5, 7, 3), (7, 3, 3), (2, 37, 80), (20, 9, 3)] {
            let (batch, n_heads) = (2, 4);
            let ([query, key, value], sinks) =
                grouped_heads_with_values(&device, seq_q, seq_k, value_dim);
            for case in cases(&device, [batch, n_heads, seq_q, seq_k]) {
                let options = options(&case, case.sinks.then(|| sinks.clone()));
                let (context, weights) = explicit_attention(
                    query.clone(),
                    key.clone(),
                    value.clone(),
                    &case.masks,
                    &options,
                    &dropout,
                );
                let blocks = BlockSizes { query: 4, key: 2 };
                for body in BodyRun::both() {
                    let (actual_context, actual_weights) = flash_attention_with_weights(
                        query.clone(),
                        key.clone(),
                        value.clone(),
                        &case.masks,
                        &options,
                        blocks,
                        &body.execution,
                    );
                    body.assert_ran(case.label);
                    for (what, actual, expected) in [
                        ("context", actual_context, &context),
                        ("weights", actual_weights, &weights),
                    ] {
                        assert_eq!(actual.dims(), expected.dims(), "{what} shape");
                        let difference = max_difference(&actual, expected);
                        assert!(
                            difference <= 1e-6,
                            "{} {seq_q}x{seq_k} {}: {what} differs by {difference}",
                            case.label,
                            body.label
                        );
                    }
                }
            }
        }
    }
}

#[test]
#[should_panic(expected = "the weights are computed for inference and cannot carry a gradient")]
fn weights_refuse_a_tracked_input() {
    let device = Device::flex().autodiff();
    let query = normal([1, 1, 2, 4], &device).require_grad();
    let key = normal([1, 1, 3, 4], &device);
    let options = SoftmaxOptions {
        scale: 0.5,
        custom_scale: true,
        softcap: None,
        sinks: None,
    };
    flash_attention_with_weights(
        query,
        key.clone(),
        key,
        &ScoreMasks::none(3),
        &options,
        BlockSizes::default(),
        &Execution::default(),
    );
}

/// Half-precision inputs, through the native kernel and the generic body, against an f32
/// reference by FlashAttention's rule: no more than twice the error of the explicit path
/// computed in the same precision, plus a little.
#[test]
fn half_precision_inputs_are_as_accurate_as_the_explicit_path_in_that_precision() {
    let dropout = DropoutConfig::new(0.0).init();
    let device = Device::flex().autodiff();
    device.seed(32);
    let (batch, n_heads, n_kv_heads, seq_q, seq_k) = (2, 4, 2, 9, 13);
    let query = normal([batch, n_heads, seq_q, 17], &device);
    let key = normal([batch, n_kv_heads, seq_k, 17], &device);
    let value = normal([batch, n_kv_heads, seq_k, 5], &device);
    let sinks = normal([n_heads], &device);
    let heads = [&query, &key, &value];
    for dtype in [FloatDType::BF16, FloatDType::F16] {
        if !device.supports_dtype(dtype) {
            continue;
        }
        for case in cases(&device, [batch, n_heads, seq_q, seq_k]) {
            let reference = outputs_and_grads(heads, case.sinks.then_some(&sinks), |q, k, v, s| {
                explicit_attention(q, k, v, &case.masks, &options(&case, s), &dropout).0
            });
            let low = |t: Tensor<4>| t.cast(dtype);
            let low_masks = ScoreMasks {
                bias: case.masks.bias.clone().map(low),
                ..case.masks.clone()
            };
            let explicit_low =
                outputs_and_grads(heads, case.sinks.then_some(&sinks), |q, k, v, s| {
                    let options = options(&case, s.map(|s| s.cast(dtype)));
                    explicit_attention(low(q), low(k), low(v), &low_masks, &options, &dropout).0
                });
            for body in BodyRun::both() {
                let flash_low =
                    outputs_and_grads(heads, case.sinks.then_some(&sinks), |q, k, v, s| {
                        let blocks = BlockSizes { query: 4, key: 5 };
                        let options = options(&case, s.map(|s| s.cast(dtype)));
                        let execution = &body.execution;
                        flash_attention(
                            low(q),
                            low(k),
                            low(v),
                            &low_masks,
                            &options,
                            blocks,
                            execution,
                        )
                    });
                body.assert_ran(case.label);
                for (index, flash) in flash_low.iter().enumerate() {
                    let what = ["output", "d query", "d key", "d value", "d sinks"][index];
                    let yardstick = max_difference(&explicit_low[index], &reference[index]);
                    let error = max_difference(flash, &reference[index]);
                    assert!(
                        error <= 2.0 * yardstick + 1e-3,
                        "{dtype:?} {} {}: {what} error {error} > 2 × {yardstick} + 1e-3",
                        case.label,
                        body.label
                    );
                }
            }
        }
    }
}

/// A kernel refuses inputs that do not fit together, whoever calls it.
#[test]
#[should_panic(expected = "do not fit together")]
fn mismatched_head_widths_are_refused_at_the_kernel() {
    let device = Device::flex();
    let options = SoftmaxOptions {
        scale: 1.0,
        custom_scale: true,
        softcap: None,
        sinks: None,
    };
    flash_attention(
        normal([1, 2, 3, 8], &device),
        normal([1, 2, 4, 4], &device),
        normal([1, 2, 4, 4], &device),
        &ScoreMasks::none(4),
        &options,
        BlockSizes::default(),
        &Execution::default(),
    );
}

/// The native kernels read heads in place through their strides and copy other layouts
/// first: a strided view, a negative-stride (flipped) tensor and a view at an offset give
/// what contiguous copies of them give on the tensor-op path.
#[test]
fn any_input_layout_gives_the_contiguous_result() {
    for device in cpu_devices() {
        device.seed(3);
        let normal = Distribution::Normal(0.0, 1.0);
        // [batch, seq, heads, dim] memory seen as [batch, heads, seq, dim].
        let query = Tensor::<4>::random([2, 5, 4, 8], normal, &device).swap_dims(1, 2);
        let key = Tensor::<4>::random([2, 2, 7, 8], normal, &device).flip([2, 3]);
        let value = Tensor::<4>::random([2, 2, 9, 8], normal, &device).narrow(2, 2, 7);
        let copy = |tensor: &Tensor<4>| {
            let data: TensorData = tensor.to_data();
            Tensor::<4>::from_data(data, &device)
        };
        let masks = ScoreMasks {
            rules: ScoreRules {
                query_start: 2,
                causal: true,
                ..ScoreRules::none(7)
            },
            ..ScoreMasks::none(7)
        };
        let options = SoftmaxOptions {
            scale: 0.3,
            custom_scale: true,
            softcap: None,
            sinks: None,
        };
        let sizes = BlockSizes { query: 2, key: 3 };
        let expected = chunked_attention(
            copy(&query),
            copy(&key),
            copy(&value),
            &masks,
            &options,
            sizes,
        );
        let native = BodyRun::new("native", Body::Native, Ran::Cpu);
        let actual = flash_attention(
            query,
            key,
            value,
            &masks,
            &options,
            sizes,
            &native.execution,
        );
        native.assert_ran("any layout");
        actual
            .into_data()
            .assert_approx_eq::<f32>(&expected.into_data(), Tolerance::absolute(1e-5));
    }
}
