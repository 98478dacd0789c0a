//! Loading and saving `torch.nn.MultiheadAttention` state dicts. Fixtures:
//! `tests/fixtures/generate_pytorch_fixtures.py` (`tests/fixtures/pytorch_import/`); the
//! `pytorch_import` example is tested end to end by the workspace root's
//! `tests/pytorch_import_example.rs`.

#[path = "common/pytorch_import_cases.rs"]
mod cases;

use std::path::PathBuf;

use burn::tensor::{Device, Distribution, Tensor};
use cases::{CASES, fixture, read_f32, scratch};
use mha::pytorch::{PytorchError, PytorchImport, load_pytorch_mha, save_pytorch_mha};
use mha::{MhaInput, MultiHeadAttention};

fn load(case: usize, device: &Device) -> MultiHeadAttention {
    let (_, weights, heads, prefix, zero_attn) = CASES[case];
    let import = PytorchImport::new(heads)
        .with_prefix(prefix)
        .with_add_zero_attn(zero_attn);
    load_pytorch_mha(fixture(weights), &import, device)
        .unwrap()
        .1
}

#[test]
fn load_infers_sizes_from_the_tensors() {
    let device = Device::flex();
    let import = PytorchImport::new(2).with_prefix("encoder.layers.0.self_attn");
    let (config, module) =
        load_pytorch_mha(fixture("separate_nested.pt"), &import, &device).unwrap();
    assert_eq!(
        (
            config.d_model,
            config.d_key_input,
            config.d_value_input,
            config.bias,
            config.add_bias_kv
        ),
        (16, Some(6), Some(10), true, false)
    );
    assert_eq!(module.n_heads(), 2);
    let (config, module) = load_pytorch_mha(
        fixture("no_bias.safetensors"),
        &PytorchImport::new(3),
        &device,
    )
    .unwrap();
    assert!(!config.bias && module.query.bias.is_none() && module.output.bias.is_none());
    let (config, _) = load_pytorch_mha(
        fixture("bias_kv_zero_attn.pt"),
        &PytorchImport::new(4).with_add_zero_attn(true),
        &device,
    )
    .unwrap();
    assert!(config.add_bias_kv && config.add_zero_attn);
}

#[test]
fn load_save_load_round_trips_every_layout() {
    let device = Device::flex();
    for (index, (case, _, heads, _, zero_attn)) in CASES.iter().enumerate() {
        let module = load(index, &device);
        let saved = scratch(&format!("{case}-roundtrip.safetensors"));
        save_pytorch_mha(&module, &saved, "").unwrap();
        let import = PytorchImport::new(*heads).with_add_zero_attn(*zero_attn);
        let (_, reloaded) = load_pytorch_mha(&saved, &import, &device).unwrap();
        let saved_again = scratch(&format!("{case}-roundtrip-2.safetensors"));
        save_pytorch_mha(&reloaded, &saved_again, "").unwrap();
        assert_eq!(
            read_f32(&saved),
            read_f32(&saved_again),
            "{case}: tensors identical"
        );
        // And the reloaded module computes exactly what the original does.
        let query = Tensor::<3>::random([1, 3, module.d_model()], Distribution::Default, &device);
        let key = Tensor::<3>::random([1, 4, module.d_key_input()], Distribution::Default, &device);
        let value = Tensor::<3>::random(
            [1, 4, module.d_value_input()],
            Distribution::Default,
            &device,
        );
        let input = MhaInput::new(query, key, value);
        let before = module.forward(input.clone()).context.into_data();
        let after = reloaded.forward(input).context.into_data();
        before.assert_eq(&after, true);
    }
    // The saved file of a file with a prefix keeps the layout PyTorch reads.
    let saved = scratch("prefixed.safetensors");
    save_pytorch_mha(&load(1, &device), &saved, "decoder.attn").unwrap();
    let names: Vec<String> = read_f32(&saved).into_iter().map(|t| t.0).collect();
    assert_eq!(
        names,
        [
            "decoder.attn.in_proj_bias",
            "decoder.attn.k_proj_weight",
            "decoder.attn.out_proj.bias",
            "decoder.attn.out_proj.weight",
            "decoder.attn.q_proj_weight",
            "decoder.attn.v_proj_weight"
        ]
    );
}

