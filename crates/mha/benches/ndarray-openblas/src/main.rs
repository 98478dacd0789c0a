//! ndarray with OpenBLAS (Burn's `openblas-system`): this crate's MHA and Burn's, `fwd` and
//! `fwd+bwd` at (4, 512, 512, 8), medians of 8 runs after a warm-up, the two alternated.
//!
//! ```sh
//! cd crates/mha/benches/ndarray-openblas && OPENBLAS_NUM_THREADS=2 cargo run --release
//! ```
use burn::nn::attention::{MhaInput as BurnMhaInput, MultiHeadAttentionConfig as BurnMhaConfig};
use burn::tensor::{Device, Distribution, Tensor};
use mha::{MhaInput, MultiHeadAttentionConfig};
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

#[allow(deprecated)]
fn main() {
    for training in [false, true] {
        let device = if training {
            Device::ndarray().autodiff()
        } else {
            Device::ndarray()
        };
        device.seed(0);
        let ours = MultiHeadAttentionConfig::new(512, 8).init(&device);
        let burns = BurnMhaConfig::new(512, 8).with_dropout(0.0).init(&device);
        let x = Tensor::<3>::random([4, 512, 512], Distribution::Normal(0.0, 1.0), &device);
        let finish = |c: Tensor<3>, x: &Tensor<3>| -> f32 {
            if training {
                let g = c.powi_scalar(2).sum().backward();
                x.grad(&g).unwrap().sum().into_scalar::<f32>()
            } else {
                c.sum().into_scalar::<f32>()
            }
        };
        let (mut a, mut b) = (vec![], vec![]);
        for i in 0..9 {
            let xi = if training {
                x.clone().require_grad()
            } else {
                x.clone()
            };
            let t = Instant::now();
            finish(ours.forward(MhaInput::self_attn(xi.clone())).context, &xi);
            if i > 0 {
                a.push(t.elapsed().as_secs_f64() * 1e3);
            }
            let t = Instant::now();
            finish(
                burns.forward(BurnMhaInput::self_attn(xi.clone())).context,
                &xi,
            );
            if i > 0 {
                b.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        let (a, b) = (median(a), median(b));
        println!(
            "ndarray+openblas (4, 512, 512, 8) {}: ours {a:.1} ms, Burn MHA {b:.1} ms, {:.2}x",
            if training { "fwd+bwd" } else { "fwd" },
            b / a
        );
    }
}
