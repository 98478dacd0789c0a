//! Helpers shared by the integration tests: PyTorch fixtures, comparisons, random inputs.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::PathBuf;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::activation::softmax;
use burn::tensor::{Bool, DType, Device, Distribution, Tensor, TensorData};
use mha::{
    AttentionPath, BlockSizes, CacheStorage, KvCache, MhaInput, MultiHeadAttention,
    MultiHeadAttentionConfig, SequenceId, flash_attention_supported,
};
use serde_json::Value;

mod devices;
pub mod paged_harness;
pub mod paged_schedule;
mod rng;
#[allow(unused_imports)] // each test binary uses its own subset
pub use devices::{device_by_name, devices_from, test_devices, tolerance};
pub use rng::Rng;

/// Seeds `device`'s backend generator and holds a lock until the guard drops. Burn's seeded
/// generator is one per backend and process, shared by the tests that `cargo test` runs on
/// parallel threads: a test that seeds and then draws must hold this guard while it draws, or
/// another test's draws interleave with its own. Burn draws a module's parameters at their
/// first use, not at `init`: a test that drops the guard before that uses [`drawn`].
#[must_use = "the generator is only this test's while the guard lives"]
pub fn seed(device: &Device, seed: u64) -> std::sync::MutexGuard<'static, ()> {
    static SEEDED: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let guard = SEEDED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    device.seed(seed);
    guard
}

/// The module `init` builds, seeded with `seed` and every float parameter drawn before
/// [`seed`]'s guard drops, not at its first use: for a test that uses the module after it
/// lets another test seed the generator.
pub fn drawn<M: Module>(device: &Device, seed: u64, init: impl FnOnce() -> M) -> M {
    struct Draw;
    impl ModuleVisitor for Draw {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            // The value is not needed: asking for it runs the parameter's initializer.
            let _ = param.val();
        }
    }
    let _seeded = self::seed(device, seed);
    let module = init();
    module.visit(&mut Draw);
    module
}

/// A PyTorch fixture written by `tests/fixtures/generate_pytorch_fixtures.py`.
pub struct Fixture {
    pub name: String,
    pub json: Value,
}

