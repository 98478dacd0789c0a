//! Loading and saving `torch.nn.MultiheadAttention` weights (feature `pytorch`).
//!
//! PyTorch's state dict for one attention module holds, under the module's key prefix:
//!
//! | key | shape | when |
//! |---|---|---|
//! | `in_proj_weight` | `[3E, E]`, q; k; v stacked | `kdim == vdim == embed_dim` |
//! | `q_proj_weight`, `k_proj_weight`, `v_proj_weight` | `[E, E]`, `[E, kdim]`, `[E, vdim]` | otherwise |
//! | `in_proj_bias` | `[3E]` | `bias=True` |
//! | `out_proj.weight`, `out_proj.bias` | `[E, E]`, `[E]` | always, the bias with `bias=True` |
//! | `bias_k`, `bias_v` | `[1, 1, E]` | `add_bias_kv=True` |
//!
//! PyTorch stores linear weights as `[out, in]`; Burn's [`Linear`](burn::nn::Linear) holds
//! `[in, out]`, so weights are transposed both ways. The head count and `add_zero_attn` are
//! not in the state dict: the caller gives them.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

use burn::module::Param;
use burn::store::pytorch_reader::{self, PytorchReader};
use burn::tensor::{Device, Tensor, TensorData, bf16, f16};
use safetensors::{Dtype, SafeTensors};

use crate::{ConfigError, MultiHeadAttention, MultiHeadAttentionConfig};

/// What the state dict does not say: where the module is and how many heads it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PytorchImport {
    /// `num_heads` of the PyTorch module.
    pub n_heads: usize,
    /// Key prefix of the module in the file, e.g. `encoder.layers.0.self_attn.` (the trailing
    /// dot may be omitted). Default: empty, the file holds the module alone.
    pub prefix: String,
    /// `add_zero_attn` of the PyTorch module. Default: false.
    pub add_zero_attn: bool,
}

impl PytorchImport {
    /// Import settings for a module with `n_heads` heads at the top of the file.
    pub fn new(n_heads: usize) -> Self {
        Self {
            n_heads,
            prefix: String::new(),
            add_zero_attn: false,
        }
    }

    /// Sets the key prefix of the module in the file.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Sets PyTorch's `add_zero_attn`.
    pub fn with_add_zero_attn(mut self, add_zero_attn: bool) -> Self {
        self.add_zero_attn = add_zero_attn;
        self
    }
}

/// Why a PyTorch state dict could not be loaded or saved. Every variant names the file.
#[derive(Debug)]
#[non_exhaustive]
pub enum PytorchError {
    /// The file could not be read or parsed.
    Unreadable {
        /// The file.
        file: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The file could not be written.
    Unwritable {
        /// The file.
        file: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A key the module needs is absent.
    MissingKey {
        /// The file.
        file: PathBuf,
        /// The full key, prefix included.
        key: String,
    },
    /// A key under the prefix is not part of an `nn.MultiheadAttention`.
    UnexpectedKey {
        /// The file.
        file: PathBuf,
        /// The full key, prefix included.
        key: String,
    },
    /// A tensor's shape does not fit the others.
    Shape {
        /// The file.
        file: PathBuf,
        /// The full key, prefix included.
        key: String,
        /// What the other tensors imply.
        expected: Vec<usize>,
        /// What the file holds.
        actual: Vec<usize>,
    },
    /// The sizes read from the file and the caller's settings make an invalid configuration
    /// (`n_heads` not dividing `embed_dim`, say).
    Config {
        /// The file.
        file: PathBuf,
        /// The rule broken.
        error: ConfigError,
    },
    /// A tensor the module needs has no float type (PyTorch weights are f32, f64, f16 or bf16).
    Dtype {
        /// The file.
        file: PathBuf,
        /// The full key, prefix included.
        key: String,
        /// The tensor's type.
        dtype: String,
    },
    /// A tensor the module needs holds NaN or an infinity.
    NonFinite {
        /// The file.
        file: PathBuf,
        /// The full key, prefix included.
        key: String,
    },
    /// The module has no PyTorch equivalent (grouped-query attention, say).
    Unsupported {
        /// The file.
        file: PathBuf,
        /// Why.
        message: String,
    },
}

impl fmt::Display for PytorchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unreadable { file, message } => {
                write!(f, "{}: cannot read: {message}", file.display())
            }
            Self::Unwritable { file, message } => {
                write!(f, "{}: cannot write: {message}", file.display())
            }
            Self::MissingKey { file, key } => {
                write!(f, "{}: missing key `{key}`", file.display())
            }
            Self::UnexpectedKey { file, key } => write!(
                f,
                "{}: unexpected key `{key}`: not a torch.nn.MultiheadAttention parameter",
                file.display()
            ),
            Self::Shape {
                file,
                key,
                expected,
                actual,
            } => write!(
                f,
                "{}: `{key}` has shape {actual:?}, expected {expected:?}",
                file.display()
            ),
            Self::Config { file, error } => write!(f, "{}: {error}", file.display()),
            Self::Dtype { file, key, dtype } => write!(
                f,
                "{}: `{key}` has dtype {dtype}, expected a float type (f32, f64, f16 or bf16)",
                file.display()
            ),
            Self::NonFinite { file, key } => write!(
                f,
                "{}: `{key}` holds NaN or infinite values",
                file.display()
            ),
            Self::Unsupported { file, message } => write!(f, "{}: {message}", file.display()),
        }
    }
}

