//! Every gradient — the input's and every parameter's — against central finite differences, on
//! every path that trains, in f64 where the backend computes in f64 (a test binary of its own,
//! since a device's float type is set once per process).

mod common;

use burn::module::{Module, Param};
use burn::tensor::{Bool, DType, Device, FloatDType, Tensor, TensorData};
use common::{randn, test_devices};
use mha::{AttentionPath, BlockSizes, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};

/// The device computing in f64 if it can; whether it does.
fn in_f64(device: Device) -> (Device, bool) {
    let mut device = device;
    let f64 = device.supports_dtype(FloatDType::F64) && device.configure(FloatDType::F64).is_ok();
    (device, f64)
}

/// `Σ c · w` over the context, with weights that differ from element to element, so that no
/// gradient term can cancel by symmetry.
fn loss(
    module: &MultiHeadAttention,
    x: Tensor<3>,
    padding: &Tensor<2, Bool>,
    path: AttentionPath,
) -> Tensor<1> {
    let context = module
        .forward(
            MhaInput::self_attn(x)
                .causal()
                .key_padding_mask(padding.clone())
                .path(path),
        )
        .context;
    let [batch, seq, width] = context.dims();
    let count = batch * seq * width;
    let weights: Vec<f64> = (0..count)
        .map(|i| ((i * 7 % 11) as f64 - 5.0) / 3.0)
        .collect();
    let weights = Tensor::<3>::from_data(
        TensorData::new(weights, [batch, seq, width]),
        &context.device(),
    );
    (context * weights).sum()
}

fn values(tensor: Tensor<1>) -> Vec<f64> {
    tensor.into_data().try_into_vec_as::<f64>().unwrap()
}

/// Compares `analytic` (flattened) with central differences of `loss_at`, which evaluates the
/// loss with element `index` of the flattened tensor `base` moved by `delta`.
fn check(
    what: &str,
    analytic: Vec<f64>,
    base: &[f64],
    epsilon: f64,
    bound: f64,
    loss_at: impl Fn(usize, f64) -> f64,
) {
    assert_eq!(analytic.len(), base.len(), "{what}: gradient size");
    for (index, analytic) in analytic.iter().enumerate() {
        let numeric = (loss_at(index, epsilon) - loss_at(index, -epsilon)) / (2.0 * epsilon);
        assert!(
            (numeric - analytic).abs() <= bound * (1.0 + numeric.abs()),
            "{what}[{index}]: analytic {analytic} vs numeric {numeric}"
        );
    }
}

/// `tensor` with element `index` of its flattening moved by `delta`.
fn nudged<const D: usize>(tensor: &Tensor<D>, index: usize, delta: f64) -> Tensor<D> {
    let shape = tensor.dims();
    let mut flat = values(tensor.clone().reshape([-1]));
    flat[index] += delta;
    Tensor::from_data(TensorData::new(flat, shape), &tensor.device())
}

type WeightOf = fn(&mut MultiHeadAttention) -> &mut Param<Tensor<2>>;
type VectorOf = fn(&mut MultiHeadAttention) -> &mut Param<Tensor<1>>;

// Longer than most: one table of parameters, each perturbed in turn and checked.
#[test]
fn every_gradient_matches_central_finite_differences() {
    for (name, device) in test_devices() {
        let (device, f64) = in_f64(device);
        let device = device.autodiff();
        let _seed = common::seed(&device, 8);
        // f64: truncation O(ε²) and rounding O(1e-16 / ε) both far below a wrong term's effect.
        let (epsilon, bound) = if f64 { (1e-5, 1e-6) } else { (1e-2, 2e-2) };
        assert!(f64 || name == "wgpu", "{name} computes in f64");
        let module = MultiHeadAttentionConfig::new(4, 2)
            .with_n_kv_heads(Some(1))
            .with_add_bias_kv(true)
            .with_add_zero_attn(true)
            .init(&device);
        let x = randn([2, 3, 4], &device);
        let padding = Tensor::<2, Bool>::from_data([[false, false, true], [false; 3]], &device);
        let blocks = BlockSizes { query: 2, key: 2 };
        let mut paths = vec![
            AttentionPath::Explicit,
            AttentionPath::Fused,
            AttentionPath::Chunked(blocks),
        ];
        if mha::flash_attention_supported(&device) {
            paths.push(AttentionPath::Flash(blocks));
        }
        // On lavapipe every forward costs a tenth of a second: there the explicit path alone,
        // whose gradients the other paths are held to by the gradient comparisons.
        if !f64 {
            paths.truncate(1);
        }
        let weights: [(&str, WeightOf); 4] = [
            ("W_q", |m| &mut m.query.weight),
            ("W_k", |m| &mut m.key.weight),
            ("W_v", |m| &mut m.value.weight),
            ("W_o", |m| &mut m.output.weight),
        ];
        let vectors: [(&str, VectorOf); 6] = [
            ("b_q", |m| m.query.bias.as_mut().unwrap()),
            ("b_k", |m| m.key.bias.as_mut().unwrap()),
            ("b_v", |m| m.value.bias.as_mut().unwrap()),
            ("b_o", |m| m.output.bias.as_mut().unwrap()),
            ("bias_k", |m| m.bias_k.as_mut().unwrap()),
            ("bias_v", |m| m.bias_v.as_mut().unwrap()),
        ];
        for path in paths {
            let tracked = x.clone().require_grad();
            let grads = loss(&module, tracked.clone(), &padding, path).backward();
            let plain = module.valid();
            let plain_x = x.clone().inner();
            let plain_padding = padding.clone().inner();
            let loss_of = |module: &MultiHeadAttention, x: Tensor<3>| {
                loss(module, x, &plain_padding, path).into_scalar::<f64>()
            };
            let what = |part: &str| format!("{name} {path:?} d{part}");
            check(
                &what("x"),
                values(tracked.grad(&grads).unwrap().reshape([-1])),
                &values(plain_x.clone().reshape([-1])),
                epsilon,
                bound,
                |index, delta| loss_of(&plain, nudged(&plain_x, index, delta)),
            );
            for (part, weight_of) in weights {
                let mut module = module.clone();
                let analytic = values(weight_of(&mut module).grad(&grads).unwrap().reshape([-1]));
                let mut base = plain.clone();
                let base_value = weight_of(&mut base).val();
                check(
                    &what(part),
                    analytic,
                    &values(base_value.clone().reshape([-1])),
                    epsilon,
                    bound,
                    |index, delta| {
                        let mut moved = plain.clone();
                        *weight_of(&mut moved) =
                            Param::from_tensor(nudged(&base_value, index, delta));
                        loss_of(&moved, plain_x.clone())
                    },
                );
            }
            for (part, vector_of) in vectors {
                let mut module = module.clone();
                let analytic = values(vector_of(&mut module).grad(&grads).unwrap());
                let mut base = plain.clone();
                let base_value = vector_of(&mut base).val();
                check(
                    &what(part),
                    analytic,
                    &values(base_value.clone()),
                    epsilon,
                    bound,
                    |index, delta| {
                        let mut moved = plain.clone();
                        *vector_of(&mut moved) =
                            Param::from_tensor(nudged(&base_value, index, delta));
                        loss_of(&moved, plain_x.clone())
                    },
                );
            }
        }
        assert_eq!(
            x.clone().inner().into_data().dtype(),
            if f64 { DType::F64 } else { DType::F32 },
            "{name}: the test ran in the float type it claims"
        );
    }
}
