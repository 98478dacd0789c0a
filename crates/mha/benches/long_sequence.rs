//! Peak memory and time of long-sequence attention on flex (and training on wgpu): this crate's
//! module against Burn's `burn::nn::attention::MultiHeadAttention`, each case in its own process
//! so that peaks do not mix (peak resident set size, `VmHWM` of `/proc/self/status`; on
//! lavapipe, wgpu's software Vulkan driver, device memory is host memory and counts too).
//!
//! ```sh
//! cargo bench --workspace --bench long_sequence            # all cases, one table
//! cargo bench --workspace --bench long_sequence -- CASE    # one case (what the table runs)
//! ```
//!
//! Burn's module materialises `[batch, heads, seq, seq]` scores (8.6 GB at 16384 tokens, more
//! than this 24 GiB machine can hold with the softmax's copies), so it is measured at 8192.

use std::process::Command;
use std::time::Instant;

use burn::module::Module;
use burn::nn::attention::{MhaInput as BurnMhaInput, MultiHeadAttentionConfig as BurnMhaConfig};
use burn::tensor::{Device, Distribution, Tensor};
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

/// Not in the table: `cargo bench --workspace --bench long_sequence -- gradients-4096` compares the input
/// and weight gradients of the flash kernel (`Auto`) with the explicit path's at 4096 tokens.
const GRADIENT_CHECK: &str = "gradients-4096";

fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|line| line.starts_with("VmHWM:"))
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|kib| kib.parse::<f64>().ok())
        .map_or(f64::NAN, |kib| kib / 1024.0)
}

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
    let exe = std::env::current_exe().expect("own path");
    for (name, ..) in CASES {
        let output = Command::new(&exe).arg(name).output().expect("spawn case");
        let stdout = String::from_utf8_lossy(&output.stdout);
        match stdout
            .lines()
            .last()
            .map(|l| l.split(',').collect::<Vec<_>>())
        {
            Some(fields) if output.status.success() && fields.len() == 4 => {
                println!("| {name} | {} | {} |", fields[1], fields[2]);
            }
            _ => println!(
                "| {name} | failed: {} | |",
                String::from_utf8_lossy(&output.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            ),
        }
    }
}