impl Fixture {
    pub fn load(name: &str) -> Self {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/pytorch")
            .join(format!("{name}.json"));
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|error| panic!("reading {}: {error}", path.display()));
        Self {
            name: name.to_string(),
            json: serde_json::from_str(&text).expect("fixture is JSON"),
        }
    }

    pub fn arg_usize(&self, name: &str) -> Option<usize> {
        self.json["args"][name].as_u64().map(|v| v as usize)
    }

    pub fn arg_bool(&self, name: &str) -> bool {
        self.json["args"][name].as_bool().unwrap()
    }

    fn state(&self, key: &str) -> Option<&Value> {
        self.json["state_dict"].get(key)
    }

    pub fn input<const D: usize>(&self, key: &str, device: &Device) -> Option<Tensor<D>> {
        self.json["inputs"]
            .get(key)
            .map(|v| float_tensor(v, device))
    }

    pub fn bool_input<const D: usize>(
        &self,
        key: &str,
        device: &Device,
    ) -> Option<Tensor<D, Bool>> {
        self.json["inputs"].get(key).map(|v| bool_tensor(v, device))
    }

    pub fn output<const D: usize>(&self, key: &str, device: &Device) -> Tensor<D> {
        float_tensor(&self.json["outputs"][key], device)
    }

    /// The module the fixture was made with, its weights loaded from the state dict.
    pub fn module(&self, device: &Device) -> MultiHeadAttention {
        let embed_dim = self.arg_usize("embed_dim").unwrap();
        let config = MultiHeadAttentionConfig::new(embed_dim, self.arg_usize("num_heads").unwrap())
            .with_d_key_input(self.arg_usize("kdim"))
            .with_d_value_input(self.arg_usize("vdim"))
            .with_bias(self.arg_bool("bias"))
            .with_add_bias_kv(self.arg_bool("add_bias_kv"))
            .with_add_zero_attn(self.arg_bool("add_zero_attn"))
            .with_window(self.arg_usize("window"))
            .with_softcap(self.json["args"]["softcap"].as_f64())
            .with_alibi(self.json["args"]["alibi"].as_bool().unwrap_or(false))
            .with_attention_sinks(self.state("sinks").is_some());
        let mut module = config.init(device);
        if let Some(sinks) = self.state("sinks") {
            module.sinks = Some(Param::from_tensor(float_tensor(sinks, device)));
        }

        // PyTorch stores [out, in]; Burn's Linear holds [in, out].
        let weights: [Tensor<2>; 3] = match self.state("in_proj_weight") {
            Some(packed) => {
                let packed: Tensor<2> = float_tensor(packed, device);
                let [q, k, v] = packed.chunk(3, 0).try_into().unwrap();
                [q, k, v]
            }
            None => ["q_proj_weight", "k_proj_weight", "v_proj_weight"]
                .map(|key| float_tensor(self.state(key).unwrap(), device)),
        };
        let [wq, wk, wv] = weights;
        module.query.weight = Param::from_tensor(wq.transpose());
        module.key.weight = Param::from_tensor(wk.transpose());
        module.value.weight = Param::from_tensor(wv.transpose());
        module.output.weight = Param::from_tensor(
            float_tensor::<2>(self.state("out_proj.weight").unwrap(), device).transpose(),
        );
        if let Some(packed_bias) = self.state("in_proj_bias") {
            let packed_bias: Tensor<1> = float_tensor(packed_bias, device);
            let [bq, bk, bv]: [Tensor<1>; 3] = packed_bias.chunk(3, 0).try_into().unwrap();
            module.query.bias = Some(Param::from_tensor(bq));
            module.key.bias = Some(Param::from_tensor(bk));
            module.value.bias = Some(Param::from_tensor(bv));
            module.output.bias = Some(Param::from_tensor(float_tensor(
                self.state("out_proj.bias").unwrap(),
                device,
            )));
        }
        if let Some(bias_k) = self.state("bias_k") {
            let bias_k: Tensor<3> = float_tensor(bias_k, device);
            let bias_v: Tensor<3> = float_tensor(self.state("bias_v").unwrap(), device);
            module.bias_k = Some(Param::from_tensor(bias_k.flatten(0, 2)));
            module.bias_v = Some(Param::from_tensor(bias_v.flatten(0, 2)));
        }
        module
    }
}

