//! Properties of `MultiHeadAttention` that hold on every test device.

mod common;

use burn::module::{Module, Param};
use burn::tensor::{Bool, Device, Int, Tensor};
use common::{all_finite, assert_close, randn, test_devices, tolerance};
use mha::{
    AttentionPath, BlockSizes, KvCache, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig,
    NeedWeights, RopeConfig, flash_attention_supported,
};

#[test]
fn self_attention_without_masks_is_permutation_equivariant() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 1);
        let module = MultiHeadAttentionConfig::new(16, 4).init(&device);
        let x = randn([2, 6, 16], &device);
        let order = [3, 0, 5, 1, 4, 2];
        let indices = Tensor::<1, Int>::from_data(order.map(|i| i as i64), &device);
        let permuted_then_attended = module
            .forward(MhaInput::self_attn(x.clone().select(1, indices.clone())))
            .context;
        let attended_then_permuted = module
            .forward(MhaInput::self_attn(x))
            .context
            .select(1, indices);
        assert_close(
            &format!("{name}: permutation"),
            permuted_then_attended,
            attended_then_permuted,
            tolerance(name),
        );
    }
}

/// `MhaInput::self_attn(x)` (whose three projections may be one op) equals
/// `MhaInput::new(x, x, x)` (three), outputs and weights, with biases or without, with GQA and
/// RoPE, with the appended positions of `add_bias_kv` and `add_zero_attn`, in a forward and
/// decoding step by step under a KV cache; on the CPU also at a size whose projections run on
/// several threads.
#[test]
fn self_attention_equals_attention_over_one_tensor_passed_three_times() {
    let configs = [
        ("mha", MultiHeadAttentionConfig::new(16, 4)),
        (
            "gqa+rope",
            MultiHeadAttentionConfig::new(32, 4)
                .with_n_kv_heads(Some(2))
                .with_rope(Some(RopeConfig::new())),
        ),
        (
            "no bias, bias_kv, zero_attn",
            MultiHeadAttentionConfig::new(16, 2)
                .with_bias(false)
                .with_add_bias_kv(true)
                .with_add_zero_attn(true),
        ),
        (
            "wide gqa",
            MultiHeadAttentionConfig::new(128, 8).with_n_kv_heads(Some(2)),
        ),
    ];
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 31);
        let bound = tolerance(name);
        for (config_name, config) in &configs {
            let seq = match (*config_name, name) {
                ("wide gqa", "flex" | "ndarray") => 128,
                ("wide gqa", _) => continue,
                _ => 5,
            };
            let module = config.init(&device);
            let x = randn([2, seq, config.d_model], &device);
            let what = |part: &str| format!("{name} {config_name}: {part}");
            let separate = MhaInput::new(x.clone(), x.clone(), x.clone());
            let [packed, separate] = [MhaInput::self_attn(x.clone()), separate]
                .map(|input| module.forward(input.causal().need_weights(NeedWeights::PerHead)));
            let weights =
                |output: &mha::MhaOutput| output.weights.clone().expect("weights").per_head();
            assert_close(
                &what("weights"),
                weights(&packed).expect("per head"),
                weights(&separate).expect("per head"),
                bound,
            );
            assert_close(&what("output"), packed.context, separate.context, bound);
            let [mut packed_cache, mut separate_cache] = [KvCache::new(), KvCache::new()];
            for (start, length) in [(0, 2), (2, 1), (3, seq - 3)] {
                let step = x.clone().narrow(1, start, length);
                let packed = module
                    .forward_cached(
                        MhaInput::self_attn(step.clone()).causal(),
                        &mut packed_cache,
                    )
                    .expect("within limits");
                let separate = module
                    .forward_cached(
                        MhaInput::new(step.clone(), step.clone(), step).causal(),
                        &mut separate_cache,
                    )
                    .expect("within limits");
                assert_close(
                    &what(&format!("decoding step at {start}")),
                    packed.context,
                    separate.context,
                    bound,
                );
            }
        }
    }
}

