//! Runs a `torch.nn.MultiheadAttention` state dict in Burn: loads the weights, reads inputs
//! from a safetensors file, writes the output and per-head weights to another.
//!
//! ```sh
//! cargo run --release --example pytorch_import -- --weights mha.pt --num-heads 4 \
//!     --inputs inputs.safetensors --output out.safetensors [--prefix encoder.self_attn.] \
//!     [--add-zero-attn] [--device flex|ndarray|wgpu]
//! ```
//!
//! `--inputs` holds `query [B, L, E]`, `key [B, S, kdim]`, `value [B, S, vdim]` (batch first)
//! and optionally `key_padding_mask [B, S]` and `attn_mask [L, S]`: bool or uint8 with
//! 1 = ignore (PyTorch's polarity), or float, added to the scores. `--output` receives
//! `attn_output [B, L, E]` and `attn_weights [B, H, L, S']` (f32), where `S'` counts the key
//! positions `add_bias_kv`/`add_zero_attn` append, as PyTorch returns them.
//!
//! Errors are one line on stderr and exit status 1 (2 for bad arguments).

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use burn::tensor::{Device, Tensor, TensorData};
use burn_mha::device_by_name;
use mha::pytorch::{PytorchImport, load_pytorch_mha};
use mha::{MhaInput, NeedWeights};
use safetensors::{Dtype, SafeTensors};

const USAGE: &str = "usage: pytorch_import --weights FILE --num-heads H --inputs FILE --output FILE \
                     [--prefix P] [--add-zero-attn] [--device flex|ndarray|wgpu]";

struct Arguments {
    weights: PathBuf,
    num_heads: usize,
    inputs: PathBuf,
    output: PathBuf,
    prefix: String,
    add_zero_attn: bool,
    device: String,
}

fn main() {
    let arguments = parse_arguments().unwrap_or_else(|message| {
        eprintln!("error: {message}\n{USAGE}");
        std::process::exit(2)
    });
    if let Err(message) = run(arguments) {
        eprintln!("error: {message}");
        std::process::exit(1)
    }
}

fn parse_arguments() -> Result<Arguments, String> {
    let mut weights = None;
    let mut num_heads = None;
    let mut inputs = None;
    let mut output = None;
    let mut prefix = String::new();
    let mut add_zero_attn = false;
    let mut device = String::from("flex");
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("`{arg}` needs a value"));
        match arg.as_str() {
            "--weights" => weights = Some(PathBuf::from(value()?)),
            "--num-heads" => {
                let text = value()?;
                num_heads = Some(text.parse::<usize>().map_err(|_| {
                    format!("`--num-heads` must be a positive integer, got `{text}`")
                })?)
            }
            "--inputs" => inputs = Some(PathBuf::from(value()?)),
            "--output" => output = Some(PathBuf::from(value()?)),
            "--prefix" => prefix = value()?,
            "--device" => device = value()?,
            "--add-zero-attn" => add_zero_attn = true,
            "--help" | "-h" => {
                println!("{USAGE}");
                std::process::exit(0)
            }
            other => return Err(format!("unexpected argument `{other}`")),
        }
    }
    Ok(Arguments {
        weights: weights.ok_or("`--weights` is required")?,
        num_heads: num_heads.ok_or("`--num-heads` is required")?,
        inputs: inputs.ok_or("`--inputs` is required")?,
        output: output.ok_or("`--output` is required")?,
        prefix,
        add_zero_attn,
        device,
    })
}

/// A tensor of the inputs file: its shape, and its values as f32 (bool and uint8 as 0/1).
struct InputTensor {
    shape: Vec<usize>,
    values: Vec<f32>,
    is_bool: bool,
}

fn read_inputs(path: &Path) -> Result<HashMap<String, InputTensor>, String> {
    let bytes = std::fs::read(path).map_err(|error| format!("{}: {error}", path.display()))?;
    let archive = SafeTensors::deserialize(&bytes)
        .map_err(|error| format!("{}: not a safetensors file: {error}", path.display()))?;
    let mut tensors = HashMap::new();
    for (name, view) in archive.tensors() {
        let data = view.data();
        let (values, is_bool) = match view.dtype() {
            Dtype::F32 => (
                data.chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect(),
                false,
            ),
            Dtype::F64 => (
                data.chunks_exact(8)
                    .map(|b| f64::from_le_bytes(b.try_into().unwrap()) as f32)
                    .collect(),
                false,
            ),
            Dtype::BOOL | Dtype::U8 => (data.iter().map(|&b| f32::from(b != 0)).collect(), true),
            other => {
                return Err(format!(
                    "{}: `{name}` has dtype {other:?}; expected f32, f64, bool or uint8",
                    path.display()
                ));
            }
        };
        tensors.insert(
            name,
            InputTensor {
                shape: view.shape().to_vec(),
                values,
                is_bool,
            },
        );
    }
    Ok(tensors)
}

