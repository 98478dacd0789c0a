//! Cross-attention from a decoder sequence to an encoder memory of other widths
//! (PyTorch's kdim/vdim), with grouped-query attention (8 query heads sharing 2 key/value heads).
//!
//! ```sh
//! cargo run --release --example cross_attention -- --device flex   # or ndarray; wgpu with `--features wgpu`
//! ```

use burn::module::Module;
use burn::tensor::{Distribution, Tensor};
use burn_mha::device_from_args;
use mha::{MhaInput, MultiHeadAttentionConfig, NeedWeights};

fn main() {
    let (device_name, device) = device_from_args("cross_attention");
    device.seed(0);

    let (batch, seq_q, seq_k) = (2, 4, 9);
    let (d_model, d_key, d_value) = (32, 12, 20);
    let gqa = MultiHeadAttentionConfig::new(d_model, 8)
        .with_n_kv_heads(Some(2))
        .with_d_key_input(Some(d_key))
        .with_d_value_input(Some(d_value))
        .init(&device);
    let mha = MultiHeadAttentionConfig::new(d_model, 8)
        .with_d_key_input(Some(d_key))
        .with_d_value_input(Some(d_value))
        .init(&device);
    println!("device: {device_name}");
    println!("GQA module: {gqa}");
    println!(
        "parameters: GQA {} vs MHA {} (key/value projections shrink 4x)",
        gqa.num_params(),
        mha.num_params()
    );

    let normal = Distribution::Normal(0.0, 1.0);
    let decoder = Tensor::<3>::random([batch, seq_q, d_model], normal, &device);
    let keys = Tensor::<3>::random([batch, seq_k, d_key], normal, &device);
    let values = Tensor::<3>::random([batch, seq_k, d_value], normal, &device);
    let output =
        gqa.forward(MhaInput::new(decoder, keys, values).need_weights(NeedWeights::Averaged));
    println!(
        "context: {:?} (batch, seq_q, d_model)",
        output.context.dims()
    );
    let weights = output.weights.unwrap().averaged();
    println!(
        "head-averaged weights: {:?} (batch, seq_q, seq_k)",
        weights.dims()
    );
    let row_sums = weights
        .sum_dim(2)
        .into_data()
        .try_into_vec_as::<f32>()
        .unwrap();
    println!("each query's weights sum to 1: {row_sums:.4?}");
}
