//! Helpers shared by the integration tests: PyTorch fixtures, comparisons, random inputs.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::PathBuf;

use burn::module::Param;
use burn::tensor::{Bool, Device, Distribution, Tensor, TensorData};
use mha::{MultiHeadAttention, MultiHeadAttentionConfig};
use serde_json::Value;

pub use burn_mha::{test_devices, tolerance};

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
            .with_add_zero_attn(self.arg_bool("add_zero_attn"));
        let mut module = config.init(device);

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

/// All values finite?
pub fn all_finite<const D: usize>(t: Tensor<D>) -> bool {
    t.into_data()
        .try_into_vec_as::<f32>()
        .unwrap()
        .iter()
        .all(|x| x.is_finite())
}
