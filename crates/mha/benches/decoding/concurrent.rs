//! Many sequences decoded at once: tokens per second at 1, 8 and 32 concurrent sequences of
//! mixed cached lengths (128–4096 positions), three ways — one `forward_paged` step for all of
//! them over a `PagedKvCache`, one `forward_cached` step of a `KvCache` batch padded to the
//! longest, and one `forward_cached` step per sequence, each with its own `KvCache` — beside the
//! bytes each way's step reads and writes and the time that takes at the read bandwidth
//! measured on every core (the steps run on rayon's threads).
//!
//! Each table row is one storage of the caches too: f32, f16 or int8 (`--storage
//! float,half,int8`), which every way's decoding step reads as stored (on flex: the paged
//! kernel, which a compressed `KvCache`'s decoding steps run too).
//!
//! `--layers N` stacks N attention layers, each with its own weights and caches, a round feeding
//! each layer's output to the next as a model's decoding step does: with one layer the
//! projection weights stay in the CPU's caches from one sequence to the next, which a model's
//! many layers do not allow one sequence at a time.
//!
//! The ways take turns round by round, so that a shared machine's slow spells fall on all of
//! them; beside each median the table gives the median of the per-round ratios to the paged
//! step.

use std::time::Instant;

use burn::tensor::{Bool, Device, Distribution, Tensor};
use mha::{
    CacheStorage, KvCache, MhaInput, MultiHeadAttention, PagedKvCache, PagedKvCacheConfig,
    SequenceId,
};

/// Cached lengths, cycled through by the sequences: mixed, 128 to 4096 positions.
const LENGTHS: [usize; 8] = [1024, 128, 4096, 256, 2048, 512, 3072, 768];

/// Sizes of the module under test (for the byte counts) and of the paged cache's blocks.
pub struct Sizes {
    pub d_model: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

/// Bytes one cached position takes in `storage`: the keys and values of every key/value head,
/// f32, f16, or i8 and an f32 scale.
pub fn position_bytes(storage: CacheStorage, kv_heads: usize, head_dim: usize) -> usize {
    match storage {
        CacheStorage::Float => 2 * kv_heads * head_dim * 4,
        CacheStorage::Half => 2 * kv_heads * head_dim * 2,
        CacheStorage::Int8 => 2 * kv_heads * (head_dim + 4),
    }
}

/// The three ways a round can be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Way {
    /// One `forward_paged` step over a `PagedKvCache`.
    Paged,
    /// One `forward_cached` step of a `KvCache` batch left-padded to the longest sequence.
    Padded,
    /// One `forward_cached` step per sequence, each with its own `KvCache`.
    Single,
}

impl Way {
    /// Every way, in the table's order.
    pub const ALL: [Way; 3] = [Way::Paged, Way::Padded, Way::Single];

    /// `paged`, `padded` or `single` (the names `--ways` takes).
    pub fn parse(name: &str) -> Way {
        match name {
            "paged" => Way::Paged,
            "padded" => Way::Padded,
            "single" => Way::Single,
            _ => panic!("--ways: paged, padded or single, not {name:?}"),
        }
    }

    fn label(self) -> &'static str {
        match self {
            Way::Paged => "paged (`forward_paged`)",
            Way::Padded => "padded `KvCache` batch",
            Way::Single => "one at a time (a `KvCache` each)",
        }
    }
}

/// What the table runs: the numbers of concurrent sequences, the rounds each cell's median is
/// taken over, the ways measured and the caches' storages.
pub struct Runs<'a> {
    pub concurrency: &'a [usize],
    pub rounds: usize,
    pub ways: &'a [Way],
    pub storages: &'a [CacheStorage],
}

/// `float`, `half` or `int8` (the names `--storage` takes).
pub fn parse_storage(name: &str) -> CacheStorage {
    match name {
        "float" => CacheStorage::Float,
        "half" => CacheStorage::Half,
        "int8" => CacheStorage::Int8,
        _ => panic!("--storage: float, half or int8, not {name:?}"),
    }
}

