//! An existing burn-nn model moved onto this crate's module with its weights: a burn-nn
//! Transformer encoder (standing in for a trained one) converted, its outputs compared, then
//! timed against burn-nn's on a training step.
//!
//! ```sh
//! cargo run --release --example from_burn_nn -- --device flex   # or ndarray; wgpu with `--features wgpu`
//! ```

use std::time::Instant;

use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::transformer::{
    TransformerEncoderConfig as BurnEncoderConfig, TransformerEncoderInput as BurnEncoderInput,
};
use burn::tensor::{Distribution, Tensor};
use burn_mha::device_from_args;
use mha::transformer::{TransformerEncoder, TransformerEncoderInput};

fn main() {
    let (device_name, device) = device_from_args("from_burn_nn");
    // Autodiff, to time a training step at the end.
    let device = device.autodiff();
    device.seed(0);
    let (batch, seq, d_model, d_ff, heads, layers) = (4, 256, 128, 512, 8, 2);

    // Your trained burn-nn model (here freshly initialised), causal as a language model is.
    let theirs = BurnEncoderConfig::new(d_model, d_ff, heads, layers)
        .with_dropout(0.0)
        .with_norm_first(true)
        .init(&device);
    // The conversion keeps every weight; the causal flag replaces burn-nn's mask tensor.
    let ours = TransformerEncoder::from(theirs.clone()).with_causal(true);

    let x = Tensor::<3>::random(
        [batch, seq, d_model],
        Distribution::Normal(0.0, 1.0),
        &device,
    );
    let expected = theirs.forward(
        BurnEncoderInput::new(x.clone())
            .mask_attn(generate_autoregressive_mask(batch, seq, &device)),
    );
    let actual = ours.forward(TransformerEncoderInput::new(x.clone()));
    let difference = (actual - expected).abs().max().into_scalar::<f32>();
    println!("device: {device_name}");
    println!("burn-nn encoder → mha encoder: max abs difference {difference:.2e}");

    // One training step each (forward + backward), after a warm-up.
    let time = |step: &dyn Fn()| {
        step();
        let started = Instant::now();
        step();
        started.elapsed().as_secs_f64() * 1e3
    };
    let burn_ms = time(&|| {
        let mask = generate_autoregressive_mask(batch, seq, &device);
        let output = theirs.forward(BurnEncoderInput::new(x.clone()).mask_attn(mask));
        let _ = output.powi_scalar(2).mean().backward();
    });
    let ours_ms = time(&|| {
        let output = ours.forward(TransformerEncoderInput::new(x.clone()));
        let _ = output.powi_scalar(2).mean().backward();
    });
    println!(
        "training step ({batch} × {seq} tokens, d_model {d_model}, {layers} layers): burn-nn \
         {burn_ms:.1} ms, mha {ours_ms:.1} ms ({:.1}x)",
        burn_ms / ours_ms
    );
}