#[test]
fn causal_outputs_ignore_future_tokens() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 2);
        let module = MultiHeadAttentionConfig::new(16, 2).init(&device);
        let x = randn([2, 7, 16], &device);
        let changed_future = x
            .clone()
            .slice_assign([0..2, 4..7, 0..16], randn([2, 3, 16], &device));
        for path in common::paths(&device) {
            let original = module
                .forward(MhaInput::self_attn(x.clone()).causal().path(path))
                .context;
            let changed = module
                .forward(
                    MhaInput::self_attn(changed_future.clone())
                        .causal()
                        .path(path),
                )
                .context;
            assert_close(
                &format!("{name} {path:?}: prefix unchanged"),
                original.clone().slice([0..2, 0..4]),
                changed.clone().slice([0..2, 0..4]),
                tolerance(name),
            );
            let moved =
                common::max_abs_diff(original.slice([0..2, 4..7]), changed.slice([0..2, 4..7]));
            assert!(
                moved > 1e-3,
                "{name}: changed tokens must change their own outputs"
            );
        }
    }
}

#[test]
fn padded_keys_and_values_change_nothing() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 3);
        let module = MultiHeadAttentionConfig::new(12, 3)
            .with_d_key_input(Some(5))
            .with_d_value_input(Some(7))
            .init(&device);
        let query = randn([2, 4, 12], &device);
        let key = randn([2, 6, 5], &device);
        let value = randn([2, 6, 7], &device);
        let padding = Tensor::<2, Bool>::from_data(
            [
                [false, false, false, false, true, true],
                [false, false, false, false, false, true],
            ],
            &device,
        );
        let garbage_key = key
            .clone()
            .slice_assign([0..2, 5..6], randn([2, 1, 5], &device).mul_scalar(50.0));
        let garbage_value = value
            .clone()
            .slice_assign([0..2, 5..6], randn([2, 1, 7], &device).mul_scalar(50.0));
        for path in common::paths(&device) {
            let run = |key: Tensor<3>, value: Tensor<3>| {
                module
                    .forward(
                        MhaInput::new(query.clone(), key, value)
                            .key_padding_mask(padding.clone())
                            .path(path),
                    )
                    .context
            };
            assert_close(
                &format!("{name} {path:?}: padding"),
                run(key.clone(), value.clone()),
                run(garbage_key.clone(), garbage_value.clone()),
                tolerance(name),
            );
        }
    }
}

/// An MHA module whose key/value heads are the GQA module's, each repeated for its group.
fn expand_to_mha(gqa: &MultiHeadAttention, device: &Device) -> MultiHeadAttention {
    let mut mha = MultiHeadAttentionConfig::new(gqa.d_model(), gqa.n_heads()).init(device);
    let groups = gqa.n_heads() / gqa.n_kv_heads();
    let repeat_heads = |weight: Tensor<2>| {
        let [d_in, _] = weight.dims();
        weight
            .reshape([d_in, gqa.n_kv_heads(), 1, gqa.head_dim()])
            .expand([d_in, gqa.n_kv_heads(), groups, gqa.head_dim()])
            .reshape([d_in, gqa.n_heads() * gqa.head_dim()])
    };
    let repeat_bias = |bias: Tensor<1>| repeat_heads(bias.unsqueeze::<2>()).flatten(0, 1);
    mha.query = gqa.query.clone();
    mha.output = gqa.output.clone();
    for (target, source) in [(&mut mha.key, &gqa.key), (&mut mha.value, &gqa.value)] {
        target.weight = Param::from_tensor(repeat_heads(source.weight.val()));
        target.bias = Some(Param::from_tensor(repeat_bias(
            source.bias.as_ref().unwrap().val(),
        )));
    }
    mha
}