fn shape_of(value: &Value) -> Vec<usize> {
    value["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect()
}

pub fn float_tensor<const D: usize>(value: &Value, device: &Device) -> Tensor<D> {
    let data: Vec<f32> = value["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().map_or(f32::NEG_INFINITY, |x| x as f32))
        .collect();
    Tensor::from_data(TensorData::new(data, shape_of(value)), device)
}

pub fn bool_tensor<const D: usize>(value: &Value, device: &Device) -> Tensor<D, Bool> {
    let data: Vec<bool> = value["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_bool().unwrap())
        .collect();
    Tensor::from_data(TensorData::new(data, shape_of(value)), device)
}

/// The largest absolute difference between two tensors of the same shape.
pub fn max_abs_diff<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let a = a.into_data().try_into_vec_as::<f32>().unwrap();
    let b = b.into_data().try_into_vec_as::<f32>().unwrap();
    a.iter()
        .zip(&b)
        .map(|(x, y)| {
            assert!(
                x.is_finite() && y.is_finite(),
                "non-finite value: {x} vs {y}"
            );
            (x - y).abs()
        })
        .fold(0.0, f32::max)
}

/// Asserts `max |a - b| <= bound`, naming what is compared.
#[track_caller]
pub fn assert_close<const D: usize>(what: &str, a: Tensor<D>, b: Tensor<D>, bound: f32) {
    let diff = max_abs_diff(a, b);
    assert!(
        diff <= bound,
        "{what}: max abs difference {diff:e} > {bound:e}"
    );
}

pub fn randn<const D: usize>(shape: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
}

/// Grouped heads (4 query, 2 key/value) `d_model` wide under a sliding `window`, a soft cap of
/// 2 and learned sinks: every score feature the in-place kernels apply per position at once.
pub fn window_softcap_sinks(d_model: usize, window: usize) -> MultiHeadAttentionConfig {
    MultiHeadAttentionConfig::new(d_model, 4)
        .with_n_kv_heads(Some(2))
        .with_window(Some(window))
        .with_softcap(Some(2.0))
        .with_attention_sinks(true)
}

/// `module` with random learned sinks where it has sinks (they start at zero, which would hide
/// a sink counted twice or in the wrong head).
pub fn with_random_sinks(mut module: MultiHeadAttention, device: &Device) -> MultiHeadAttention {
    if module.sinks.is_some() {
        module.sinks = Some(Param::from_tensor(randn([module.n_heads()], device)));
    }
    module
}

/// Feeds `x` to `module` through `cache` in causal steps of `chunks` tokens and concatenates
/// the outputs.
pub fn decode(
    module: &MultiHeadAttention,
    x: &Tensor<3>,
    chunks: &[usize],
    cache: &mut KvCache,
) -> Tensor<3> {
    let mut outputs = Vec::new();
    let mut start = 0;
    for &length in chunks {
        let step = x.clone().narrow(1, start, length);
        let output = module
            .forward_cached(MhaInput::self_attn(step).causal(), cache)
            .expect("within limits");
        outputs.push(output.context);
        start += length;
    }
    Tensor::cat(outputs, 1)
}

/// The storages `device` holds: f16 where it has f16 tensors (not ndarray), int8 where it has
/// i8 tensors (not lavapipe's wgpu).
pub fn storages(device: &Device) -> Vec<CacheStorage> {
    let mut storages = vec![CacheStorage::Float];
    if device.supports_dtype(DType::F16) {
        storages.push(CacheStorage::Half);
    }
    if device.supports_dtype(DType::I8) {
        storages.push(CacheStorage::Int8);
    }
    storages
}

/// A step's sequence ids, one per row: `n` rows of each `(id, n)`, in order.
pub fn row_ids(rows: &[(SequenceId, usize)]) -> Vec<SequenceId> {
    rows.iter()
        .flat_map(|&(id, n)| std::iter::repeat_n(id, n))
        .collect()
}

/// All values finite?
pub fn all_finite<const D: usize>(t: Tensor<D>) -> bool {
    t.into_data()
        .try_into_vec_as::<f32>()
        .unwrap()
        .iter()
        .all(|x| x.is_finite())
}

/// Every path that can run on `device` without weights, dropout or a quiet softmax, with small
/// blocks so that several blocks (and a short last one) are taken: explicit, fused, chunked,
/// flash where it is compiled, and `Auto`.
pub fn paths(device: &Device) -> Vec<AttentionPath> {
    let blocks = BlockSizes { query: 3, key: 2 };
    let mut paths = vec![
        AttentionPath::Explicit,
        AttentionPath::Fused,
        AttentionPath::Chunked(blocks),
    ];
    if flash_attention_supported(device) {
        paths.push(AttentionPath::Flash(blocks));
    }
    paths.push(AttentionPath::Auto);
    paths
}

/// Multi-head attention written out head by head from the module's weights, in the textbook
/// form (no grouping reshapes, no fused kernels): the independent reference for modules
/// without RoPE, ALiBi or appended keys. `padding` is `[batch, seq_k]`, `true` = ignored.
pub fn reference_attention(
    module: &MultiHeadAttention,
    query: Tensor<3>,
    key: Tensor<3>,
    value: Tensor<3>,
    padding: Option<&Tensor<2, Bool>>,
    causal: bool,
) -> Tensor<3> {
    let [batch, seq_q, _] = query.dims();
    let seq_k = key.dims()[1];
    let (heads, head_dim) = (module.n_heads(), module.head_dim());
    let groups = heads / module.n_kv_heads();
    let q = module.query.forward(query);
    let k = module.key.forward(key);
    let v = module.value.forward(value);
    let device = q.device();
    let mut forbid = Tensor::<3, Bool>::zeros([batch, seq_q, seq_k], &device);
    if let Some(padding) = padding {
        forbid = forbid.bool_or(
            padding
                .clone()
                .reshape([batch, 1, seq_k])
                .expand([batch, seq_q, seq_k]),
        );
    }
    if causal {
        let future = mha::causal_mask(seq_q, seq_k, &device).reshape([1, seq_q, seq_k]);
        forbid = forbid.bool_or(future.expand([batch, seq_q, seq_k]));
    }
    let outputs = (0..heads)
        .map(|h| {
            let kv = h / groups;
            let q_h = q.clone().narrow(2, h * head_dim, head_dim);
            let k_h = k.clone().narrow(2, kv * head_dim, head_dim);
            let v_h = v.clone().narrow(2, kv * head_dim, head_dim);
            let scores = q_h.matmul(k_h.swap_dims(1, 2)).mul_scalar(module.scale());
            let scores = scores.mask_fill(forbid.clone(), f32::NEG_INFINITY);
            softmax(scores, 2).matmul(v_h)
        })
        .collect();
    module.output.forward(Tensor::cat(outputs, 2))
}

/// `to` with `from`'s four projections (the same sizes): a module that differs from `from` only
/// in its configuration's switches (a window, say), for comparing the two.
pub fn with_projections_of(
    mut to: MultiHeadAttention,
    from: &MultiHeadAttention,
) -> MultiHeadAttention {
    to.query = from.query.clone();
    to.key = from.key.clone();
    to.value = from.value.clone();
    to.output = from.output.clone();
    to
}

/// What `run` returned, or the message it panicked with.
pub fn outcome<T>(run: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).map_err(|payload| {
        payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    })
}

/// The message `run` panicked with.
///
/// # Panics
///
/// If `run` returns instead.
#[track_caller]
pub fn panic_message<T>(run: impl FnOnce() -> T) -> String {
    match outcome(run) {
        Ok(_) => panic!("expected a panic"),
        Err(message) => message,
    }
}

/// A small causal decoder stack (2 layers, 4 query / 2 key-value heads, RoPE, pre-norm, no
/// dropout) whose caches the decoding tests compare.
pub fn causal_stack(d_model: usize, device: &Device) -> mha::transformer::TransformerEncoder {
    causal_stack_in_window(d_model, None, device)
}

/// [`causal_stack`] whose layers attend within a sliding `window`.
pub fn causal_stack_in_window(
    d_model: usize,
    window: Option<usize>,
    device: &Device,
) -> mha::transformer::TransformerEncoder {
    mha::transformer::TransformerEncoderConfig::new(d_model, 32, 4, 2)
        .with_window(window)
        .with_causal(true)
        .with_n_kv_heads(Some(2))
        .with_rope(Some(mha::RopeConfig::new()))
        .with_norm_first(true)
        .with_dropout(0.0)
        .init(device)
}

/// A copy of `stack` whose second layer's attention sees its input scaled by 10^6 (its norm's
/// gain), so that its keys exceed f16's range while the first layer's do not. The attention
/// weights are the same parameters, so it may step the caches of `stack`.
pub fn overflowing_in_its_second_layer(
    stack: &mha::transformer::TransformerEncoder,
) -> mha::transformer::TransformerEncoder {
    let mut stack = stack.clone();
    let norm = &mut stack.layers[1].attention_norm;
    norm.gamma = norm.gamma.clone().map(|gamma| gamma * 1e6);
    stack
}
