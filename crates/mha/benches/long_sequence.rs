//! Peak memory and time of long-sequence attention on flex (and training on wgpu): this crate's
//! module against Burn's `burn::nn::attention::MultiHeadAttention`, each case in its own process
//! so that peaks do not mix (peak resident set size, `VmHWM` of `/proc/self/status`; on
//! lavapipe, wgpu's software Vulkan driver, device memory is host memory and counts too).
//!
//! ```sh
//! cargo bench --workspace --bench long_sequence              # all cases, two tables
//! cargo bench --workspace --bench long_sequence -- features  # the kernel features' table alone
//! cargo bench --workspace --bench long_sequence -- CASE      # one case (what a table runs)
//! ```
//!
//! The features' table trains (causal forward + backward, flex, `AttentionPath::Auto`: the
//! flash kernel) with each kernel feature at 4096 tokens, against the plain case: none may cost
//! more than 1.5 times its peak memory, since every feature is computed per block inside the
//! kernel. The "peaked" case is the plain one with inputs that make the softmax sharp (most
//! probabilities tiny). A window of 512 is also run at 16384 tokens, where its time must grow linearly
//! (4 times 4096's), not quadratically (16 times).
//!
//! Burn's module materialises `[batch, heads, seq, seq]` scores (8.6 GB at 16384 tokens, more
//! than this 24 GiB machine can hold with the softmax's copies), so it is measured at 8192.

#[path = "common/memory.rs"]
mod memory;

use std::process::Command;
use std::time::Instant;

use burn::module::Module;
use burn::nn::attention::{MhaInput as BurnMhaInput, MultiHeadAttentionConfig as BurnMhaConfig};
use burn::tensor::{Device, Distribution, Tensor};
use memory::peak_rss_mib;
use mha::{AttentionPath, BlockSizes, MhaInput, MultiHeadAttentionConfig};

const D_MODEL: usize = 512;
const HEADS: usize = 8;

/// (name, implementation, sequence length, training, device); "ours" is `AttentionPath::Auto`
/// (the flash kernel when training at these lengths: native on flex, its generic body on
/// wgpu), "ours-explicit" forces the explicit path.
const CASES: [(&str, &str, usize, bool, &str); 11] = [
    ("ours-inference-16384", "ours", 16384, false, "flex"),
    ("burn-inference-8192", "burn", 8192, false, "flex"),
    ("ours-inference-8192", "ours", 8192, false, "flex"),
    ("ours-training-4096", "ours", 4096, true, "flex"),
    (
        "ours-explicit-training-4096",
        "ours-explicit",
        4096,
        true,
        "flex",
    ),
    ("burn-training-4096", "burn", 4096, true, "flex"),
    ("ours-training-8192", "ours", 8192, true, "flex"),
    ("wgpu-ours-training-2048", "ours", 2048, true, "wgpu"),
    (
        "wgpu-ours-explicit-training-2048",
        "ours-explicit",
        2048,
        true,
        "wgpu",
    ),
    ("wgpu-ours-training-4096", "ours", 4096, true, "wgpu"),
    (
        "wgpu-ours-explicit-training-4096",
        "ours-explicit",
        4096,
        true,
        "wgpu",
    ),
];

/// The kernel features' cases: (name, feature, sequence length); causal training on flex.
const FEATURE_CASES: [(&str, &str, usize); 10] = [
    ("feature-plain-4096", "plain", 4096),
    ("feature-peaked-4096", "peaked", 4096),
    ("feature-padding-4096", "padding", 4096),
    ("feature-alibi-4096", "alibi", 4096),
    ("feature-window-512-4096", "window", 4096),
    ("feature-segments-4096", "segments", 4096),
    ("feature-softcap-4096", "softcap", 4096),
    ("feature-sinks-4096", "sinks", 4096),
    ("feature-plain-16384", "plain", 16384),
    ("feature-window-512-16384", "window", 16384),
];

/// Not in the table: `cargo bench --workspace --bench long_sequence -- gradients-4096` compares the input
/// and weight gradients of the flash kernel (`Auto`) with the explicit path's at 4096 tokens.
const GRADIENT_CHECK: &str = "gradients-4096";

