//! The `pytorch_import` fixtures (written by `crates/mha/tests/fixtures/generate_pytorch_fixtures.py`)
//! and helpers to read them, shared by `crates/mha/tests/pytorch_import.rs` and the workspace
//! root's `tests/pytorch_import_example.rs`.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::{Path, PathBuf};

use safetensors::SafeTensors;

/// (case, weights file, num_heads, prefix, add_zero_attn)
pub const CASES: [(&str, &str, usize, &str, bool); 5] = [
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

/// `crates/mha/tests/fixtures/pytorch_import/<name>`, from the `mha` crate's tests or the
/// workspace root's.
pub fn fixture(name: &str) -> PathBuf {
    let base = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    [
        "tests/fixtures/pytorch_import",
        "crates/mha/tests/fixtures/pytorch_import",
    ]
    .iter()
    .map(|directory| base.join(directory))
    .find(|directory| directory.is_dir())
    .expect("the pytorch_import fixtures")
    .join(name)
}

pub fn scratch(name: &str) -> PathBuf {
    let directory = std::env::temp_dir().join(format!("mha-pytorch-import-{}", std::process::id()));
    std::fs::create_dir_all(&directory).unwrap();
    directory.join(name)
}

/// Every f32 tensor of a safetensors file: name → (shape, values).
pub fn read_f32(path: &Path) -> Vec<(String, Vec<usize>, Vec<f32>)> {
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
