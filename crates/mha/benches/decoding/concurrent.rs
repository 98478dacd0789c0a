//! Many sequences decoded at once: tokens per second at 1, 8 and 32 concurrent sequences of
//! mixed cached lengths (128–4096 positions), three ways — one `forward_paged` step for all of
//! them over a `PagedKvCache`, one `forward_cached` step of a `KvCache` batch padded to the
//! longest, and one `forward_cached` step per sequence, each with its own `KvCache` — beside the
//! bytes each way's step reads and the time that takes at the measured read bandwidth.

use std::time::Instant;

use burn::tensor::{Bool, Device, Distribution, Tensor};
use mha::{KvCache, MhaInput, MultiHeadAttention, PagedKvCache, PagedKvCacheConfig, SequenceId};

/// Cached lengths, cycled through by the sequences: mixed, 128 to 4096 positions.
const LENGTHS: [usize; 8] = [1024, 128, 4096, 256, 2048, 512, 3072, 768];

/// Sizes of the module under test (for the byte counts) and of the paged cache's blocks.
pub struct Sizes {
    pub d_model: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

/// How each way was measured: the median of `rounds` decoding rounds (one new token for every
/// sequence).
pub fn table(
    module: &MultiHeadAttention,
    sizes: &Sizes,
    concurrency: &[usize],
    rounds: usize,
    bandwidth: f64,
    device: &Device,
) {
    println!(
        "\n| sequences | cached positions (sum, longest) | way | tokens/s | ms per round | bytes a round reads | time / bound |"
    );
    println!("|---|---|---|---|---|---|---|");
    for &count in concurrency {
        let lengths: Vec<usize> = (0..count).map(|i| LENGTHS[i % LENGTHS.len()]).collect();
        let longest = *lengths.iter().max().expect("a sequence");
        let stored: usize = lengths.iter().sum();
        let position_bytes = 2 * sizes.kv_heads * sizes.head_dim * 4;
        let weight_bytes = 4
            * (2 * sizes.d_model * sizes.d_model
                + 2 * sizes.d_model * sizes.kv_heads * sizes.head_dim);
        let ways: [(&str, f64, usize); 3] = [
            (
                "paged (`forward_paged`)",
                paged_round(module, &lengths, rounds, sizes, device),
                stored * position_bytes + weight_bytes,
            ),
            (
                "padded `KvCache` batch",
                padded_round(module, &lengths, rounds, sizes, device),
                count * longest * position_bytes + weight_bytes,
            ),
            (
                "one at a time (a `KvCache` each)",
                one_at_a_time_round(module, &lengths, rounds, sizes, device),
                stored * position_bytes + count * weight_bytes,
            ),
        ];
        for (way, seconds, bytes) in ways {
            println!(
                "| {count} | {stored}, {longest} | {way} | {:.0} | {:.2} | {:.1} MB | {:.1}x |",
                count as f64 / seconds,
                seconds * 1e3,
                bytes as f64 / 1e6,
                seconds / (bytes as f64 / bandwidth)
            );
        }
    }
}

fn random(shape: [usize; 3], device: &Device) -> Tensor<3> {
    Tensor::random(shape, Distribution::Default, device)
}

/// The median of `rounds` runs of `round`, in seconds.
fn median_seconds(rounds: usize, mut round: impl FnMut()) -> f64 {
    let mut times: Vec<f64> = (0..rounds)
        .map(|_| {
            let started = Instant::now();
            round();
            started.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// Seconds per round of one paged step for every sequence.
fn paged_round(
    module: &MultiHeadAttention,
    lengths: &[usize],
    rounds: usize,
    sizes: &Sizes,
    device: &Device,
) -> f64 {
    let block_size = sizes.block_size;
    let blocks: usize = lengths
        .iter()
        .map(|len| (len + rounds + 1).div_ceil(block_size))
        .sum();
    let mut cache: PagedKvCache = PagedKvCacheConfig::new(blocks)
        .with_block_size(block_size)
        .init();
    let ids: Vec<SequenceId> = lengths.iter().map(|_| cache.add_sequence()).collect();
    for (&id, &len) in ids.iter().zip(lengths) {
        let prompt = random([1, len, sizes.d_model], device).reshape([len, sizes.d_model]);
        module
            .forward_paged(prompt, &mut cache, &vec![id; len])
            .expect("the pool was sized for the run");
    }
    let tokens = random([1, ids.len(), sizes.d_model], device).reshape([ids.len(), sizes.d_model]);
    median_seconds(rounds, || {
        let output = module
            .forward_paged(tokens.clone(), &mut cache, &ids)
            .expect("the pool was sized for the run");
        output.into_data();
    })
}

/// Seconds per round of one step of a batch padded to the longest sequence.
fn padded_round(
    module: &MultiHeadAttention,
    lengths: &[usize],
    rounds: usize,
    sizes: &Sizes,
    device: &Device,
) -> f64 {
    let (count, longest) = (lengths.len(), *lengths.iter().max().expect("a sequence"));
    // Each sequence's prompt at the end of the padded rows (left padding), so that every row's
    // next token follows its own prompt.
    let padding: Vec<bool> = lengths
        .iter()
        .flat_map(|&len| (0..longest).map(move |position| position < longest - len))
        .collect();
    let padding =
        Tensor::<1, Bool>::from_data(padding.as_slice(), device).reshape([count, longest]);
    let mut cache = KvCache::new();
    let prompt = random([count, longest, sizes.d_model], device);
    module
        .forward_cached(
            MhaInput::self_attn(prompt)
                .causal()
                .key_padding_mask(padding),
            &mut cache,
        )
        .expect("an unbounded cache");
    let tokens = random([count, 1, sizes.d_model], device);
    median_seconds(rounds, || {
        let output = module
            .forward_cached(MhaInput::self_attn(tokens.clone()).causal(), &mut cache)
            .expect("an unbounded cache");
        output.context.into_data();
    })
}

/// Seconds per round of one step per sequence, each with its own cache.
fn one_at_a_time_round(
    module: &MultiHeadAttention,
    lengths: &[usize],
    rounds: usize,
    sizes: &Sizes,
    device: &Device,
) -> f64 {
    let mut caches: Vec<KvCache> = lengths
        .iter()
        .map(|&len| {
            let mut cache = KvCache::new();
            module
                .forward_cached(
                    MhaInput::self_attn(random([1, len, sizes.d_model], device)).causal(),
                    &mut cache,
                )
                .expect("an unbounded cache");
            cache
        })
        .collect();
    let token = random([1, 1, sizes.d_model], device);
    median_seconds(rounds, || {
        for cache in &mut caches {
            let output = module
                .forward_cached(MhaInput::self_attn(token.clone()).causal(), cache)
                .expect("an unbounded cache");
            output.context.into_data();
        }
    })
}