fn run_case(name: &str) {
    let (_, implementation, seq, training, device) = CASES
        .iter()
        .copied()
        .find(|case| case.0 == name)
        .unwrap_or_else(|| panic!("unknown case {name}"));
    let plain = match device {
        "wgpu" => Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
        _ => Device::flex(),
    };
    plain.seed(0);
    let device = if training { plain.autodiff() } else { plain };
    let x = Tensor::<3>::random([1, seq, D_MODEL], Distribution::Normal(0.0, 1.0), &device);
    let started = Instant::now();
    let checksum = match implementation {
        "ours" | "ours-explicit" => {
            let path = if implementation == "ours" {
                AttentionPath::Auto
            } else {
                AttentionPath::Explicit
            };
            let module = MultiHeadAttentionConfig::new(D_MODEL, HEADS).init(&device);
            let x = if training { x.require_grad() } else { x };
            let context = module
                .forward(MhaInput::self_attn(x.clone()).path(path))
                .context;
            if training {
                let grads = context.clone().powi_scalar(2).mean().backward();
                let grad = x.grad(&grads).expect("input gradient");
                grad.abs().sum().into_scalar::<f32>() + module.num_params() as f32 * 0.0
            } else {
                context.abs().sum().into_scalar::<f32>()
            }
        }
        _ => {
            let module = BurnMhaConfig::new(D_MODEL, HEADS)
                .with_dropout(0.0)
                .init(&device);
            let x = if training { x.require_grad() } else { x };
            let context = module.forward(BurnMhaInput::self_attn(x.clone())).context;
            if training {
                let grads = context.clone().powi_scalar(2).mean().backward();
                x.grad(&grads)
                    .expect("input gradient")
                    .abs()
                    .sum()
                    .into_scalar::<f32>()
            } else {
                context.abs().sum().into_scalar::<f32>()
            }
        }
    };
    let seconds = started.elapsed().as_secs_f64();
    println!("{name},{seconds:.3},{:.0},{checksum:.3}", peak_rss_mib());
}

/// One causal forward + backward with `feature` at `seq` tokens (flex, `Auto`).
fn run_feature_case(name: &str, feature: &str, seq: usize) {
    let device = Device::flex().autodiff();
    device.seed(0);
    let mut config = MultiHeadAttentionConfig::new(D_MODEL, HEADS);
    config = match feature {
        "alibi" => config.with_alibi(true),
        "window" => config.with_window(Some(512)),
        "softcap" => config.with_softcap(Some(30.0)),
        "sinks" => config.with_attention_sinks(true),
        _ => config,
    };
    let module = config.init(&device);
    // "peaked": inputs of standard deviation 12 spread the scores over about ±50, so most of a
    // row's probabilities are tiny, as in a trained model's sharp attention (and ALiBi's distant
    // keys): what subnormal floats slow down (see `flash/simd.rs`'s `FLUSH_BELOW`).
    let deviation = if feature == "peaked" { 12.0 } else { 1.0 };
    let x = Tensor::<3>::random(
        [1, seq, D_MODEL],
        Distribution::Normal(0.0, deviation),
        &device,
    )
    .require_grad();
    let mut input = MhaInput::self_attn(x.clone()).causal();
    match feature {
        // The last eighth of the sequence is padding.
        "padding" => {
            let padding = Tensor::<1, burn::tensor::Int>::arange(0..seq as i64, &device)
                .greater_equal_elem((seq - seq / 8) as i64)
                .reshape([1, seq]);
            input = input.key_padding_mask(padding);
        }
        // Documents of 1000 tokens, one after another.
        "segments" => {
            let ids = Tensor::<1, burn::tensor::Int>::arange(0..seq as i64, &device)
                .div_scalar(1000)
                .reshape([1, seq]);
            input = input.segment_ids(ids);
        }
        _ => {}
    }
    let started = Instant::now();
    let context = module.forward(input).context;
    let grads = context.clone().powi_scalar(2).mean().backward();
    let checksum = x
        .grad(&grads)
        .expect("input gradient")
        .abs()
        .sum()
        .into_scalar::<f32>();
    let seconds = started.elapsed().as_secs_f64();
    println!("{name},{seconds:.3},{:.0},{checksum:.3}", peak_rss_mib());
}