impl core::error::Error for PytorchError {}

/// A tensor read from a file: shape and row-major f32 values (converted from f16, bf16 or f64),
/// or the name of a non-float dtype, which is an error only if the module needs the tensor.
#[derive(Debug, Clone, PartialEq)]
struct RawTensor {
    shape: Vec<usize>,
    values: Vec<f32>,
    /// The dtype when it is not a float type; `values` is then empty.
    non_float: Option<String>,
}

impl RawTensor {
    fn float(shape: Vec<usize>, values: Vec<f32>) -> Self {
        Self {
            shape,
            values,
            non_float: None,
        }
    }

    /// A tensor of the file, converted to f32, or its dtype's name if it has no float type;
    /// refuses a byte count that does not fit the shape.
    fn read(key: &str, shape: Vec<usize>, dtype: FileDType, bytes: &[u8]) -> Result<Self, String> {
        let values = match dtype {
            FileDType::F32 => floats(bytes, f32::from_le_bytes),
            FileDType::F64 => floats(bytes, |b: [u8; 8]| f64::from_le_bytes(b) as f32),
            FileDType::F16 => floats(bytes, |b: [u8; 2]| f16::from_le_bytes(b).to_f32()),
            FileDType::BF16 => floats(bytes, |b: [u8; 2]| bf16::from_le_bytes(b).to_f32()),
            FileDType::Other(name) => {
                return Ok(Self {
                    shape,
                    values: Vec::new(),
                    non_float: Some(name),
                });
            }
        };
        let elements: usize = shape.iter().product();
        if values.len() != elements {
            return Err(format!(
                "`{key}` holds {} values for shape {shape:?} ({elements} elements)",
                values.len()
            ));
        }
        Ok(Self::float(shape, values))
    }
}

/// The dtypes the readers tell apart.
enum FileDType {
    F32,
    F64,
    F16,
    BF16,
    Other(String),
}

/// Every key an `nn.MultiheadAttention` state dict can hold, relative to the module.
const KNOWN_KEYS: [&str; 9] = [
    "in_proj_weight",
    "in_proj_bias",
    "q_proj_weight",
    "k_proj_weight",
    "v_proj_weight",
    "out_proj.weight",
    "out_proj.bias",
    "bias_k",
    "bias_v",
];

/// Reads a `torch.nn.MultiheadAttention` from a `.pt`/`.pth` (`torch.save` of a state dict,
/// or of a dict holding one under `state_dict`, `model` or `model_state_dict`) or a
/// `.safetensors` file, returning its configuration and the module with its weights.
///
/// `embed_dim`, `kdim`, `vdim`, `bias` and `add_bias_kv` are read off the tensors. The file is
/// checked whole before the module is built, so a failed load returns no module.
pub fn load_pytorch_mha(
    path: impl AsRef<Path>,
    import: &PytorchImport,
    device: &Device,
) -> Result<(MultiHeadAttentionConfig, MultiHeadAttention), PytorchError> {
    let file = path.as_ref().to_path_buf();
    let tensors = read_tensors(&file)?;
    let state = ModuleState::locate(&file, tensors, &import.prefix)?;
    state.build(import, device)
}

