//! The `pytorch_import` example end to end: PyTorch state dicts in every layout through the
//! example's command line, against PyTorch's outputs, and its error messages. Fixtures:
//! `crates/mha/tests/fixtures/pytorch_import/`.

#[path = "../crates/mha/tests/common/pytorch_import_cases.rs"]
mod cases;
mod common;

use std::process::Command;
use std::time::Duration;

use cases::{CASES, fixture, read_f32, scratch};
use common::{example_binary, output_within};

/// Far more than a run of the example takes (a second); a run that loops fails here.
const EXAMPLE_LIMIT: Duration = Duration::from_secs(300);

#[test]
fn the_example_reproduces_pytorch_on_every_layout_and_mask_kind() {
    let binary = example_binary("pytorch_import");
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
            let run = output_within(&mut command, EXAMPLE_LIMIT);
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
    let binary = example_binary("pytorch_import");
    let run = |args: &[&str]| {
        let output = output_within(Command::new(&binary).args(args), EXAMPLE_LIMIT);
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
