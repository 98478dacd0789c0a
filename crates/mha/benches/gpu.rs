//! The GPU table: this crate's module (`AttentionPath::Auto`, and its flash and explicit paths
//! forced), Burn's `burn::nn::attention::MultiHeadAttention`, and Burn's fused attention op
//! (`burn::tensor::module::attention`, run through this crate's module with
//! `AttentionPath::Fused`: the same projections, Burn's kernel for the attention itself; under
//! autodiff Burn runs it as its decomposed fallback), in time and peak device memory.
//!
//! ```sh
//! cargo bench --workspace --features burn-mha/wgpu,train-demo/ndarray,train-demo/wgpu \
//!     --bench gpu -- --devices wgpu
//! # a CUDA build (`bash scripts/cuda-sdk.sh` first; it builds without a GPU, the CUDA driver is
//! # loaded when it starts); `benches/gpu/device-run.sh` runs the whole table on a GPU machine:
//! cargo bench --workspace --features burn-mha/wgpu,burn-mha/cuda --bench gpu -- --devices cuda
//! ```
//!
//! Options:
//! - `--devices cuda,wgpu` (default `wgpu`), `--shapes BxLxExH,…` (default the three shapes
//!   below), `--dtypes f32,bf16` (default both; `f16` too), `--modes fwd,fwd+bwd` (default both);
//! - `--implementations ours,ours-flash,ours-explicit,burn-mha,burn-fused` (default all);
//! - `--runs N` (timed runs per cell after one warm-up, default 5);
//! - `--cell-timeout S` (seconds a cell may take, warm-up and compilation included; default
//!   none): a cell past it is stopped and reported as such, and the table goes on.
//!
//! Each cell runs in a fresh process, so that one cell's memory pool is not another's: the
//! device is configured for the cell's float type first (parameters and inputs in it), one
//! warm-up run compiles and autotunes, then the median of the timed runs (each ends with a
//! device sync). Peak device memory is what the device's allocator has reserved at the end
//! (its pools grow to the peak and are not returned while the process runs); on lavapipe,
//! Mesa's software Vulkan driver, device memory is host memory and the peak RSS counts it too.
//! A cell that runs out of memory or cannot run says so.

#[path = "common/memory.rs"]
mod memory;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use burn::nn::attention::{MhaInput as BurnMhaInput, MultiHeadAttentionConfig as BurnMhaConfig};
use burn::tensor::{Device, DeviceKind, Distribution, FloatDType, Tensor};
use memory::peak_rss_mib;
use mha::{AttentionPath, BlockSizes, MhaInput, MultiHeadAttentionConfig};

/// The issue's shapes: batch × tokens × d_model × heads.
const SHAPES: [&str; 3] = ["8x1024x1024x16", "4x4096x1024x16", "1x16384x1024x16"];

/// Each implementation's name on the command line and in the table.
const IMPLEMENTATIONS: [(&str, &str); 5] = [
    ("ours", "ours (Auto)"),
    ("ours-flash", "ours (Flash)"),
    ("ours-explicit", "ours (Explicit)"),
    ("burn-mha", "Burn MHA"),
    ("burn-fused", "Burn fused op"),
];

/// One cell of the table.
#[derive(Clone, Debug)]
struct Cell {
    device: String,
    dtype: String,
    shape: [usize; 4],
    mode: String,
    implementation: String,
    runs: usize,
}

impl Cell {
    fn args(&self) -> Vec<String> {
        let [b, l, e, h] = self.shape;
        vec![
            "--cell".into(),
            self.device.clone(),
            self.dtype.clone(),
            format!("{b}x{l}x{e}x{h}"),
            self.mode.clone(),
            self.implementation.clone(),
            self.runs.to_string(),
        ]
    }

    fn parse(args: &[String]) -> Self {
        Cell {
            device: args[0].clone(),
            dtype: args[1].clone(),
            shape: parse_shape(&args[2]),
            mode: args[3].clone(),
            implementation: args[4].clone(),
            runs: args[5].parse().expect("runs"),
        }
    }
}

fn parse_shape(text: &str) -> [usize; 4] {
    let numbers: Vec<usize> = text
        .split('x')
        .map(|n| n.parse().expect("--shapes: BxLxExH, e.g. 4x4096x1024x16"))
        .collect();
    numbers
        .try_into()
        .expect("--shapes: BxLxExH, e.g. 4x4096x1024x16")
}