#[test]
fn gqa_and_mqa_equal_mha_with_repeated_key_value_heads() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 4);
        for n_kv_heads in [1, 2, 4] {
            let gqa = MultiHeadAttentionConfig::new(16, 4)
                .with_n_kv_heads(Some(n_kv_heads))
                .with_bias(true)
                .init(&device);
            // Non-zero biases, so that their repetition is checked too.
            let mut gqa = gqa;
            for linear in [&mut gqa.key, &mut gqa.value] {
                let width = linear.bias.as_ref().unwrap().val().dims()[0];
                linear.bias = Some(Param::from_tensor(randn([width], &device)));
            }
            let mha = expand_to_mha(&gqa, &device);
            let x = randn([2, 5, 16], &device);
            for path in [AttentionPath::Explicit, AttentionPath::Fused] {
                let input = || MhaInput::self_attn(x.clone()).causal().path(path);
                assert_close(
                    &format!("{name} kv_heads={n_kv_heads} {path:?}"),
                    gqa.forward(input()).context,
                    mha.forward(input()).context,
                    tolerance(name),
                );
            }
        }
    }
}

/// Every path, for plain multi-head attention (`n_kv_heads` unset or equal to `n_heads`) and
/// grouped-query attention, against attention written out head by head from the weights.
#[test]
fn every_path_equals_textbook_attention_head_by_head() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 5);
        let configs = [
            MultiHeadAttentionConfig::new(16, 4),
            MultiHeadAttentionConfig::new(16, 4).with_n_kv_heads(Some(4)),
            MultiHeadAttentionConfig::new(16, 4)
                .with_n_kv_heads(Some(2))
                .with_scale(Some(0.7)),
            MultiHeadAttentionConfig::new(12, 3)
                .with_d_key_input(Some(5))
                .with_d_value_input(Some(7)),
        ];
        for config in configs {
            let module = config.init(&device);
            let query = randn([2, 5, module.d_model()], &device);
            let key = randn([2, 7, module.d_key_input()], &device);
            let value = randn([2, 7, module.d_value_input()], &device);
            let padding = Tensor::<2, Bool>::from_data(
                [[false; 7], [false, true, false, false, false, true, true]],
                &device,
            );
            for causal in [false, true] {
                let expected = common::reference_attention(
                    &module,
                    query.clone(),
                    key.clone(),
                    value.clone(),
                    Some(&padding),
                    causal,
                );
                for path in common::paths(&device) {
                    let mut input = MhaInput::new(query.clone(), key.clone(), value.clone())
                        .key_padding_mask(padding.clone())
                        .path(path);
                    if causal {
                        input = input.causal();
                    }
                    assert_close(
                        &format!("{name} {path:?} causal={causal} {config:?}"),
                        module.forward(input).context,
                        expected.clone(),
                        tolerance(name),
                    );
                }
            }
        }
    }
}

/// A query row of NaN gives a NaN output row on every path (and leaves the other rows alone):
/// no path may hide it as a fully masked row.
#[test]
fn nan_in_gives_nan_out_on_every_path() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 21);
        let module = MultiHeadAttentionConfig::new(8, 2).init(&device);
        let query = randn([1, 3, 8], &device).slice_assign(
            [0..1, 1..2, 0..8],
            Tensor::full([1, 1, 8], f32::NAN, &device),
        );
        let memory = randn([1, 4, 8], &device);
        for path in common::paths(&device) {
            let output = module
                .forward(MhaInput::new(query.clone(), memory.clone(), memory.clone()).path(path))
                .context
                .into_data()
                .try_into_vec_as::<f32>()
                .unwrap();
            let (nan_row, other_rows) = (&output[8..16], [&output[..8], &output[16..]]);
            assert!(
                nan_row.iter().all(|x| x.is_nan()),
                "{name} {path:?}: NaN query row gave {nan_row:?}"
            );
            assert!(
                other_rows
                    .iter()
                    .all(|row| row.iter().all(|x| x.is_finite())),
                "{name} {path:?}: other rows"
            );
        }
    }
}

