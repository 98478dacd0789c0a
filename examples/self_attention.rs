//! Self-attention with a key padding mask and a causal mask, printing per-head weights.
//!
//! ```sh
//! cargo run --release --example self_attention -- --device flex   # or ndarray; wgpu with `--features wgpu`
//! ```

use burn::tensor::{Bool, Distribution, Tensor};
use burn_mha::device_from_args;
use mha::{MhaInput, MultiHeadAttentionConfig, NeedWeights};

fn main() {
    let (device_name, device) = device_from_args("self_attention");
    device.seed(0);

    let (batch, seq, d_model, n_heads) = (2, 5, 16, 2);
    let attention = MultiHeadAttentionConfig::new(d_model, n_heads).init(&device);
    println!("{attention}");
    let x = Tensor::<3>::random(
        [batch, seq, d_model],
        Distribution::Normal(0.0, 1.0),
        &device,
    );

    // The second sequence is two tokens shorter: its last two keys are padding (true = ignore,
    // PyTorch's key_padding_mask polarity).
    let padding =
        Tensor::<2, Bool>::from_data([[false; 5], [false, false, false, true, true]], &device);
    let output = attention.forward(
        MhaInput::self_attn(x)
            .key_padding_mask(padding)
            .causal()
            .need_weights(NeedWeights::PerHead),
    );
    println!("device: {device_name}");
    println!("context: {:?}", output.context.dims());
    let weights = output.weights.unwrap().per_head().unwrap();
    for b in 0..batch {
        for h in 0..n_heads {
            println!("weights, batch {b}, head {h} (rows: queries, columns: keys):");
            let rows = weights
                .clone()
                .slice([b..b + 1, h..h + 1])
                .reshape([seq, seq])
                .into_data()
                .try_into_vec_as::<f32>()
                .unwrap();
            for row in rows.chunks(seq) {
                let cells: Vec<String> = row.iter().map(|w| format!("{w:5.3}")).collect();
                println!("  [{}]", cells.join(" "));
            }
        }
    }
    println!(
        "Causal: every row is zero right of the diagonal; padded keys (batch 1, keys 3-4) get 0."
    );
}
