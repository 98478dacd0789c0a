//! Loading and saving `torch.nn.MultiheadAttention` state dicts, and the `pytorch_import`
//! example end to end. Fixtures: `tests/fixtures/generate_pytorch_fixtures.py`
//! (`tests/fixtures/pytorch_import/`).

use std::path::{Path, PathBuf};
use std::process::Command;

use burn::tensor::{Device, Distribution, Tensor};
use mha::pytorch::{PytorchError, PytorchImport, load_pytorch_mha, save_pytorch_mha};
use mha::{MhaInput, MultiHeadAttention};
use safetensors::SafeTensors;

/// (case, weights file, num_heads, prefix, add_zero_attn)
const CASES: [(&str, &str, usize, &str, bool); 5] = [
    ("packed", "packed.pt", 4, "", false),
    (
        "separate_nested",
        "separate_nested.pt",
        2,
        "encoder.layers.0.self_attn.",
        false,
    ),
    ("no_bias", "no_bias.safetensors", 3, "", false),
    ("bias_kv_zero_attn", "bias_kv_zero_attn.pt", 4, "", true),
    (
        "separate_bias_kv",
        "separate_bias_kv.safetensors",
        2,
        "",
        false,
    ),
];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/pytorch_import")
        .join(name)
}

fn scratch(name: &str) -> PathBuf {
    let directory = std::env::temp_dir().join(format!("mha-pytorch-import-{}", std::process::id()));
    std::fs::create_dir_all(&directory).unwrap();
    directory.join(name)
}

/// Every f32 tensor of a safetensors file: name → (shape, values).
fn read_f32(path: &Path) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let archive = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<_> = archive
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (name, view.shape().to_vec(), values)
        })
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    tensors
}

fn example_binary() -> PathBuf {
    // target/<profile>/deps/<this test> → target/<profile>/examples/pytorch_import
    let test_binary = std::env::current_exe().unwrap();
    let profile_dir = test_binary.parent().unwrap().parent().unwrap();
    profile_dir.join("examples").join("pytorch_import")
}

#[test]
fn the_example_reproduces_pytorch_on_every_layout_and_mask_kind() {
    let binary = example_binary();
    assert!(
        binary.exists(),
        "{} is missing: `cargo test` builds the examples first",
        binary.display()
    );
    for device in ["flex", "ndarray"] {
        for (case, weights, heads, prefix, zero_attn) in CASES {
            let output = scratch(&format!("{case}-{device}.safetensors"));
            let mut command = Command::new(&binary);
            command
                .arg("--weights")
                .arg(fixture(weights))
                .args(["--num-heads", &heads.to_string()])
                .arg("--inputs")
                .arg(fixture(&format!("{case}_inputs.safetensors")))
                .arg("--output")
                .arg(&output)
                .args(["--device", device]);
            if !prefix.is_empty() {
                command.args(["--prefix", prefix]);
            }
            if zero_attn {
                command.arg("--add-zero-attn");
            }
            let run = command.output().unwrap();
            assert!(
                run.status.success(),
                "{case} on {device}: {}",
                String::from_utf8_lossy(&run.stderr)
            );
            let actual = read_f32(&output);
            let expected = read_f32(&fixture(&format!("{case}_expected.safetensors")));
            assert_eq!(actual.len(), 2);
            for ((name, shape, values), (expected_name, expected_shape, expected_values)) in
                actual.iter().zip(&expected)
            {
                assert_eq!((name, shape), (expected_name, expected_shape), "{case}");
                let diff = values
                    .iter()
                    .zip(expected_values)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(
                    diff <= 1e-5,
                    "{case} on {device}: {name} differs by {diff:e}"
                );
            }
        }
    }
}

#[test]
fn the_example_reports_bad_arguments_and_files_in_one_line() {
    let binary = example_binary();
    let run = |args: &[&str]| {
        let output = Command::new(&binary).args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr).to_string();
        (output.status.code(), stderr)
    };
    let weights = fixture("packed.pt");
    let inputs = fixture("packed_inputs.safetensors");
    let output = scratch("unused.safetensors");
    let no_bias = fixture("no_bias.safetensors");
    let no_bias = no_bias.to_str().unwrap();
    let (weights, inputs, output) = (
        weights.to_str().unwrap(),
        inputs.to_str().unwrap(),
        output.to_str().unwrap(),
    );
    let cases: Vec<(Vec<&str>, i32, &str)> = vec![
        (vec!["--weights", weights], 2, "`--num-heads` is required"),
        (
            vec![
                "--weights",
                weights,
                "--num-heads",
                "x",
                "--inputs",
                inputs,
                "--output",
                output,
            ],
            2,
            "`--num-heads` must be a positive integer, got `x`",
        ),
        (vec!["--bogus"], 2, "unexpected argument `--bogus`"),
        (
            vec![
                "--weights",
                "/nonexistent.pt",
                "--num-heads",
                "4",
                "--inputs",
                inputs,
                "--output",
                output,
            ],
            1,
            "/nonexistent.pt: cannot read",
        ),
        (
            vec![
                "--weights",
                weights,
                "--num-heads",
                "3",
                "--inputs",
                inputs,
                "--output",
                output,
            ],
            1,
            "`n_heads` must divide `d_model`",
        ),
        (
            vec![
                "--weights",
                weights,
                "--num-heads",
                "4",
                "--inputs",
                weights,
                "--output",
                output,
            ],
            1,
            "not a safetensors file",
        ),
        (
            vec![
                "--weights",
                no_bias,
                "--num-heads",
                "3",
                "--inputs",
                inputs,
                "--output",
                output,
            ],
            1,
            "`query` must have shape [batch, seq_q, d_model=12], got [2, 4, 16]",
        ),
    ];
    for (args, code, message) in cases {
        let (status, stderr) = run(&args);
        assert_eq!(status, Some(code), "{args:?}: {stderr}");
        assert!(stderr.starts_with("error: "), "{args:?}: {stderr}");
        assert!(
            stderr.contains(message),
            "{args:?}: {stderr} should contain {message}"
        );
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

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
    assert_eq!(module.n_heads, 2);
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
        let query = Tensor::<3>::random([1, 3, module.d_model], Distribution::Default, &device);
        let key = Tensor::<3>::random([1, 4, module.d_key_input], Distribution::Default, &device);
        let value =
            Tensor::<3>::random([1, 4, module.d_value_input], Distribution::Default, &device);
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