/// A masked key never reaches a row, whatever its score: infinite or NaN scores at padded
/// positions leave every path's output as it is with ordinary keys there.
#[test]
fn masked_keys_never_reach_a_row_whatever_their_scores() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 22);
        let module = MultiHeadAttentionConfig::new(8, 2).init(&device);
        let query = randn([2, 3, 8], &device);
        let key = randn([2, 5, 8], &device);
        let value = randn([2, 5, 8], &device);
        let padding = Tensor::<2, Bool>::from_data(
            [
                [false, false, true, false, true],
                [false, false, false, false, true],
            ],
            &device,
        );
        // +inf, -inf and NaN key features make ±inf and NaN scores at the padded keys.
        let poisoned = Tensor::<3>::from_data(
            [[[
                f32::INFINITY,
                -1.0,
                2.0,
                0.5,
                f32::NEG_INFINITY,
                3.0,
                -2.0,
                1.0,
            ]]],
            &device,
        );
        let bad_key = key
            .clone()
            .slice_assign([0..1, 2..3, 0..8], poisoned.clone())
            .slice_assign([0..1, 4..5, 0..8], poisoned.clone().mul_scalar(-1.0))
            .slice_assign(
                [1..2, 4..5, 0..8],
                Tensor::full([1, 1, 8], f32::NAN, &device),
            );
        for path in common::paths(&device) {
            let run = |key: Tensor<3>| {
                module
                    .forward(
                        MhaInput::new(query.clone(), key, value.clone())
                            .key_padding_mask(padding.clone())
                            .path(path),
                    )
                    .context
            };
            assert_close(
                &format!("{name} {path:?}: poisoned masked keys"),
                run(bad_key.clone()),
                run(key.clone()),
                tolerance(name),
            );
        }
    }
}

#[test]
fn fused_and_explicit_paths_agree() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 6);
        let configs = [
            MultiHeadAttentionConfig::new(16, 4),
            MultiHeadAttentionConfig::new(16, 4)
                .with_n_kv_heads(Some(2))
                .with_scale(Some(0.3)),
            MultiHeadAttentionConfig::new(24, 3)
                .with_d_key_input(Some(8))
                .with_d_value_input(Some(10))
                .with_add_bias_kv(true)
                .with_add_zero_attn(true),
        ];
        for config in configs {
            let module = config.init(&device);
            let query = randn([2, 5, config.d_model], &device);
            let key = randn([2, 7, module.d_key_input()], &device);
            let value = randn([2, 7, module.d_value_input()], &device);
            let padding = Tensor::<2, Bool>::from_data(
                [[false; 7], [false, false, false, true, false, true, true]],
                &device,
            );
            let bias = randn([2, module.n_heads(), 5, 7], &device);
            let inputs: Vec<(&str, MhaInput)> = vec![
                (
                    "plain",
                    MhaInput::new(query.clone(), key.clone(), value.clone()),
                ),
                (
                    "padding+causal",
                    MhaInput::new(query.clone(), key.clone(), value.clone())
                        .key_padding_mask(padding.clone())
                        .causal(),
                ),
                (
                    "float bias",
                    MhaInput::new(query.clone(), key.clone(), value.clone()).attn_mask(bias),
                ),
            ];
            for (label, input) in inputs {
                let explicit = module
                    .forward(input.clone().path(AttentionPath::Explicit))
                    .context;
                let fused = module.forward(input.path(AttentionPath::Fused)).context;
                assert_close(
                    &format!("{name} {label} {config:?}"),
                    explicit,
                    fused,
                    tolerance(name),
                );
            }
        }
    }
}

/// The flash kernel on the CPU backends flushes probabilities below 2⁻⁵⁰ of a row's largest to
/// 0 (`flash/simd.rs`'s `FLUSH_BELOW`): subnormal ones slow every GEMM instruction that touches
/// them. A sharp softmax (inputs of deviation 12) must give no subnormal weight there, and the
/// explicit path's values otherwise.
#[test]
fn a_sharp_softmax_gives_no_subnormal_probability_and_the_explicit_values() {
    for (name, device) in test_devices() {
        if !flash_attention_supported(&device) || name == "wgpu" {
            // The flush is the CPU kernel's; the GPU kernels keep what their hardware does.
            continue;
        }
        let _seed = common::seed(&device, 11);
        let module = MultiHeadAttentionConfig::new(32, 2).init(&device);
        let x = randn([2, 96, 32], &device).mul_scalar(12.0);
        let [flash, explicit] = [
            AttentionPath::Flash(BlockSizes::default()),
            AttentionPath::Explicit,
        ]
        .map(|path| {
            let input = MhaInput::self_attn(x.clone()).need_weights(NeedWeights::PerHead);
            let output = module.forward(input.path(path));
            let weights = output.weights.expect("weights were asked for");
            (
                output.context,
                weights.per_head().expect("per-head weights"),
            )
        });
        let values = |weights: &Tensor<4>| weights.clone().into_data().try_to_vec::<f32>().unwrap();
        let [flash_weights, explicit_weights] = [&flash.1, &explicit.1].map(values);
        let subnormal = flash_weights.iter().filter(|w| w.is_subnormal()).count();
        assert_eq!(subnormal, 0, "{name}: subnormal probabilities");
        let tiny = explicit_weights
            .iter()
            .filter(|&&w| w > 0.0 && w < 1e-16)
            .count();
        assert!(
            tiny > 100,
            "{name}: the inputs make only {tiny} tiny probabilities"
        );
        assert_close(&format!("{name} weights"), flash.1, explicit.1, 1e-6);
        assert_close(&format!("{name} context"), flash.0, explicit.0, 1e-4);
    }
}