fn device(name: &str) -> Device {
    match name {
        "wgpu" => Device::wgpu(DeviceKind::DefaultDevice),
        #[cfg(feature = "cuda")]
        "cuda" => Device::cuda(0usize),
        #[cfg(not(feature = "cuda"))]
        "cuda" => panic!("this build has no CUDA backend: build the bench with `--features cuda`"),
        other => panic!("--devices: unknown device {other} (cuda, wgpu)"),
    }
}

fn float_dtype(name: &str) -> FloatDType {
    match name {
        "f32" => FloatDType::F32,
        "bf16" => FloatDType::BF16,
        "f16" => FloatDType::F16,
        other => panic!("--dtypes: unknown type {other} (f32, bf16, f16)"),
    }
}

/// Runs one cell in this process and prints `milliseconds,reserved MiB,peak RSS MiB,checksum`.
fn run_cell(cell: &Cell) {
    let mut device = device(&cell.device);
    let dtype = float_dtype(&cell.dtype);
    if !device.supports_dtype(dtype) {
        eprintln!("{dtype:?} is not supported on this device");
        std::process::exit(2);
    }
    device
        .configure(dtype)
        .expect("a fresh process configures its device");
    device.seed(0);
    let training = cell.mode == "fwd+bwd";
    let device = if training { device.autodiff() } else { device };
    let [batch, seq, d_model, heads] = cell.shape;
    let x = Tensor::<3>::random(
        [batch, seq, d_model],
        Distribution::Normal(0.0, 1.0),
        &device,
    );
    let mut step: Box<dyn FnMut() -> Tensor<1>> = match cell.implementation.as_str() {
        "ours" | "ours-flash" | "ours-explicit" | "burn-fused" => {
            let path = match cell.implementation.as_str() {
                "ours" => AttentionPath::Auto,
                "ours-flash" => AttentionPath::Flash(BlockSizes::default()),
                "ours-explicit" => AttentionPath::Explicit,
                _ => AttentionPath::Fused,
            };
            let module = MultiHeadAttentionConfig::new(d_model, heads).init(&device);
            Box::new(move || {
                let x = if training {
                    x.clone().require_grad()
                } else {
                    x.clone()
                };
                let context = module
                    .forward(MhaInput::self_attn(x.clone()).path(path))
                    .context;
                reduce(context, &x, training)
            })
        }
        "burn-mha" => {
            let module = BurnMhaConfig::new(d_model, heads)
                .with_dropout(0.0)
                .init(&device);
            Box::new(move || {
                let x = if training {
                    x.clone().require_grad()
                } else {
                    x.clone()
                };
                let context = module.forward(BurnMhaInput::self_attn(x.clone())).context;
                reduce(context, &x, training)
            })
        }
        other => panic!("unknown implementation {other}"),
    };
    let mut checksum = f32::NAN;
    let mut time = || {
        let started = Instant::now();
        let result = step();
        device.sync().expect("the device runs the step");
        let elapsed = started.elapsed().as_secs_f64() * 1e3;
        checksum = result.into_scalar::<f32>();
        elapsed
    };
    time();
    let mut times: Vec<f64> = (0..cell.runs.max(1)).map(|_| time()).collect();
    times.sort_by(f64::total_cmp);
    let reserved = device.memory_pool_usage().map_or(f64::NAN, |usage| {
        usage.bytes_reserved as f64 / (1 << 20) as f64
    });
    // The checksum (the last run's sum) is for comparing implementations cell by cell.
    println!(
        "{:.3},{reserved:.0},{:.0},{checksum}",
        times[times.len() / 2],
        peak_rss_mib()
    );
}

/// The context (inference) or the input's gradient of `sum(context²)` (training), reduced on
/// the device.
fn reduce(context: Tensor<3>, x: &Tensor<3>, training: bool) -> Tensor<1> {
    match training {
        false => context.sum(),
        true => {
            let grads = context.powi_scalar(2).sum().backward();
            x.grad(&grads).expect("input gradient").sum()
        }
    }
}