/// Writes a safetensors state dict from (key, shape) pairs filled with ones.
fn write_state(name: &str, tensors: &[(&str, Vec<usize>)]) -> PathBuf {
    let path = scratch(name);
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(key, shape)| {
            let count: usize = shape.iter().product();
            let bytes = (0..count).flat_map(|_| 1.0f32.to_le_bytes()).collect();
            (key.to_string(), shape.clone(), bytes)
        })
        .collect();
    let views: Vec<_> = data
        .iter()
        .map(|(key, shape, bytes)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                    .unwrap();
            (key.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
    path
}

// Longer than most: one table of damaged files, each checked for the file and key it names.
#[test]
fn bad_state_dicts_are_refused_naming_file_and_key() {
    let device = Device::flex();
    let good = |extra: Vec<(&'static str, Vec<usize>)>| {
        let mut tensors = vec![
            ("in_proj_weight", vec![24, 8]),
            ("in_proj_bias", vec![24]),
            ("out_proj.weight", vec![8, 8]),
            ("out_proj.bias", vec![8]),
        ];
        tensors.extend(extra);
        tensors
    };
    type StateDict = Vec<(&'static str, Vec<usize>)>;
    let cases: Vec<(&str, StateDict, usize, &str)> = vec![
        (
            "missing_out",
            vec![("in_proj_weight", vec![24, 8])],
            2,
            "missing key `out_proj.weight`",
        ),
        (
            "missing_in",
            vec![
                ("out_proj.weight", vec![8, 8]),
                ("out_proj.bias", vec![8]),
                ("in_proj_bias", vec![24]),
            ],
            2,
            "missing key `q_proj_weight`",
        ),
        (
            "unexpected",
            good(vec![("extra_weight", vec![3])]),
            2,
            "unexpected key `extra_weight`",
        ),
        (
            "bad_shape",
            vec![
                ("in_proj_weight", vec![24, 7]),
                ("out_proj.weight", vec![8, 8]),
            ],
            2,
            "`in_proj_weight` has shape [24, 7], expected [24, 8]",
        ),
        ("heads", good(vec![]), 3, "`n_heads` must divide `d_model`"),
        (
            "bias_k_alone",
            good(vec![("bias_k", vec![1, 1, 8])]),
            2,
            "missing key `bias_v`",
        ),
        (
            "bias_k_shape",
            good(vec![("bias_k", vec![8]), ("bias_v", vec![1, 1, 8])]),
            2,
            "`bias_k` has shape [8], expected [1, 1, 8]",
        ),
    ];
    for (name, tensors, heads, message) in cases {
        let path = write_state(&format!("{name}.safetensors"), &tensors);
        let error = load_pytorch_mha(&path, &PytorchImport::new(heads), &device).unwrap_err();
        let text = error.to_string();
        assert!(
            text.starts_with(&path.display().to_string()),
            "{name}: {text}"
        );
        assert!(
            text.contains(message),
            "{name}: {text} should contain {message}"
        );
    }
    let missing =
        load_pytorch_mha("/nonexistent/mha.pt", &PytorchImport::new(2), &device).unwrap_err();
    assert!(
        matches!(missing, PytorchError::Unreadable { .. }),
        "{missing}"
    );
    let wrong_prefix = load_pytorch_mha(
        fixture("separate_nested.pt"),
        &PytorchImport::new(2).with_prefix("decoder.attn."),
        &device,
    )
    .unwrap_err();
    assert!(
        wrong_prefix
            .to_string()
            .contains("missing key `decoder.attn.out_proj.weight`")
    );
    // GQA has no PyTorch layout.
    let gqa = mha::MultiHeadAttentionConfig::new(8, 4)
        .with_n_kv_heads(Some(2))
        .init(&device);
    let refused = save_pytorch_mha(&gqa, scratch("gqa.safetensors"), "").unwrap_err();
    assert!(
        refused.to_string().contains("grouped-query attention"),
        "{refused}"
    );
}

/// Every parameter of two modules, flattened, in a fixed order.
fn parameters(module: &MultiHeadAttention) -> Vec<(&'static str, Vec<f32>)> {
    let flat = |tensor: Tensor<2>| tensor.into_data().try_into_vec_as::<f32>().unwrap();
    let vector = |tensor: Tensor<1>| tensor.into_data().try_into_vec_as::<f32>().unwrap();
    let mut parameters = vec![
        ("W_q", flat(module.query.weight.val())),
        ("W_k", flat(module.key.weight.val())),
        ("W_v", flat(module.value.weight.val())),
        ("W_o", flat(module.output.weight.val())),
    ];
    for (name, linear) in [
        ("b_q", &module.query),
        ("b_k", &module.key),
        ("b_v", &module.value),
        ("b_o", &module.output),
    ] {
        if let Some(bias) = &linear.bias {
            parameters.push((name, vector(bias.val())));
        }
    }
    parameters
}

/// `reference` rounded to a float type with `mantissa_bits` bits of precision, as `actual`
/// must be (exactly for f64, which holds every f32).
fn assert_rounded(
    what: &str,
    actual: &[(&str, Vec<f32>)],
    reference: &[(&str, Vec<f32>)],
    relative: f32,
) {
    for ((name, actual), (_, reference)) in actual.iter().zip(reference) {
        for (a, r) in actual.iter().zip(reference) {
            assert!(
                (a - r).abs() <= relative * r.abs(),
                "{what}: {name} {a} vs {r} (relative bound {relative})"
            );
        }
    }
}

/// Writes `packed.pt`'s tensors to a safetensors file in `dtype`.
// Longer than most: safetensors' writer wants each dtype's bytes spelled out.
fn packed_as(dtype: safetensors::Dtype, name: &str) -> PathBuf {
    let device = Device::flex();
    let module = load(0, &device);
    let path = scratch(name);
    let torch_weight = |tensor: Tensor<2>| tensor.transpose();
    let packed = Tensor::cat(
        [&module.query, &module.key, &module.value]
            .map(|linear| torch_weight(linear.weight.val()))
            .to_vec(),
        0,
    );
    let in_bias = Tensor::cat(
        [&module.query, &module.key, &module.value]
            .map(|linear| linear.bias.as_ref().unwrap().val())
            .to_vec(),
        0,
    );
    let tensors: Vec<(&str, Vec<usize>, Vec<f32>)> = vec![
        (
            "in_proj_weight",
            packed.dims().to_vec(),
            packed.into_data().try_into_vec_as().unwrap(),
        ),
        (
            "in_proj_bias",
            in_bias.dims().to_vec(),
            in_bias.into_data().try_into_vec_as().unwrap(),
        ),
        (
            "out_proj.weight",
            vec![16, 16],
            torch_weight(module.output.weight.val())
                .into_data()
                .try_into_vec_as()
                .unwrap(),
        ),
        (
            "out_proj.bias",
            vec![16],
            module
                .output
                .bias
                .as_ref()
                .unwrap()
                .val()
                .into_data()
                .try_into_vec_as()
                .unwrap(),
        ),
    ];
    let encode = |values: &[f32]| -> Vec<u8> {
        match dtype {
            safetensors::Dtype::F16 => values
                .iter()
                .flat_map(|v| burn::tensor::f16::from_f32(*v).to_le_bytes())
                .collect(),
            safetensors::Dtype::BF16 => values
                .iter()
                .flat_map(|v| burn::tensor::bf16::from_f32(*v).to_le_bytes())
                .collect(),
            safetensors::Dtype::F64 => values
                .iter()
                .flat_map(|v| (*v as f64).to_le_bytes())
                .collect(),
            _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    };
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(key, shape, values)| (key.to_string(), shape.clone(), encode(values)))
        .collect();
    let views: Vec<_> = data
        .iter()
        .map(|(key, shape, bytes)| {
            (
                key.clone(),
                safetensors::tensor::TensorView::new(dtype, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
    path
}

/// f16, bf16 and f64 state dicts, `.pt` (written by PyTorch) and `.safetensors`, load as the
/// f32 weights rounded through their type.
#[test]
fn half_and_double_precision_state_dicts_load_as_their_rounded_weights() {
    let device = Device::flex();
    let reference = parameters(&load(0, &device));
    // f16 keeps 11 significant bits, bf16 8: half an ulp of relative error at most.
    let cases = [
        ("f16", fixture("packed_f16.pt"), 2f32.powi(-11)),
        ("bf16", fixture("packed_bf16.pt"), 2f32.powi(-8)),
        ("f64", fixture("packed_f64.pt"), 0.0),
        (
            "f16",
            packed_as(safetensors::Dtype::F16, "packed_f16.safetensors"),
            2f32.powi(-11),
        ),
        (
            "bf16",
            packed_as(safetensors::Dtype::BF16, "packed_bf16.safetensors"),
            2f32.powi(-8),
        ),
        (
            "f64",
            packed_as(safetensors::Dtype::F64, "packed_f64.safetensors"),
            0.0,
        ),
    ];
    for (dtype, file, relative) in cases {
        let (_, module) = load_pytorch_mha(&file, &PytorchImport::new(4), &device)
            .unwrap_or_else(|error| panic!("{dtype}: {error}"));
        assert_rounded(
            &format!("{dtype} {}", file.display()),
            &parameters(&module),
            &reference,
            relative,
        );
        if dtype != "f64" {
            // Rounded, so not identical: the file really held the narrower type.
            assert_ne!(parameters(&module), reference, "{dtype}: rounding happened");
        }
    }
}

#[test]
fn integer_weights_are_refused_naming_the_key_and_type() {
    let error = load_pytorch_mha(
        fixture("packed_int_weight.pt"),
        &PytorchImport::new(4),
        &Device::flex(),
    )
    .unwrap_err();
    assert!(
        matches!(&error, PytorchError::Dtype { key, .. } if key == "in_proj_weight"),
        "{error}"
    );
    let text = error.to_string();
    assert!(
        text.contains("packed_int_weight.pt: `in_proj_weight` has dtype"),
        "{text}"
    );
    assert!(text.contains("expected a float type"), "{text}");
}

#[test]
fn nan_or_infinite_weights_are_reported() {
    let device = Device::flex();
    let source = packed_as(safetensors::Dtype::F32, "finite.safetensors");
    let bytes = std::fs::read(&source).unwrap();
    let archive = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for (poison, name) in [(f32::NAN, "nan"), (f32::INFINITY, "inf")] {
        let mut data: Vec<(String, Vec<usize>, Vec<u8>)> = archive
            .tensors()
            .into_iter()
            .map(|(key, view)| (key, view.shape().to_vec(), view.data().to_vec()))
            .collect();
        let out = data
            .iter_mut()
            .find(|(key, _, _)| key == "out_proj.weight")
            .unwrap();
        out.2[20..24].copy_from_slice(&poison.to_le_bytes());
        let views: Vec<_> = data
            .iter()
            .map(|(key, shape, bytes)| {
                let view = safetensors::tensor::TensorView::new(
                    safetensors::Dtype::F32,
                    shape.clone(),
                    bytes,
                )
                .unwrap();
                (key.clone(), view)
            })
            .collect();
        let path = scratch(&format!("{name}.safetensors"));
        safetensors::serialize_to_file(views, None, &path).unwrap();
        let error = load_pytorch_mha(&path, &PytorchImport::new(4), &device).unwrap_err();
        assert!(
            matches!(&error, PytorchError::NonFinite { key, .. } if key == "out_proj.weight"),
            "{name}: {error}"
        );
        assert!(
            error.to_string().contains("holds NaN or infinite values"),
            "{error}"
        );
    }
}

/// A truncated or corrupt file is an error that names it — never a panic, never a module.
#[test]
fn truncated_or_corrupt_files_are_errors_naming_the_file() {
    let device = Device::flex();
    for source in ["packed.pt", "no_bias.safetensors", "separate_nested.pt"] {
        let bytes = std::fs::read(fixture(source)).unwrap();
        let length = bytes.len();
        let mut damaged: Vec<(String, Vec<u8>)> = [0, 7, 64, length / 3, length / 2, length - 9]
            .into_iter()
            .map(|cut| (format!("cut at {cut}"), bytes[..cut].to_vec()))
            .collect();
        for (label, offset) in [
            ("flipped header", 3),
            ("flipped middle", length / 2),
            ("flipped end", length - 20),
        ] {
            let mut flipped = bytes.clone();
            for byte in &mut flipped[offset..offset + 8] {
                *byte ^= 0xA5;
            }
            damaged.push((label.to_string(), flipped));
        }
        let extension = if source.ends_with(".pt") {
            "pt"
        } else {
            "safetensors"
        };
        for (index, (label, content)) in damaged.into_iter().enumerate() {
            let path = scratch(&format!("damaged-{index}-{source}.{extension}"));
            std::fs::write(&path, content).unwrap();
            let heads = if source.starts_with("no_bias") {
                3
            } else if source.starts_with("separate") {
                2
            } else {
                4
            };
            let import = PytorchImport::new(heads).with_prefix(if source.starts_with("separate") {
                "encoder.layers.0.self_attn."
            } else {
                ""
            });
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                load_pytorch_mha(&path, &import, &device)
            }));
            let result = result.unwrap_or_else(|_| panic!("{source} {label}: the loader panicked"));
            // A flip may land in bytes no reader checks (padding, a name's unused tail): then
            // the load may succeed, and must give finite weights.
            match result {
                Err(error) => {
                    let text = error.to_string();
                    assert!(
                        text.starts_with(&path.display().to_string()),
                        "{source} {label}: {text}"
                    );
                }
                Ok((_, module)) => {
                    assert!(
                        label.starts_with("flipped"),
                        "{source} {label}: a truncated file loaded"
                    );
                    assert!(
                        parameters(&module)
                            .iter()
                            .all(|(_, values)| values.iter().all(|v| v.is_finite()))
                    );
                }
            }
        }
    }
}

#[test]
fn modules_pytorch_computes_differently_are_not_exported() {
    let device = Device::flex();
    let cases = [
        (
            mha::MultiHeadAttentionConfig::new(8, 2).with_rope(Some(mha::RopeConfig::new())),
            "RoPE",
        ),
        (
            mha::MultiHeadAttentionConfig::new(8, 2).with_alibi(true),
            "ALiBi",
        ),
        (
            mha::MultiHeadAttentionConfig::new(8, 2).with_scale(Some(0.3)),
            "custom scale",
        ),
        (
            mha::MultiHeadAttentionConfig::new(8, 2).with_quiet_softmax(true),
            "quiet softmax",
        ),
    ];
    for (config, what) in cases {
        let error = save_pytorch_mha(&config.init(&device), scratch("refused.safetensors"), "")
            .unwrap_err();
        assert!(
            matches!(error, PytorchError::Unsupported { .. }),
            "{what}: {error}"
        );
        assert!(
            error
                .to_string()
                .contains("torch.nn.MultiheadAttention cannot express it"),
            "{what}: {error}"
        );
    }
}
