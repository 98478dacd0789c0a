//! Decoding speed against the memory-bandwidth bound: one token at a time, batch 1, with the KV
//! cache at 512, 4096 and 16384 cached positions in each storage (f32, f16, int8; d_model 512,
//! 8 query heads, 2 key/value heads unless `--kv-heads` says otherwise, flex; every position
//! kept, or a window with `--window` and `--sinks`), beside the bytes each step must read (the
//! cached keys and values as stored, and the four projection weights) and the time reading
//! that many bytes takes at this machine's measured read bandwidth on one thread: a short step
//! runs on one; a long one is spread over rayon's threads (the flash kernel's heads in f32,
//! parts of the positions in f16 and int8) and can beat it.
//!
//! Then many sequences at once (`decoding/concurrent.rs`): continuous batching over a
//! `PagedKvCache` against a padded `KvCache` batch and against one sequence at a time. Then an
//! encoder-decoder's decoder serving many sequences, each over its own memory
//! (`decoding/encoder_decoder.rs`): one paged step against one sequence at a time.
//!
//! `cargo bench --workspace --features burn-mha/wgpu,train-demo/ndarray,train-demo/wgpu
//! --bench decoding` (options: `--positions 512,4096,16384`, `--steps 64`, `--concurrent
//! 1,8,32`, `--rounds 16`, `--block-size 16`, `--ways paged,padded,single`, `--storage
//! float,half,int8`, `--decoder 8,32` (the encoder-decoder table's numbers of sequences),
//! `--layers 1`, `--kv-heads 2`, `--window W` (none by default), `--sinks S`
//! (0; with `--window`, a streaming window), `--alibi` (off), `--softcap C` (none), `--device
//! flex|ndarray|wgpu` (flex; wgpu with the `wgpu` feature, where the bandwidth bounds, read by
//! the CPU, say nothing); an empty list skips its table).

use std::time::Instant;

use burn::tensor::{Device, Distribution, Tensor};
use mha::{CacheLimit, KvCache, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};

#[path = "decoding/concurrent.rs"]
mod concurrent;
#[path = "../tests/common/devices.rs"]
#[allow(dead_code)] // the bench picks a device by name only
mod devices;
#[path = "decoding/encoder_decoder.rs"]
mod encoder_decoder;

const D_MODEL: usize = 512;
const HEADS: usize = 8;

/// Bytes per second read by summing a 256 MiB buffer (far larger than the caches) on `threads`
/// threads, each its own slice, best of five.
fn read_bandwidth(threads: usize) -> f64 {
    let values = vec![1.0f32; 64 << 20];
    let slice = values.len().div_ceil(threads);
    let mut best = f64::INFINITY;
    let mut total = 0.0f32;
    for _ in 0..5 {
        let started = Instant::now();
        total += std::thread::scope(|scope| {
            let sums: Vec<_> = values
                .chunks(slice)
                .map(|part| scope.spawn(move || sum(part)))
                .collect();
            sums.into_iter()
                .map(|sum| sum.join().expect("a summing thread"))
                .sum::<f32>()
        });
        best = best.min(started.elapsed().as_secs_f64());
    }
    assert!(total > 0.0);
    (values.len() * 4) as f64 / best
}