// Longer than most: every path on every device, each checked for output, weights and gradients.
#[test]
fn fully_masked_queries_give_zero_output_weights_and_finite_gradients() {
    for (name, device) in test_devices() {
        let device = device.autodiff();
        let _seed = common::seed(&device, 7);
        let module = MultiHeadAttentionConfig::new(8, 2)
            .with_bias(false)
            .init(&device);
        let x = randn([1, 3, 8], &device).require_grad();
        // Query 1 may attend to nothing.
        let forbid = Tensor::<2, Bool>::from_data(
            [
                [false, true, false],
                [true, true, true],
                [false, false, false],
            ],
            &device,
        );
        let mut paths = vec![AttentionPath::Explicit, AttentionPath::Auto];
        if flash_attention_supported(&device) {
            paths.push(AttentionPath::Flash(BlockSizes { query: 2, key: 2 }));
        }
        for path in paths {
            let need_weights = if path == AttentionPath::Explicit {
                NeedWeights::PerHead
            } else {
                NeedWeights::No
            };
            let output = module.forward(
                MhaInput::self_attn(x.clone())
                    .attn_mask(forbid.clone())
                    .need_weights(need_weights)
                    .path(path),
            );
            let context = output.context;
            // With no bias, a query that attends to nothing outputs exactly zero.
            let dead_row = context
                .clone()
                .slice([0..1, 1..2])
                .abs()
                .max()
                .into_scalar::<f32>();
            assert_eq!(dead_row, 0.0, "{name} {path:?}: fully masked query output");
            if let Some(weights) = output.weights {
                let weights = weights.per_head().unwrap();
                let dead = weights
                    .clone()
                    .slice([0..1, 0..2, 1..2])
                    .abs()
                    .max()
                    .into_scalar::<f32>();
                assert_eq!(dead, 0.0, "{name}: fully masked weights row");
                assert!(all_finite(weights.inner()));
            }
            let grads = context.powi_scalar(2).sum().backward();
            let x_grad = x.grad(&grads).unwrap();
            assert!(
                all_finite(x_grad),
                "{name} {path:?}: input gradient is finite"
            );
            let weight_grad = module.query.weight.grad(&grads).unwrap();
            assert!(
                all_finite(weight_grad),
                "{name} {path:?}: weight gradient is finite"
            );
        }
        // The same holds for a float mask of -inf and for causal attention with more queries
        // than keys (the first queries then see no key).
        let minus_inf = Tensor::<2>::from_data(
            [
                [0.0, f32::NEG_INFINITY, 0.0],
                [f32::NEG_INFINITY; 3],
                [0.0, 0.0, 0.0],
            ],
            &device,
        );
        let output = module
            .forward(MhaInput::self_attn(x.clone()).attn_mask(minus_inf))
            .context;
        let dead_row = output
            .clone()
            .slice([0..1, 1..2])
            .abs()
            .max()
            .into_scalar::<f32>();
        assert_eq!(dead_row, 0.0, "{name}: -inf float mask row");
        let grads = output.sum().backward();
        assert!(all_finite(x.grad(&grads).unwrap()));
        let keys = randn([1, 2, 8], &device);
        let output = module
            .forward(MhaInput::new(x.clone(), keys.clone(), keys).causal())
            .context;
        let first = output.slice([0..1, 0..1]).abs().max().into_scalar::<f32>();
        assert_eq!(
            first, 0.0,
            "{name}: query before every key under bottom-right causal"
        );
    }
}