/// The tensors of one module: keys relative to its prefix.
struct ModuleState {
    file: PathBuf,
    prefix: String,
    tensors: HashMap<String, RawTensor>,
}

impl ModuleState {
    /// Picks the module's tensors out of the file, trying the caller's prefix alone and then
    /// under the usual checkpoint wrappers.
    fn locate(
        file: &Path,
        mut tensors: HashMap<String, RawTensor>,
        prefix: &str,
    ) -> Result<Self, PytorchError> {
        let prefix = if prefix.is_empty() || prefix.ends_with('.') {
            prefix.to_string()
        } else {
            format!("{prefix}.")
        };
        let full_prefix = ["", "state_dict.", "model.", "model_state_dict."]
            .iter()
            .map(|wrapper| format!("{wrapper}{prefix}"))
            .find(|candidate| tensors.contains_key(&format!("{candidate}out_proj.weight")))
            .ok_or_else(|| PytorchError::MissingKey {
                file: file.to_path_buf(),
                key: format!("{prefix}out_proj.weight"),
            })?;
        let keys: Vec<String> = tensors
            .keys()
            .filter(|key| key.starts_with(&full_prefix))
            .cloned()
            .collect();
        let mut own = HashMap::new();
        for key in keys {
            let relative = key[full_prefix.len()..].to_string();
            if !KNOWN_KEYS.contains(&relative.as_str()) {
                // A nested module's key (`...self_attn.sub.weight`) is not ours either.
                return Err(PytorchError::UnexpectedKey {
                    file: file.to_path_buf(),
                    key,
                });
            }
            own.insert(relative, tensors.remove(&key).expect("listed key"));
        }
        Ok(Self {
            file: file.to_path_buf(),
            prefix: full_prefix,
            tensors: own,
        })
    }

