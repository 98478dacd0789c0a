//! One table: this crate's `MultiHeadAttention` against Burn's
//! `burn::nn::attention::MultiHeadAttention`, same sizes, same device, same run.
//!
//! ```sh
//! cargo bench --workspace --bench table                          # flex and ndarray, every shape
//! cargo bench --workspace --bench table -- --devices flex --shapes 4x512x512x8
//! cargo bench --workspace --bench table -- --devices wgpu --shapes 8x128x256x8
//! cargo bench --workspace --bench table -- --ours-only --modes fwd+bwd   # no Burn column
//! cargo bench --workspace --bench table -- --burn-only --modes fwd+weights   # Burn's alone
//! cargo bench --workspace --bench table -- --input-std 12     # a sharp softmax (tiny probabilities)
//! ```
//!
//! Modes: `fwd` (inference, no weights), `fwd+weights` (per-head weights returned) and
//! `fwd+bwd` (autodiff device, gradient of `sum(context²)` with respect to the input and every
//! parameter). Each call reads back the sum of the context and, with weights, one element of
//! them (which makes a lazy backend compute them): summing the weights too would time flex's
//! single-threaded reduction of `batch · heads · seq²` floats as well, not the module. Each
//! cell is the median of several runs after a warm-up; GFLOP/s counts the four projections and
//! the two attention matmuls (`fwd+bwd` counts three times the forward).
//! Burn's module always computes its weights, so its `fwd` and `fwd+weights` are one path.

use std::time::{Duration, Instant};

use burn::module::Param;
use burn::nn::attention::{MhaInput as BurnMhaInput, MultiHeadAttentionConfig as BurnMhaConfig};
use burn::tensor::{Device, DeviceKind, Distribution, Tensor};
use mha::{AttentionPath, MhaInput, MultiHeadAttentionConfig, NeedWeights};

#[derive(Clone, Copy, Debug)]
struct Shape {
    batch: usize,
    seq: usize,
    d_model: usize,
    heads: usize,
}

impl Shape {
    fn parse(text: &str) -> Shape {
        let numbers: Vec<usize> = text
            .split('x')
            .map(|n| n.parse().expect("--shapes: BxLxExH, e.g. 4x512x512x8"))
            .collect();
        assert_eq!(numbers.len(), 4, "--shapes: BxLxExH, e.g. 4x512x512x8");
        Shape {
            batch: numbers[0],
            seq: numbers[1],
            d_model: numbers[2],
            heads: numbers[3],
        }
    }

    /// Forward multiply-adds × 2: q, k, v, out projections and `q kᵀ`, `p v`.
    fn forward_flops(&self) -> f64 {
        let (b, l, e) = (self.batch as f64, self.seq as f64, self.d_model as f64);
        2.0 * (4.0 * b * l * e * e + 2.0 * b * l * l * e)
    }
}

const SHAPES: [&str; 4] = ["8x128x256x8", "4x512x512x8", "1x2048x512x8", "1x8192x512x8"];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Forward,
    ForwardWeights,
    ForwardBackward,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Forward => "fwd",
            Mode::ForwardWeights => "fwd+weights",
            Mode::ForwardBackward => "fwd+bwd",
        }
    }
}

fn device(name: &str) -> Device {
    match name {
        "flex" => Device::flex(),
        #[allow(deprecated)]
        "ndarray" => Device::ndarray(),
        "wgpu" => Device::wgpu(DeviceKind::DefaultDevice),
        other => panic!("--devices: unknown device {other} (flex, ndarray, wgpu)"),
    }
}