/// Each way's median over `runs.rounds` decoding rounds (one new token for every sequence),
/// the ways taking turns round by round.
pub fn table(
    layers: &[MultiHeadAttention],
    sizes: &Sizes,
    runs: &Runs,
    bandwidth: f64,
    device: &Device,
) {
    println!(
        "\n{} attention layer(s), each with its own weights and caches",
        layers.len()
    );
    println!(
        "\n| storage | sequences | cached positions (sum, longest) | way | tokens/s | ms per round | time / paged (per-round median) | bytes a round reads and writes | time / bound |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for &storage in runs.storages {
        for &count in runs.concurrency {
            cell(layers, sizes, runs, (storage, count), bandwidth, device);
        }
    }
}

/// The table's rows for `count` sequences in caches of `storage`.
fn cell(
    layers: &[MultiHeadAttention],
    sizes: &Sizes,
    runs: &Runs,
    (storage, count): (CacheStorage, usize),
    bandwidth: f64,
    device: &Device,
) {
    let lengths: Vec<usize> = (0..count).map(|i| LENGTHS[i % LENGTHS.len()]).collect();
    let longest = *lengths.iter().max().expect("a sequence");
    let stored: usize = lengths.iter().sum();
    // Every layer's weights and cached positions.
    let depth = layers.len();
    let position_bytes = depth * position_bytes(storage, sizes.kv_heads, sizes.head_dim);
    let weight_bytes = depth
        * 4
        * (2 * sizes.d_model * sizes.d_model + 2 * sizes.d_model * sizes.kv_heads * sizes.head_dim);
    // Every way reads the stored positions where they lie, in their storage (a padded batch's
    // padding skipped: the flash kernel and the in-place kernel start each row at its first
    // unpadded key).
    let cache_bytes = stored * position_bytes;
    let mut rounds: Vec<WayRounds> = runs
        .ways
        .iter()
        .map(|&way| match way {
            Way::Paged => WayRounds {
                way,
                round: paged_round(layers, (&lengths, storage), runs.rounds, sizes, device),
                bytes: cache_bytes + weight_bytes,
            },
            // The padded batch reads what the paged step reads, though it holds `count ·
            // longest` positions.
            Way::Padded => WayRounds {
                way,
                round: padded_round(layers, (&lengths, storage), sizes, device),
                bytes: cache_bytes + weight_bytes,
            },
            Way::Single => WayRounds {
                way,
                round: one_at_a_time_round(layers, (&lengths, storage), sizes, device),
                bytes: cache_bytes + count * weight_bytes,
            },
        })
        .collect();
    // times[round][way]
    let times: Vec<Vec<f64>> = (0..runs.rounds)
        .map(|_| {
            rounds
                .iter_mut()
                .map(|way| {
                    let started = Instant::now();
                    (way.round)();
                    started.elapsed().as_secs_f64()
                })
                .collect()
        })
        .collect();
    let paged = runs.ways.iter().position(|&way| way == Way::Paged);
    for (index, WayRounds { way, bytes, .. }) in rounds.iter().enumerate() {
        let seconds = median(times.iter().map(|round| round[index]).collect());
        let ratio = paged.map_or("-".to_string(), |paged| {
            let ratios = times.iter().map(|round| round[index] / round[paged]);
            format!("{:.2}", median(ratios.collect()))
        });
        println!(
            "| {storage:?} | {count} | {stored}, {longest} | {} | {:.0} | {:.2} | {ratio} | {:.1} MB | {:.1}x |",
            way.label(),
            count as f64 / seconds,
            seconds * 1e3,
            *bytes as f64 / 1e6,
            seconds / (*bytes as f64 / bandwidth)
        );
    }
}

/// One way of serving a cell: a round of it, and the bytes a round reads and writes.
struct WayRounds<'a> {
    way: Way,
    round: Box<dyn FnMut() + 'a>,
    bytes: usize,
}

/// The median of `values`.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn random(shape: [usize; 3], device: &Device) -> Tensor<3> {
    Tensor::random(shape, Distribution::Default, device)
}