    fn full_key(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// The tensor under `key`, refused unless it is a float tensor of finite values.
    fn take(&mut self, key: &str) -> Result<RawTensor, PytorchError> {
        let tensor = self
            .tensors
            .remove(key)
            .ok_or_else(|| PytorchError::MissingKey {
                file: self.file.clone(),
                key: self.full_key(key),
            })?;
        if let Some(dtype) = tensor.non_float {
            return Err(PytorchError::Dtype {
                file: self.file.clone(),
                key: self.full_key(key),
                dtype,
            });
        }
        if !tensor.values.iter().all(|value| value.is_finite()) {
            return Err(PytorchError::NonFinite {
                file: self.file.clone(),
                key: self.full_key(key),
            });
        }
        Ok(tensor)
    }

    fn expect_shape(
        &self,
        key: &str,
        tensor: &RawTensor,
        expected: &[usize],
    ) -> Result<(), PytorchError> {
        if tensor.shape == expected {
            Ok(())
        } else {
            Err(PytorchError::Shape {
                file: self.file.clone(),
                key: self.full_key(key),
                expected: expected.to_vec(),
                actual: tensor.shape.clone(),
            })
        }
    }

    fn build(
        mut self,
        import: &PytorchImport,
        device: &Device,
    ) -> Result<(MultiHeadAttentionConfig, MultiHeadAttention), PytorchError> {
        let out_weight = self.take("out_proj.weight")?;
        let embed_dim = out_weight.shape.first().copied().unwrap_or(0);
        self.expect_shape("out_proj.weight", &out_weight, &[embed_dim, embed_dim])?;
        let [q_weight, k_weight, v_weight] = self.take_input_weights(embed_dim)?;
        let (d_key_input, d_value_input) = (k_weight.shape[1], v_weight.shape[1]);
        let biases = self.take_biases(embed_dim)?;
        let kv_biases = self.take_kv_biases(embed_dim)?;

        let config = MultiHeadAttentionConfig::new(embed_dim, import.n_heads)
            .with_d_key_input(Some(d_key_input))
            .with_d_value_input(Some(d_value_input))
            .with_bias(biases.is_some())
            .with_add_bias_kv(kv_biases.is_some())
            .with_add_zero_attn(import.add_zero_attn);
        let mut module = config
            .try_init(device)
            .map_err(|error| PytorchError::Config {
                file: self.file.clone(),
                error,
            })?;

        module.query.weight = Param::from_tensor(linear_weight(q_weight, device));
        module.key.weight = Param::from_tensor(linear_weight(k_weight, device));
        module.value.weight = Param::from_tensor(linear_weight(v_weight, device));
        module.output.weight = Param::from_tensor(linear_weight(out_weight, device));
        if let Some(([q, k, v], out)) = biases {
            module.query.bias = Some(Param::from_tensor(vector(q, device)));
            module.key.bias = Some(Param::from_tensor(vector(k, device)));
            module.value.bias = Some(Param::from_tensor(vector(v, device)));
            module.output.bias = Some(Param::from_tensor(vector(out, device)));
        }
        if let Some((bias_k, bias_v)) = kv_biases {
            module.bias_k = Some(Param::from_tensor(vector(bias_k, device)));
            module.bias_v = Some(Param::from_tensor(vector(bias_v, device)));
        }
        Ok((config, module))
    }

    /// The query, key and value projection weights (PyTorch's `[out, in]`), packed or not.
    fn take_input_weights(&mut self, embed_dim: usize) -> Result<[RawTensor; 3], PytorchError> {
        if self.tensors.contains_key("in_proj_weight") {
            for separate in ["q_proj_weight", "k_proj_weight", "v_proj_weight"] {
                if self.tensors.contains_key(separate) {
                    return Err(PytorchError::UnexpectedKey {
                        file: self.file.clone(),
                        key: self.full_key(separate),
                    });
                }
            }
            let in_proj = self.take("in_proj_weight")?;
            self.expect_shape("in_proj_weight", &in_proj, &[3 * embed_dim, embed_dim])?;
            return Ok(split_rows::<3>(in_proj));
        }
        let q = self.take("q_proj_weight")?;
        self.expect_shape("q_proj_weight", &q, &[embed_dim, embed_dim])?;
        let k = self.take("k_proj_weight")?;
        let kdim = k.shape.get(1).copied().unwrap_or(0);
        self.expect_shape("k_proj_weight", &k, &[embed_dim, kdim])?;
        let v = self.take("v_proj_weight")?;
        let vdim = v.shape.get(1).copied().unwrap_or(0);
        self.expect_shape("v_proj_weight", &v, &[embed_dim, vdim])?;
        Ok([q, k, v])
    }

    /// The q, k, v and output biases (`bias=True`), or `None` (`bias=False`, which drops all
    /// four).
    #[allow(clippy::type_complexity)] // one use, named by its doc
    fn take_biases(
        &mut self,
        embed_dim: usize,
    ) -> Result<Option<([RawTensor; 3], RawTensor)>, PytorchError> {
        if !self.tensors.contains_key("in_proj_bias") {
            if self.tensors.contains_key("out_proj.bias") {
                // bias=False drops both biases; one without the other is not an MHA state.
                return Err(PytorchError::MissingKey {
                    file: self.file.clone(),
                    key: self.full_key("in_proj_bias"),
                });
            }
            return Ok(None);
        }
        let in_bias = self.take("in_proj_bias")?;
        self.expect_shape("in_proj_bias", &in_bias, &[3 * embed_dim])?;
        let out_bias = self.take("out_proj.bias")?;
        self.expect_shape("out_proj.bias", &out_bias, &[embed_dim])?;
        Ok(Some((split_rows::<3>(in_bias), out_bias)))
    }

    /// `bias_k` and `bias_v` (`add_bias_kv=True`), or `None`.
    fn take_kv_biases(
        &mut self,
        embed_dim: usize,
    ) -> Result<Option<(RawTensor, RawTensor)>, PytorchError> {
        if !self.tensors.contains_key("bias_k") && !self.tensors.contains_key("bias_v") {
            return Ok(None);
        }
        let bias_k = self.take("bias_k")?;
        self.expect_shape("bias_k", &bias_k, &[1, 1, embed_dim])?;
        let bias_v = self.take("bias_v")?;
        self.expect_shape("bias_v", &bias_v, &[1, 1, embed_dim])?;
        Ok(Some((bias_k, bias_v)))
    }
}

/// Splits `[parts · n, ...]` into `parts` tensors of `[n, ...]`.
fn split_rows<const PARTS: usize>(tensor: RawTensor) -> [RawTensor; PARTS] {
    let rows = tensor.shape[0] / PARTS;
    let mut shape = tensor.shape.clone();
    shape[0] = rows;
    let chunk = tensor.values.len() / PARTS;
    core::array::from_fn(|part| {
        RawTensor::float(
            shape.clone(),
            tensor.values[part * chunk..(part + 1) * chunk].to_vec(),
        )
    })
}

/// PyTorch `[out, in]` → Burn `[in, out]`.
fn linear_weight(tensor: RawTensor, device: &Device) -> Tensor<2> {
    Tensor::<2>::from_data(TensorData::new(tensor.values, tensor.shape), device).transpose()
}

fn vector(tensor: RawTensor, device: &Device) -> Tensor<1> {
    let length = tensor.values.len();
    Tensor::from_data(TensorData::new(tensor.values, [length]), device)
}

/// Every tensor of a `.safetensors`, `.pt` or `.pth` file, as f32.
///
/// A file the readers cannot parse, a truncated or corrupt one included, is an error naming
/// it. A reader that panicked on such a file would be caught and reported the same way (none
/// did on the damaged files of the tests: cuts and flipped bytes of `.pt` and `.safetensors`).
fn read_tensors(file: &Path) -> Result<HashMap<String, RawTensor>, PytorchError> {
    let unreadable = |message: String| PytorchError::Unreadable {
        file: file.to_path_buf(),
        message,
    };
    let is_safetensors = file
        .extension()
        .is_some_and(|extension| extension == "safetensors");
    let read = || {
        if is_safetensors {
            read_safetensors(file)
        } else {
            read_pytorch(file)
        }
    };
    match std::panic::catch_unwind(read) {
        Ok(tensors) => tensors.map_err(unreadable),
        Err(payload) => {
            let reason = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(unreadable(format!("corrupt file ({reason})")))
        }
    }
}

fn read_pytorch(file: &Path) -> Result<HashMap<String, RawTensor>, String> {
    use pytorch_reader::DType;
    let reader = PytorchReader::new(file).map_err(|error| error.to_string())?;
    let mut tensors = HashMap::new();
    for (key, tensor) in reader.into_tensors() {
        let shape = tensor.shape().to_vec();
        let dtype = match tensor.dtype() {
            DType::F32 => FileDType::F32,
            DType::F64 => FileDType::F64,
            DType::F16 => FileDType::F16,
            DType::BF16 => FileDType::BF16,
            // Integer buffers (a `num_batches_tracked` next to the module, say) are read only
            // if the module needs them, which refuses them.
            other => FileDType::Other(format!("{other:?}")),
        };
        let bytes = match dtype {
            FileDType::Other(_) => Vec::new(),
            _ => tensor.read().map_err(|error| format!("`{key}`: {error}"))?,
        };
        let raw = RawTensor::read(&key, shape, dtype, &bytes)?;
        tensors.insert(key, raw);
    }
    Ok(tensors)
}

fn read_safetensors(file: &Path) -> Result<HashMap<String, RawTensor>, String> {
    let bytes = std::fs::read(file).map_err(|error| error.to_string())?;
    let archive = SafeTensors::deserialize(&bytes).map_err(|error| error.to_string())?;
    let mut tensors = HashMap::new();
    for (key, view) in archive.tensors() {
        let dtype = match view.dtype() {
            Dtype::F32 => FileDType::F32,
            Dtype::F64 => FileDType::F64,
            Dtype::F16 => FileDType::F16,
            Dtype::BF16 => FileDType::BF16,
            other => FileDType::Other(format!("{other:?}")),
        };
        let raw = RawTensor::read(&key, view.shape().to_vec(), dtype, view.data())?;
        tensors.insert(key, raw);
    }
    Ok(tensors)
}

fn floats<const N: usize>(bytes: &[u8], convert: impl Fn([u8; N]) -> f32) -> Vec<f32> {
    bytes
        .chunks_exact(N)
        .map(|chunk| convert(chunk.try_into().expect("chunk of N bytes")))
        .collect()
}

/// Writes `module` as a PyTorch `nn.MultiheadAttention` state dict in safetensors format, f32,
/// keys under `prefix` (may be empty). `torch.nn.MultiheadAttention(E, H, bias=…,
/// add_bias_kv=…, kdim=…, vdim=…).load_state_dict(safetensors.torch.load_file(path))` takes it.
///
/// Fails with [`PytorchError::Unsupported`] for a module PyTorch cannot express: grouped-query
/// attention, a custom scale, a quiet softmax, RoPE, ALiBi, a sliding window, soft-capping or
/// attention sinks.
pub fn save_pytorch_mha(
    module: &MultiHeadAttention,
    path: impl AsRef<Path>,
    prefix: &str,
) -> Result<(), PytorchError> {
    let file = path.as_ref().to_path_buf();
    if let Some(reason) = pytorch_cannot_express(module) {
        return Err(PytorchError::Unsupported {
            file,
            message: format!("{reason}; torch.nn.MultiheadAttention cannot express it"),
        });
    }
    let prefix = if prefix.is_empty() || prefix.ends_with('.') {
        prefix.to_string()
    } else {
        format!("{prefix}.")
    };
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = state_dict(module)
        .into_iter()
        .map(|(key, tensor)| {
            let bytes = tensor.values.iter().flat_map(|v| v.to_le_bytes()).collect();
            (format!("{prefix}{key}"), bytes, tensor.shape)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(key, data, shape)| {
            let view = safetensors::tensor::TensorView::new(Dtype::F32, shape.clone(), data)
                .expect("f32 data of the tensor's shape");
            (key.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &file).map_err(|error| PytorchError::Unwritable {
        file: file.clone(),
        message: error.to_string(),
    })
}

/// Why PyTorch's `nn.MultiheadAttention` would compute something else than `module`, if it
/// would.
fn pytorch_cannot_express(module: &MultiHeadAttention) -> Option<&'static str> {
    if module.n_kv_heads != module.n_heads {
        Some("the module uses grouped-query attention (n_kv_heads < n_heads)")
    } else if module.custom_scale {
        Some("the module has a custom scale")
    } else if module.quiet_softmax {
        Some("the module uses the quiet softmax")
    } else if module.rope.is_some() {
        Some("the module rotates queries and keys with RoPE")
    } else if module.alibi {
        Some("the module adds ALiBi's distance penalty to the scores")
    } else if module.window.is_some() {
        Some("the module attends through a sliding window")
    } else if module.softcap.is_some() {
        Some("the module soft-caps its scores")
    } else if module.sinks.is_some() {
        Some("the module has attention sinks")
    } else {
        None
    }
}

/// `module`'s parameters under PyTorch's names and in its `[out, in]` layout.
fn state_dict(module: &MultiHeadAttention) -> BTreeMap<&'static str, RawTensor> {
    let mut tensors = BTreeMap::new();
    let torch_weight = |tensor: Tensor<2>| raw(tensor.transpose());
    let packed = module.d_key_input == module.d_model && module.d_value_input == module.d_model;
    let weights = [&module.query, &module.key, &module.value].map(|linear| linear.weight.val());
    if packed {
        let packed = Tensor::cat(weights.map(|w| w.transpose()).to_vec(), 0);
        tensors.insert("in_proj_weight", raw(packed));
    } else {
        let [q, k, v] = weights;
        tensors.insert("q_proj_weight", torch_weight(q));
        tensors.insert("k_proj_weight", torch_weight(k));
        tensors.insert("v_proj_weight", torch_weight(v));
    }
    tensors.insert("out_proj.weight", torch_weight(module.output.weight.val()));
    let biases = [&module.query, &module.key, &module.value]
        .map(|linear| linear.bias.as_ref().map(|bias| bias.val()));
    if let [Some(q), Some(k), Some(v)] = biases {
        tensors.insert("in_proj_bias", raw(Tensor::cat(vec![q, k, v], 0)));
    }
    if let Some(bias) = &module.output.bias {
        tensors.insert("out_proj.bias", raw(bias.val()));
    }
    for (key, bias) in [("bias_k", &module.bias_k), ("bias_v", &module.bias_v)] {
        if let Some(bias) = bias {
            let mut tensor = raw(bias.val());
            tensor.shape = vec![1, 1, tensor.values.len()];
            tensors.insert(key, tensor);
        }
    }
    tensors
}

fn raw<const D: usize>(tensor: Tensor<D>) -> RawTensor {
    let shape = tensor.dims().to_vec();
    let values = tensor
        .into_data()
        .try_into_vec_as::<f32>()
        .expect("f32 values");
    RawTensor::float(shape, values)
}