fn tensor<const D: usize>(
    inputs: &HashMap<String, InputTensor>,
    name: &str,
    file: &Path,
    device: &Device,
) -> Result<Option<Tensor<D>>, String> {
    let Some(input) = inputs.get(name) else {
        return Ok(None);
    };
    if input.shape.len() != D {
        return Err(format!(
            "{}: `{name}` must have rank {D}, got shape {:?}",
            file.display(),
            input.shape
        ));
    }
    let data = TensorData::new(input.values.clone(), input.shape.clone());
    Ok(Some(Tensor::from_data(data, device)))
}

fn run(arguments: Arguments) -> Result<(), String> {
    let device = device_by_name(&arguments.device)?;
    let import = PytorchImport::new(arguments.num_heads)
        .with_prefix(arguments.prefix.clone())
        .with_add_zero_attn(arguments.add_zero_attn);
    let (_, module) = load_pytorch_mha(&arguments.weights, &import, &device)
        .map_err(|error| error.to_string())?;

    let file = &arguments.inputs;
    let inputs = read_inputs(file)?;
    let required = |name: &str| -> Result<Tensor<3>, String> {
        tensor::<3>(&inputs, name, file, &device)?
            .ok_or_else(|| format!("{}: missing tensor `{name}`", file.display()))
    };
    let (query, key, value) = (required("query")?, required("key")?, required("value")?);
    let padding = tensor::<2>(&inputs, "key_padding_mask", file, &device)?;
    let attn_mask = tensor::<2>(&inputs, "attn_mask", file, &device)?;
    let padding_is_bool = inputs.get("key_padding_mask").is_some_and(|t| t.is_bool);
    let attn_is_bool = inputs.get("attn_mask").is_some_and(|t| t.is_bool);

    let mut input =
        MhaInput::new(query.clone(), key.clone(), value).need_weights(NeedWeights::PerHead);
    let all_bool = (padding.is_none() || padding_is_bool) && (attn_mask.is_none() || attn_is_bool);
    if all_bool {
        if let Some(padding) = padding {
            input = input.key_padding_mask(padding.equal_elem(1.0));
        }
        if let Some(mask) = attn_mask {
            input = input.attn_mask(mask.equal_elem(1.0));
        }
    } else {
        // PyTorch adds float masks to the scores; a bool mask next to a float one becomes
        // -inf where it forbids. Both merge into one additive [B, 1, L, S] mask.
        let [batch, seq_q, _] = query.dims();
        let seq_k = key.dims()[1];
        let additive = |mask: Tensor<2>, is_bool: bool| {
            if is_bool {
                Tensor::<2>::zeros(mask.dims(), &device)
                    .mask_fill(mask.equal_elem(1.0), f32::NEG_INFINITY)
            } else {
                mask
            }
        };
        let mut bias = Tensor::<4>::zeros([batch, 1, seq_q, seq_k], &device);
        if let Some(padding) = padding {
            check_dims(&padding, [batch, seq_k], "key_padding_mask", file)?;
            bias = bias + additive(padding, padding_is_bool).reshape([batch, 1, 1, seq_k]);
        }
        if let Some(mask) = attn_mask {
            check_dims(&mask, [seq_q, seq_k], "attn_mask", file)?;
            bias = bias + additive(mask, attn_is_bool).reshape([1, 1, seq_q, seq_k]);
        }
        input = input.attn_mask(bias);
    }

    let output = forward_reporting_panics(|| module.forward(input))?;
    let weights = output
        .weights
        .and_then(|w| w.per_head())
        .expect("per-head weights requested");
    write_outputs(&arguments.output, output.context, weights)
}

fn check_dims(
    mask: &Tensor<2>,
    expected: [usize; 2],
    name: &str,
    file: &Path,
) -> Result<(), String> {
    if mask.dims() == expected {
        Ok(())
    } else {
        Err(format!(
            "{}: `{name}` must have shape {expected:?}, got {:?}",
            file.display(),
            mask.dims()
        ))
    }
}

/// Runs the forward; a shape panic becomes its one-line message.
fn forward_reporting_panics<T>(forward: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::set_hook(Box::new(|_| {}));
    let result = catch_unwind(AssertUnwindSafe(forward)).map_err(|payload| {
        payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "the forward pass failed".into())
    });
    let _ = std::panic::take_hook();
    result
}

fn write_outputs(path: &Path, context: Tensor<3>, weights: Tensor<4>) -> Result<(), String> {
    let as_bytes = |data: TensorData| -> Vec<u8> {
        data.try_into_vec_as::<f32>()
            .expect("f32")
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect()
    };
    let context_shape = context.dims().to_vec();
    let weights_shape = weights.dims().to_vec();
    let context_bytes = as_bytes(context.into_data());
    let weights_bytes = as_bytes(weights.into_data());
    let views = vec![
        (
            "attn_output",
            safetensors::tensor::TensorView::new(Dtype::F32, context_shape, &context_bytes)
                .expect("shape matches data"),
        ),
        (
            "attn_weights",
            safetensors::tensor::TensorView::new(Dtype::F32, weights_shape, &weights_bytes)
                .expect("shape matches data"),
        ),
    ];
    safetensors::serialize_to_file(views, None, path)
        .map_err(|error| format!("{}: cannot write: {error}", path.display()))
}