/// A round of one paged step for every sequence in each layer (each layer's pool sized for
/// `rounds` of them).
fn paged_round<'a>(
    layers: &'a [MultiHeadAttention],
    (lengths, storage): (&[usize], CacheStorage),
    rounds: usize,
    sizes: &Sizes,
    device: &Device,
) -> Box<dyn FnMut() + 'a> {
    let block_size = sizes.block_size;
    let blocks: usize = lengths
        .iter()
        .map(|len| (len + rounds + 1).div_ceil(block_size))
        .sum();
    let mut caches: Vec<PagedKvCache> = layers
        .iter()
        .map(|_| {
            PagedKvCacheConfig::new(blocks)
                .with_block_size(block_size)
                .with_storage(storage)
                .init()
        })
        .collect();
    // Every layer's cache adds the sequences in the same order, so that their ids agree.
    let ids: Vec<SequenceId> = lengths.iter().map(|_| caches[0].add_sequence()).collect();
    for cache in &mut caches[1..] {
        let added: Vec<SequenceId> = lengths.iter().map(|_| cache.add_sequence()).collect();
        assert_eq!(added, ids, "fresh caches number their sequences alike");
    }
    for (module, cache) in layers.iter().zip(&mut caches) {
        for (&id, &len) in ids.iter().zip(lengths) {
            let prompt = random([1, len, sizes.d_model], device).reshape([len, sizes.d_model]);
            module
                .forward_paged(prompt, cache, &vec![id; len])
                .expect("the pool was sized for the run");
        }
    }
    let tokens = random([1, ids.len(), sizes.d_model], device).reshape([ids.len(), sizes.d_model]);
    Box::new(move || {
        let mut hidden = tokens.clone();
        for (module, cache) in layers.iter().zip(&mut caches) {
            hidden = module
                .forward_paged(hidden, cache, &ids)
                .expect("the pool was sized for the run");
        }
        hidden.into_data();
    })
}

/// A round of one step of a batch padded to the longest sequence, in each layer.
fn padded_round<'a>(
    layers: &'a [MultiHeadAttention],
    (lengths, storage): (&[usize], CacheStorage),
    sizes: &Sizes,
    device: &Device,
) -> Box<dyn FnMut() + 'a> {
    let (count, longest) = (lengths.len(), *lengths.iter().max().expect("a sequence"));
    // Each sequence's prompt at the end of the padded rows (left padding), so that every row's
    // next token follows its own prompt.
    let padding: Vec<bool> = lengths
        .iter()
        .flat_map(|&len| (0..longest).map(move |position| position < longest - len))
        .collect();
    let padding =
        Tensor::<1, Bool>::from_data(padding.as_slice(), device).reshape([count, longest]);
    let mut caches: Vec<KvCache> = layers
        .iter()
        .map(|module| {
            let mut cache = KvCache::new().with_storage(storage);
            let prompt = random([count, longest, sizes.d_model], device);
            module
                .forward_cached(
                    MhaInput::self_attn(prompt)
                        .causal()
                        .key_padding_mask(padding.clone()),
                    &mut cache,
                )
                .expect("an unbounded cache");
            cache
        })
        .collect();
    let tokens = random([count, 1, sizes.d_model], device);
    Box::new(move || {
        let mut hidden = tokens.clone();
        for (module, cache) in layers.iter().zip(&mut caches) {
            hidden = module
                .forward_cached(MhaInput::self_attn(hidden).causal(), cache)
                .expect("an unbounded cache")
                .context;
        }
        hidden.into_data();
    })
}

/// A round of one step per sequence through every layer, each sequence with its own cache in
/// each layer.
fn one_at_a_time_round<'a>(
    layers: &'a [MultiHeadAttention],
    (lengths, storage): (&[usize], CacheStorage),
    sizes: &Sizes,
    device: &Device,
) -> Box<dyn FnMut() + 'a> {
    // caches[sequence][layer]
    let mut caches: Vec<Vec<KvCache>> = lengths
        .iter()
        .map(|&len| {
            layers
                .iter()
                .map(|module| {
                    let mut cache = KvCache::new().with_storage(storage);
                    module
                        .forward_cached(
                            MhaInput::self_attn(random([1, len, sizes.d_model], device)).causal(),
                            &mut cache,
                        )
                        .expect("an unbounded cache");
                    cache
                })
                .collect()
        })
        .collect();
    let token = random([1, 1, sizes.d_model], device);
    Box::new(move || {
        for sequence in &mut caches {
            let mut hidden = token.clone();
            for (module, cache) in layers.iter().zip(sequence) {
                hidden = module
                    .forward_cached(MhaInput::self_attn(hidden).causal(), cache)
                    .expect("an unbounded cache")
                    .context;
            }
            hidden.into_data();
        }
    })
}
