//! Peak memory and time of long-sequence attention on flex: this crate's module against Burn's
//! `burn::nn::attention::MultiHeadAttention`, each case in its own process so that peaks do not
//! mix (peak resident set size, `VmHWM` of `/proc/self/status`).
//!
//! ```sh
//! cargo bench --bench long_sequence            # all cases, one table
//! cargo bench --bench long_sequence -- CASE    # one case (what the table runs)
//! ```
//!
//! Burn's module materialises `[batch, heads, seq, seq]` scores (8.6 GB at 16384 tokens, more
//! than this 24 GiB machine can hold with the softmax's copies), so it is measured at 8192.

use std::process::Command;
use std::time::Instant;

use burn::module::Module;
use burn::nn::attention::{MhaInput as BurnMhaInput, MultiHeadAttentionConfig as BurnMhaConfig};
use burn::tensor::{Device, Distribution, Tensor};
use mha::{MhaInput, MultiHeadAttentionConfig};

const D_MODEL: usize = 512;
const HEADS: usize = 8;

/// (name, implementation, sequence length, training)
const CASES: [(&str, &str, usize, bool); 5] = [
    ("ours-inference-16384", "ours", 16384, false),
    ("burn-inference-8192", "burn", 8192, false),
    ("ours-inference-8192", "ours", 8192, false),
    ("ours-training-4096", "ours", 4096, true),
    ("burn-training-4096", "burn", 4096, true),
];

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
    let (_, implementation, seq, training) = CASES
        .iter()
        .copied()
        .find(|case| case.0 == name)
        .unwrap_or_else(|| panic!("unknown case {name}"));
    let plain = Device::flex();
    plain.seed(0);
    let device = if training { plain.autodiff() } else { plain };
    let x = Tensor::<3>::random([1, seq, D_MODEL], Distribution::Normal(0.0, 1.0), &device);
    let started = Instant::now();
    let checksum = match implementation {
        "ours" => {
            let module = MultiHeadAttentionConfig::new(D_MODEL, HEADS).init(&device);
            let x = if training { x.require_grad() } else { x };
            let context = module.forward(MhaInput::self_attn(x.clone())).context;
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

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    if let Some(case) = args.first() {
        run_case(case);
        return;
    }
    println!("flex, d_model {D_MODEL}, {HEADS} heads, batch 1; each case in a fresh process\n");
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