/// What two tasks of [`PAIR_TASK`] each take on rayon's threads, started 1 ms after the last
/// pair so that the workers have gone to sleep: the 10th, 50th and 90th percentiles of 60
/// pairs, in µs. About `PAIR_TASK` where the machine wakes a worker at once, twice that where
/// the second task waited for the first. A step over many sequences pays such wake-ups in each
/// of its parallel parts (projections, attention, output projection); one sequence at a time
/// pays them only where its step is long enough to be spread.
fn parallel_pair() -> [f64; 3] {
    let spin = || {
        let started = Instant::now();
        while started.elapsed() < PAIR_TASK {
            std::hint::spin_loop();
        }
    };
    let mut times: Vec<f64> = (0..60)
        .map(|_| {
            std::thread::sleep(std::time::Duration::from_millis(1));
            let started = Instant::now();
            rayon::join(spin, spin);
            started.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    times.sort_by(f64::total_cmp);
    [times[6], times[30], times[54]]
}

/// The length of each of [`parallel_pair`]'s tasks.
const PAIR_TASK: std::time::Duration = std::time::Duration::from_micros(300);

/// The sum of `values`, with eight accumulators so that it vectorises and is bound by memory,
/// not latency.
fn sum(values: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    for chunk in values.chunks_exact(8) {
        for (lane, value) in lanes.iter_mut().zip(chunk) {
            *lane += value;
        }
    }
    lanes.iter().sum()
}

/// The bench's options (see the crate docs above).
struct Options {
    positions: Vec<usize>,
    steps: usize,
    concurrency: Vec<usize>,
    rounds: usize,
    /// Numbers of sequences of the encoder-decoder table.
    decoder_concurrency: Vec<usize>,
    block_size: usize,
    ways: Vec<concurrent::Way>,
    storages: Vec<mha::CacheStorage>,
    /// Attention layers the many-sequence table stacks.
    layers: usize,
    /// Key/value heads of every layer: 2 (four query heads share each), or 8 for plain
    /// multi-head attention.
    kv_heads: usize,
    /// The one-sequence table's caches keep a sliding window of this many positions.
    window: Option<usize>,
    /// With `window`, the first positions kept too (a streaming window's sinks).
    sinks: usize,
    /// Every layer with ALiBi.
    alibi: bool,
    /// Every layer's logit soft cap.
    softcap: Option<f64>,
    /// The device's name.
    device: String,
}

impl Options {
    fn from_args() -> Self {
        let mut options = Self {
            positions: vec![512, 4096, 16384],
            steps: 64,
            concurrency: vec![1, 8, 32],
            rounds: 16,
            decoder_concurrency: vec![8, 32],
            block_size: 16,
            ways: concurrent::Way::ALL.to_vec(),
            storages: vec![
                mha::CacheStorage::Float,
                mha::CacheStorage::Half,
                mha::CacheStorage::Int8,
            ],
            layers: 1,
            kv_heads: 2,
            window: None,
            sinks: 0,
            alibi: false,
            softcap: None,
            device: "flex".to_string(),
        };
        let list = |text: String, name: &str| -> Vec<usize> {
            text.split(',')
                .filter(|n| !n.is_empty())
                .map(|n| n.parse().unwrap_or_else(|_| panic!("{name}: numbers")))
                .collect()
        };
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            let mut value = || args.next().expect("a value after the option");
            match arg.as_str() {
                "--positions" => options.positions = list(value(), "--positions"),
                "--steps" => options.steps = value().parse().expect("--steps: a number"),
                "--concurrent" => options.concurrency = list(value(), "--concurrent"),
                "--rounds" => options.rounds = value().parse().expect("--rounds: a number"),
                "--decoder" => options.decoder_concurrency = list(value(), "--decoder"),
                "--layers" => {
                    options.layers = value().parse().expect("--layers: a number");
                    assert!(options.layers > 0, "--layers: at least 1");
                }
                "--kv-heads" => {
                    options.kv_heads = value().parse().expect("--kv-heads: a number");
                    assert!(
                        options.kv_heads > 0 && HEADS.is_multiple_of(options.kv_heads),
                        "--kv-heads: a divisor of {HEADS}"
                    );
                }
                "--window" => {
                    let window = value().parse().expect("--window: a number");
                    assert!(window > 1, "--window: at least 2");
                    options.window = Some(window);
                }
                "--sinks" => options.sinks = value().parse().expect("--sinks: a number"),
                "--alibi" => options.alibi = true,
                "--device" => options.device = value(),
                "--softcap" => {
                    options.softcap = Some(value().parse().expect("--softcap: a number"))
                }
                "--block-size" => {
                    options.block_size = value().parse().expect("--block-size: a number")
                }
                "--ways" => {
                    options.ways = value()
                        .split(',')
                        .filter(|way| !way.is_empty())
                        .map(concurrent::Way::parse)
                        .collect()
                }
                "--storage" => {
                    options.storages = value()
                        .split(',')
                        .filter(|storage| !storage.is_empty())
                        .map(concurrent::parse_storage)
                        .collect()
                }
                _ => {}
            }
        }
        options
    }
}

fn main() {
    let options = Options::from_args();
    let device = devices::device_by_name(&options.device).unwrap_or_else(|error| panic!("{error}"));
    device.seed(0);
    let kv_heads = options.kv_heads;
    let config = MultiHeadAttentionConfig::new(D_MODEL, HEADS)
        .with_n_kv_heads(Some(kv_heads))
        .with_alibi(options.alibi)
        .with_softcap(options.softcap);
    let module = config.init(&device);
    // A short batch-1 decoding step runs on one thread; a step over many sequences on all of
    // rayon's (a task per sequence, or per part of a long one's positions, a thread per core
    // unless RAYON_NUM_THREADS says otherwise), whose bound is the bandwidth of all cores
    // together.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (one_thread, all_threads) = (read_bandwidth(1), read_bandwidth(threads));
    let head_dim = D_MODEL / HEADS;
    println!(
        "{}, d_model {D_MODEL}, {HEADS} query / {kv_heads} key-value heads{}{}, f32, the CPU \
         kernels' {} copies (`MHA_CPU_CAPABILITY` caps them); read bandwidth {:.1} GB/s on one \
         thread, {:.1} GB/s on {threads} (sum of a 256 MiB buffer, best of 5): the first is the \
         one-sequence table's bound, the second the many-sequence table's",
        options.device,
        if options.alibi { ", ALiBi" } else { "" },
        options
            .softcap
            .map_or(String::new(), |cap| format!(", soft cap {cap}")),
        mha::cpu_capability().name(),
        one_thread / 1e9,
        all_threads / 1e9
    );
    let [p10, p50, p90] = parallel_pair();
    println!(
        "two tasks of {} µs on rayon's {} threads took {p10:.0} / {p50:.0} / {p90:.0} µs (10th, \
         50th, 90th percentile of 60 pairs, each 1 ms after the last): {} where the workers \
         wake at once, {} where one waits for the other",
        PAIR_TASK.as_micros(),
        rayon::current_num_threads(),
        PAIR_TASK.as_micros(),
        2 * PAIR_TASK.as_micros()
    );
    if !options.positions.is_empty() {
        one_sequence_table(&module, &options, one_thread, &device);
    }
    let sizes = concurrent::Sizes {
        d_model: D_MODEL,
        kv_heads,
        head_dim,
        block_size: options.block_size,
    };
    if !options.concurrency.is_empty() {
        let runs = concurrent::Runs {
            concurrency: &options.concurrency,
            rounds: options.rounds,
            ways: &options.ways,
            storages: &options.storages,
        };
        // The first layer is the one-sequence table's; the others alike, with their own weights.
        let mut layers = vec![module];
        layers.extend((1..options.layers).map(|_| config.init(&device)));
        concurrent::table(&layers, &sizes, &runs, all_threads, &device);
    }
    if !options.decoder_concurrency.is_empty() {
        encoder_decoder::table(
            [D_MODEL, HEADS, kv_heads],
            &options.decoder_concurrency,
            options.rounds,
            &device,
        );
    }
}

/// ms per token of one sequence decoded with a `KvCache` (holding every position, or the
/// sliding window `options.window`), at each of `options.positions`.
fn one_sequence_table(
    module: &MultiHeadAttention,
    options: &Options,
    bandwidth: f64,
    device: &Device,
) {
    let steps = options.steps;
    let (head_dim, kv_heads) = (D_MODEL / HEADS, options.kv_heads);
    let weight_bytes = 4 * (2 * D_MODEL * D_MODEL + 2 * D_MODEL * kv_heads * head_dim);
    let (window, sinks) = (options.window, options.sinks);
    let held = |cached: usize| window.map_or(cached, |window| cached.min(sinks + window - 1));
    match window {
        // A window's cache moves its positions now and then (a step's mean includes it).
        Some(window) => println!(
            "\nbatch 1, a window of {window} and {sinks} sinks (the cache holding the first {sinks} \
             and the latest {} positions), median and mean of {steps} steps\n",
            window - 1
        ),
        None => println!("\nbatch 1, median and mean of {steps} steps\n"),
    }
    println!(
        "| storage | cached positions | ms per token | mean ms | bytes a step must read | at {:.1} GB/s, ms | time / bound |",
        bandwidth / 1e9
    );
    println!("|---|---|---|---|---|---|---|");
    for (&storage, &cached) in options.storages.iter().flat_map(|storage| {
        options
            .positions
            .iter()
            .map(move |cached| (storage, cached))
    }) {
        let mut cache = match window {
            Some(window) if sinks > 0 => {
                KvCache::with_limit(CacheLimit::StreamingWindow { sinks, window })
            }
            Some(window) => KvCache::with_limit(CacheLimit::SlidingWindow(window)),
            None => KvCache::new(),
        }
        .with_storage(storage);
        let prompt = Tensor::<3>::random([1, cached, D_MODEL], Distribution::Default, device);
        module
            .forward_cached(MhaInput::self_attn(prompt).causal(), &mut cache)
            .expect("an unbounded cache");
        let token = Tensor::<3>::random([1, 1, D_MODEL], Distribution::Default, device);
        let mut times = Vec::with_capacity(steps);
        for _ in 0..steps {
            let started = Instant::now();
            let output = module
                .forward_cached(MhaInput::self_attn(token.clone()).causal(), &mut cache)
                .expect("an unbounded cache");
            output.context.into_data();
            times.push(started.elapsed().as_secs_f64());
        }
        let mean = times.iter().sum::<f64>() / steps as f64;
        times.sort_by(f64::total_cmp);
        let median = times[steps / 2];
        // The keys and values of every position held as stored, and the projection weights.
        let bytes =
            held(cached) * concurrent::position_bytes(storage, kv_heads, head_dim) + weight_bytes;
        let bound = bytes as f64 / bandwidth;
        println!(
            "| {storage:?} | {cached} | {:.3} | {:.3} | {:.1} MB | {:.3} | {:.1}x |",
            median * 1e3,
            mean * 1e3,
            bytes as f64 / 1e6,
            bound * 1e3,
            median / bound
        );
    }
}