/// Dropout changes a forward in training mode on an autodiff device only, and there `Auto`
/// must take the explicit path (the only one with dropout) even when no weights are asked for.
#[test]
fn dropout_acts_only_in_training_on_an_autodiff_device() {
    for (name, device) in test_devices() {
        let autodiff = device.clone().autodiff();
        let _seed = common::seed(&autodiff, 23);
        let training = MultiHeadAttentionConfig::new(8, 2)
            .with_dropout(0.5)
            .init(&autodiff);
        let x = randn([2, 6, 8], &autodiff);
        let context = |module: &MultiHeadAttention, x: Tensor<3>| {
            module.forward(MhaInput::self_attn(x)).context
        };
        // Frozen in place: still on the autodiff device, training flags cleared.
        let frozen = context(&training.clone().freeze(), x.clone());
        let off_autodiff = context(&training.valid(), x.clone().inner());
        assert_close(
            &format!("{name}: no dropout when frozen on the autodiff device"),
            frozen.clone().inner(),
            off_autodiff.clone(),
            tolerance(name),
        );
        let first = context(&training, x.clone());
        let second = context(&training, x.clone());
        assert!(
            common::max_abs_diff(first.clone().inner(), frozen.inner()) > 1e-2,
            "{name}: dropout changes a training forward without weights (Auto took a path \
             without dropout)"
        );
        assert!(
            common::max_abs_diff(first.inner(), second.inner()) > 1e-2,
            "{name}: each training forward draws its own dropout mask"
        );
        let weights = training
            .forward(MhaInput::self_attn(x).need_weights(NeedWeights::PerHead))
            .weights
            .unwrap()
            .per_head()
            .unwrap();
        let row_sums = weights
            .sum_dim(3)
            .inner()
            .into_data()
            .try_into_vec_as::<f32>()
            .unwrap();
        assert!(
            row_sums.iter().any(|s| (s - 1.0).abs() > 1e-2),
            "{name}: returned training weights are after dropout"
        );
    }
}

#[test]
fn burnpack_save_and_load_restores_every_parameter_bit_for_bit() {
    let directory = std::env::temp_dir().join(format!("mha-save-load-{}", std::process::id()));
    std::fs::create_dir_all(&directory).unwrap();
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 9);
        let config = MultiHeadAttentionConfig::new(16, 4)
            .with_n_kv_heads(Some(2))
            .with_d_key_input(Some(6))
            .with_add_bias_kv(true);
        let module = config.init(&device);
        let query = randn([1, 3, 16], &device);
        let key = randn([1, 4, 6], &device);
        let value = randn([1, 4, 16], &device);
        let input = || MhaInput::new(query.clone(), key.clone(), value.clone());
        let before = module.forward(input()).context.into_data();

        let path = directory.join(format!("attention-{name}"));
        module.clone().save_file(&path).expect("save");
        device.seed(10); // still under this test's seed guard
        let reloaded = config.init(&device).load_file(&path);
        let parameters = |module: &MultiHeadAttention| {
            let mut values = Vec::new();
            for linear in [&module.query, &module.key, &module.value, &module.output] {
                values.push(linear.weight.val().into_data());
                values.push(linear.bias.as_ref().unwrap().val().into_data());
            }
            for bias in [&module.bias_k, &module.bias_v] {
                values.push(bias.as_ref().unwrap().val().into_data());
            }
            values
        };
        for (saved, loaded) in parameters(&module).iter().zip(parameters(&reloaded)) {
            saved.assert_eq(&loaded, true);
        }
        let after = reloaded.forward(input()).context.into_data();
        if name == "wgpu" {
            // The autotuner may pick another kernel for the second call.
            after.assert_approx_eq::<f32>(&before, burn::tensor::Tolerance::absolute(1e-5));
        } else {
            before.assert_eq(&after, true);
        }
    }
    std::fs::remove_dir_all(&directory).ok();
}