/// Runs `name` in a fresh process: its seconds and peak RSS in MiB, or why it failed.
fn spawn_case(name: &str) -> Result<(f64, f64), String> {
    let exe = std::env::current_exe().expect("own path");
    let output = Command::new(&exe).arg(name).output().expect("spawn case");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let fields: Vec<String> = stdout
        .lines()
        .last()
        .unwrap_or("")
        .split(',')
        .map(str::to_string)
        .collect();
    match (output.status.success(), fields.as_slice()) {
        (true, [_, seconds, rss, _]) => Ok((
            seconds.parse().unwrap_or(f64::NAN),
            rss.parse().unwrap_or(f64::NAN),
        )),
        _ => Err(String::from_utf8_lossy(&output.stderr)
            .lines()
            .last()
            .unwrap_or("")
            .to_string()),
    }
}

/// The features' table, with each case's memory and time against the plain case's of its
/// length.
fn feature_table() {
    println!(
        "\nkernel features: causal forward + backward, flex, d_model {D_MODEL}, {HEADS} heads, \
         batch 1, `AttentionPath::Auto`; each case in a fresh process\n"
    );
    println!("| case | seconds | peak RSS (MiB) | memory / plain | time / plain at 4096 |");
    println!("|---|---|---|---|---|");
    let mut plain_4096 = None;
    let mut plain_rss = std::collections::HashMap::new();
    for (name, feature, seq) in FEATURE_CASES {
        match spawn_case(name) {
            Ok((seconds, rss)) => {
                if feature == "plain" {
                    plain_rss.insert(seq, rss);
                    if seq == 4096 {
                        plain_4096 = Some(seconds);
                    }
                }
                let memory = plain_rss.get(&seq).map_or(f64::NAN, |plain| rss / plain);
                let time = plain_4096.map_or(f64::NAN, |plain| seconds / plain);
                println!("| {name} | {seconds:.2} | {rss:.0} | {memory:.2} | {time:.2} |");
            }
            Err(reason) => println!("| {name} | failed: {reason} | | | |"),
        }
    }
}

/// Largest absolute difference between the flash kernel's gradients (and output) and the
/// explicit path's, against the largest magnitude, for a causal self-attention of `seq` tokens.
fn compare_gradients(seq: usize) {
    let device = Device::flex().autodiff();
    device.seed(0);
    let module = MultiHeadAttentionConfig::new(D_MODEL, HEADS).init(&device);
    let x = Tensor::<3>::random([1, seq, D_MODEL], Distribution::Normal(0.0, 1.0), &device);
    let run = |path: AttentionPath| {
        let x = x.clone().detach().require_grad();
        let context = module
            .forward(MhaInput::self_attn(x.clone()).causal().path(path))
            .context;
        let grads = (context.clone() * context.clone().sin()).sum().backward();
        vec![
            ("context", context.inner().reshape([-1])),
            ("d x", x.grad(&grads).unwrap().reshape([-1])),
            (
                "d W_q",
                module.query.weight.grad(&grads).unwrap().reshape([-1]),
            ),
            (
                "d W_k",
                module.key.weight.grad(&grads).unwrap().reshape([-1]),
            ),
            (
                "d W_v",
                module.value.weight.grad(&grads).unwrap().reshape([-1]),
            ),
        ]
    };
    let explicit = run(AttentionPath::Explicit);
    let flash = run(AttentionPath::Flash(BlockSizes::default()));
    println!("causal self-attention, {seq} tokens, flash kernel vs explicit path on flex");
    for ((what, expected), (_, actual)) in explicit.into_iter().zip(flash) {
        let magnitude = expected.clone().abs().max().into_scalar::<f32>();
        let difference = (actual - expected).abs().max().into_scalar::<f32>();
        println!("{what}: max abs difference {difference:.2e} (max abs value {magnitude:.2e})");
    }
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    if let Some(case) = args.first() {
        if case == GRADIENT_CHECK {
            compare_gradients(4096);
        } else if case == "features" {
            feature_table();
        } else if let Some((name, feature, seq)) =
            FEATURE_CASES.iter().copied().find(|c| c.0 == case)
        {
            run_feature_case(name, feature, seq);
        } else {
            run_case(case);
        }
        return;
    }
    println!(
        "d_model {D_MODEL}, {HEADS} heads, batch 1; each case in a fresh process (wgpu: the \
         default adapter, lavapipe on a machine without a GPU, which allocates from host \
         memory)\n"
    );
    println!("| case | seconds | peak RSS (MiB) |");
    println!("|---|---|---|");
    for (name, ..) in CASES {
        match spawn_case(name) {
            Ok((seconds, rss)) => println!("| {name} | {seconds:.3} | {rss:.0} |"),
            Err(reason) => println!("| {name} | failed: {reason} | |"),
        }
    }
    feature_table();
}