/// Runs `cell` in a fresh process, stopped after `timeout`: `(ms, reserved MiB, peak RSS
/// MiB)`, or why it failed.
fn spawn(cell: &Cell, timeout: Option<Duration>) -> Result<(f64, f64, f64), String> {
    let exe = std::env::current_exe().expect("own path");
    let mut child = Command::new(exe)
        .args(cell.args())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn a cell");
    let started = Instant::now();
    // Polled, so that a cell past its time can be stopped; pipes are read after it exits (a
    // cell writes a few lines, well under a pipe's buffer).
    while child.try_wait().expect("wait for a cell").is_none() {
        if timeout.is_some_and(|timeout| started.elapsed() > timeout) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "stopped after {:.0} s (--cell-timeout)",
                started.elapsed().as_secs_f64()
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = child.wait_with_output().expect("a cell's output");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let fields: Vec<f64> = stdout
        .lines()
        .last()
        .unwrap_or("")
        .split(',')
        .map(|field| field.parse().unwrap_or(f64::NAN))
        .collect();
    match (output.status.success(), fields.as_slice()) {
        (true, &[ms, reserved, rss, _checksum]) => Ok((ms, reserved, rss)),
        _ => {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let reason = stderr
                .lines()
                .rev()
                .find(|line| !line.trim().is_empty() && !line.starts_with("note:"))
                .unwrap_or("no output")
                .to_string();
            let out_of_memory = ["out of memory", "OutOfMemory", "Out of memory"];
            Err(if out_of_memory.iter().any(|text| stderr.contains(text)) {
                "out of memory".to_string()
            } else {
                reason
            })
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(position) = args.iter().position(|arg| arg == "--cell") {
        run_cell(&Cell::parse(&args[position + 1..]));
        return;
    }
    let mut devices = vec!["wgpu".to_string()];
    let mut shapes: Vec<[usize; 4]> = SHAPES.iter().map(|s| parse_shape(s)).collect();
    let mut dtypes = vec!["f32".to_string(), "bf16".to_string()];
    let mut modes = vec!["fwd".to_string(), "fwd+bwd".to_string()];
    let mut implementations: Vec<String> = IMPLEMENTATIONS
        .iter()
        .map(|(name, _)| name.to_string())
        .collect();
    let mut runs = 5;
    let mut timeout = None;
    let mut args = args.into_iter();
    let list = |text: String| text.split(',').map(str::to_string).collect::<Vec<_>>();
    while let Some(arg) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        match arg.as_str() {
            "--devices" => devices = list(value()),
            "--shapes" => shapes = value().split(',').map(parse_shape).collect(),
            "--dtypes" => dtypes = list(value()),
            "--modes" => modes = list(value()),
            "--implementations" => implementations = list(value()),
            "--runs" => runs = value().parse().expect("--runs: a count"),
            "--cell-timeout" => {
                let seconds: f64 = value().parse().expect("--cell-timeout: seconds");
                timeout = Some(Duration::from_secs_f64(seconds));
            }
            // `cargo bench` passes `--bench`; the other libtest flags mean nothing here.
            _ => {}
        }
    }
    for name in &implementations {
        assert!(
            IMPLEMENTATIONS.iter().any(|(known, _)| known == name),
            "--implementations: unknown implementation {name} ({})",
            IMPLEMENTATIONS.map(|(known, _)| known).join(", ")
        );
    }
    println!(
        "median of {runs} runs after a warm-up, each cell in a fresh process; memory: the \
         device allocator's reserved bytes (peak RSS: host memory, which lavapipe's device \
         memory is); the last column: the cell's time over the first implementation's of its shape\n"
    );
    println!(
        "| device | type | batch, seq, d_model, heads | mode | implementation | ms | reserved MiB | peak RSS MiB | vs first |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for device in &devices {
        for dtype in &dtypes {
            for &shape in &shapes {
                for mode in &modes {
                    let mut first_ms = None;
                    for (implementation, label) in IMPLEMENTATIONS
                        .into_iter()
                        .filter(|(name, _)| implementations.iter().any(|wanted| wanted == name))
                    {
                        let cell = Cell {
                            device: device.clone(),
                            dtype: dtype.clone(),
                            shape,
                            mode: mode.clone(),
                            implementation: implementation.to_string(),
                            runs,
                        };
                        let [b, l, e, h] = shape;
                        let prefix = format!(
                            "| {device} | {dtype} | {b}, {l}, {e}, {h} | {mode} | {label} |"
                        );
                        match spawn(&cell, timeout) {
                            Ok((ms, reserved, rss)) => {
                                let first = *first_ms.get_or_insert(ms);
                                let ratio = format!("{:.2}x", ms / first);
                                println!("{prefix} {ms:.1} | {reserved:.0} | {rss:.0} | {ratio} |");
                            }
                            Err(reason) => println!("{prefix} {reason} | | | |"),
                        }
                    }
                }
            }
        }
    }
}