/// Runs each case once to warm up, then alternately (so that drift in the machine's speed hits
/// both alike) until `budget` is spent, at least 3 and at most `max_runs` times each; returns
/// the medians in milliseconds.
fn interleaved_medians(
    (budget, max_runs): (Duration, usize),
    cases: &mut [Box<dyn FnMut() -> f32 + '_>],
) -> Vec<f64> {
    for case in cases.iter_mut() {
        assert!(case().is_finite(), "non-finite result");
    }
    let mut times = vec![Vec::new(); cases.len()];
    let started = Instant::now();
    while times[0].len() < 3 || (started.elapsed() < budget && times[0].len() < max_runs) {
        for (case, times) in cases.iter_mut().zip(&mut times) {
            let t = Instant::now();
            std::hint::black_box(case());
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    times
        .into_iter()
        .map(|mut times| {
            times.sort_by(f64::total_cmp);
            times[times.len() / 2]
        })
        .collect()
}

/// The device a mode runs on: with autodiff for `fwd+bwd`.
fn mode_device(mode: Mode, device: &Device) -> Device {
    if mode == Mode::ForwardBackward {
        device.clone().autodiff()
    } else {
        device.clone()
    }
}

/// A `[batch, seq, d_model]` input of standard deviation `deviation` (1 by default; 12 spreads
/// the scores over about ±50, a sharp softmax like a trained model's, `--input-std 12`).
fn input(shape: Shape, deviation: f64, device: &Device) -> Tensor<3> {
    Tensor::random(
        [shape.batch, shape.seq, shape.d_model],
        Distribution::Normal(0.0, deviation),
        device,
    )
}

/// The first of `weights`' elements, read back.
fn first_element(weights: Tensor<4>) -> f32 {
    weights.slice([0..1, 0..1, 0..1, 0..1]).into_scalar::<f32>()
}

/// Backward of `sum(context²)`, read back through the input's and the output projection's
/// gradients so that the whole graph runs.
fn backward_checksum(context: Tensor<3>, x: &Tensor<3>, output_weight: &Param<Tensor<2>>) -> f32 {
    let grads = context.powi_scalar(2).sum().backward();
    x.grad(&grads)
        .expect("input gradient")
        .sum()
        .into_scalar::<f32>()
        + output_weight
            .grad(&grads)
            .expect("weight gradient")
            .sum()
            .into_scalar::<f32>()
}

fn ours(
    (shape, deviation): (Shape, f64),
    mode: Mode,
    path: AttentionPath,
    device: &Device,
) -> Box<dyn FnMut() -> f32> {
    let device = mode_device(mode, device);
    let module = MultiHeadAttentionConfig::new(shape.d_model, shape.heads).init(&device);
    let x = input(shape, deviation, &device);
    Box::new(move || match mode {
        Mode::Forward => module
            .forward(MhaInput::self_attn(x.clone()).path(path))
            .context
            .sum()
            .into_scalar::<f32>(),
        Mode::ForwardWeights => {
            let output =
                module.forward(MhaInput::self_attn(x.clone()).need_weights(NeedWeights::PerHead));
            let weights = output.weights.and_then(|w| w.per_head()).expect("weights");
            output.context.sum().into_scalar::<f32>() + first_element(weights)
        }
        Mode::ForwardBackward => {
            let x = x.clone().require_grad();
            let context = module
                .forward(MhaInput::self_attn(x.clone()).path(path))
                .context;
            backward_checksum(context, &x, &module.output.weight)
        }
    })
}

fn burn((shape, deviation): (Shape, f64), mode: Mode, device: &Device) -> Box<dyn FnMut() -> f32> {
    let device = mode_device(mode, device);
    let module = BurnMhaConfig::new(shape.d_model, shape.heads)
        .with_dropout(0.0)
        .init(&device);
    let x = input(shape, deviation, &device);
    Box::new(move || match mode {
        Mode::Forward | Mode::ForwardWeights => {
            let output = module.forward(BurnMhaInput::self_attn(x.clone()));
            output.context.sum().into_scalar::<f32>() + first_element(output.weights)
        }
        Mode::ForwardBackward => {
            let x = x.clone().require_grad();
            let context = module.forward(BurnMhaInput::self_attn(x.clone())).context;
            backward_checksum(context, &x, &module.output.weight)
        }
    })
}

/// What the command line asks for.
struct Options {
    devices: Vec<String>,
    shapes: Vec<Shape>,
    modes: Vec<Mode>,
    budget: Duration,
    max_runs: usize,
    path: AttentionPath,
    with_ours: bool,
    with_burn: bool,
    deviation: f64,
}

impl Options {
    fn from_args() -> Self {
        let mut options = Options {
            devices: vec!["flex".to_string(), "ndarray".to_string()],
            shapes: SHAPES.iter().map(|s| Shape::parse(s)).collect(),
            modes: vec![Mode::Forward, Mode::ForwardWeights, Mode::ForwardBackward],
            budget: Duration::from_secs(3),
            max_runs: 15,
            path: AttentionPath::Auto,
            with_ours: true,
            with_burn: true,
            deviation: 1.0,
        };
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            let mut value = || args.next().unwrap_or_else(|| panic!("{arg} needs a value"));
            match arg.as_str() {
                "--devices" => options.devices = value().split(',').map(str::to_string).collect(),
                "--shapes" => options.shapes = value().split(',').map(Shape::parse).collect(),
                "--modes" => options.modes = value().split(',').map(parse_mode).collect(),
                "--path" => options.path = parse_path(&value()),
                // `--ours-only`: no Burn column, for profiling this module alone (`perf record`).
                "--ours-only" => (options.with_ours, options.with_burn) = (true, false),
                // `--burn-only`: Burn's module alone; with `--ours-only` in another process, each
                // module runs in its own (alternated in one process, each one's large outputs
                // land in memory the other's call left free).
                "--burn-only" => (options.with_ours, options.with_burn) = (false, true),
                "--budget-s" => {
                    options.budget = Duration::from_secs_f64(value().parse().expect("seconds"))
                }
                // `--max-runs`: 15 by default, as PyTorch's script; more to profile a small
                // shape's steady state rather than its first calls.
                "--max-runs" => options.max_runs = value().parse().expect("a count"),
                // `--input-std`: the inputs' standard deviation, 1 by default (see `input`).
                "--input-std" => options.deviation = value().parse().expect("a deviation"),
                // `--pool-limit-mib`: the CPU output buffer pool's limit (`mha::buffer_pool`),
                // 256 MiB by default; `MHA_HUGE_PAGES=1` in the environment asks for huge pages.
                "--pool-limit-mib" => {
                    let mib: usize = value().parse().expect("MiB");
                    mha::buffer_pool::set_limit(mib << 20);
                }
                // `cargo bench` passes `--bench`; the other libtest flags mean nothing here.
                _ => {}
            }
        }
        options
    }
}

fn parse_mode(name: &str) -> Mode {
    match name {
        "fwd" => Mode::Forward,
        "fwd+weights" => Mode::ForwardWeights,
        "fwd+bwd" => Mode::ForwardBackward,
        other => panic!("--modes: unknown mode {other}"),
    }
}

fn parse_path(name: &str) -> AttentionPath {
    match name {
        "auto" => AttentionPath::Auto,
        "fused" => AttentionPath::Fused,
        "explicit" => AttentionPath::Explicit,
        "chunked" => AttentionPath::Chunked(Default::default()),
        "flash" => AttentionPath::Flash(Default::default()),
        other => panic!("--path: unknown path {other} (auto, fused, explicit, chunked, flash)"),
    }
}

fn main() {
    let options = Options::from_args();
    let Options {
        path, deviation, ..
    } = options;
    println!(
        "threads: {} | our path: {path:?} | inputs' deviation {deviation} | median of ≥3 runs after a warm-up | GFLOP/s over the module's matmuls | buffer pool limit {} MiB, huge pages {}\n",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        mha::buffer_pool::limit() >> 20,
        if mha::buffer_pool::huge_pages() {
            "on"
        } else {
            "off"
        },
    );
    println!(
        "| device | batch, seq, d_model, heads | mode | ours ms | ours GFLOP/s | Burn MHA ms | Burn GFLOP/s | speed-up |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for device_name in &options.devices {
        let device = device(device_name);
        device.seed(0);
        for &shape in &options.shapes {
            for &mode in &options.modes {
                print_row(&options, device_name, &device, (shape, mode));
            }
        }
    }
}

/// Times one cell, ours and Burn's in turn, and prints its row.
fn print_row(options: &Options, device_name: &str, device: &Device, (shape, mode): (Shape, Mode)) {
    let flops = shape.forward_flops()
        * if mode == Mode::ForwardBackward {
            3.0
        } else {
            1.0
        };
    let mut cases = Vec::new();
    if options.with_ours {
        cases.push(ours((shape, options.deviation), mode, options.path, device));
    }
    if options.with_burn {
        cases.push(burn((shape, options.deviation), mode, device));
    }
    let mut medians =
        interleaved_medians((options.budget, options.max_runs), &mut cases).into_iter();
    let ours = options.with_ours.then(|| medians.next()).flatten();
    let burn = options.with_burn.then(|| medians.next()).flatten();
    let cells = |ms: Option<f64>| match ms {
        Some(ms) => format!("{ms:.1} | {:.1}", flops / ms / 1e6),
        None => "- | -".to_string(),
    };
    let speed_up = match (ours, burn) {
        (Some(ours), Some(burn)) => format!("{:.2}x", burn / ours),
        _ => "-".to_string(),
    };
    println!(
        "| {device_name} | {}, {}, {}, {} | {} | {} | {} | {speed_up} |",
        shape.batch,
        shape.seq,
        shape.d_model,
        shape.heads,
        mode.name(),
        cells(ours),
        cells(burn),
    );
}
