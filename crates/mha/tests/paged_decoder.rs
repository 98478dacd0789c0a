//! An encoder-decoder model's decoder served through its paged cache
//! (`PagedTransformerDecoderCache`): each sequence decodes over its own memory, of its own
//! length, and every sequence of a ragged step gets what decoding it alone through the
//! decoder's own cache (`TransformerDecoder::forward_cached`) gives it, in every storage and on
//! every test device, through joins, forks, cuts and departures; a step the pools cannot hold,
//! or that names a sequence the cache does not hold, is refused and changes nothing; bad
//! arguments panic naming them.

mod common;

use std::collections::BTreeMap;

use burn::tensor::{Device, Tensor};
use common::Rng;
use common::paged_schedule::schedule_seeds;
use common::{assert_close, panic_message, randn, row_ids, storages, test_devices};
use mha::transformer::{
    PagedTransformerDecoderCache, TransformerDecoder, TransformerDecoderCache,
    TransformerDecoderConfig, TransformerDecoderInput,
};
use mha::{CacheStorage, KvCache, PagedCacheError, PagedKvCacheConfig, SequenceId};

const D_MODEL: usize = 16;

/// A two-layer decoder of 4 query and 2 key/value heads, with RoPE in its self-attention
/// (positions each sequence's own), pre- or post-norm.
fn decoder(norm_first: bool, device: &Device) -> TransformerDecoder {
    TransformerDecoderConfig::new(D_MODEL, 32, 4, 2)
        .with_dropout(0.0)
        .with_norm_first(norm_first)
        .with_n_kv_heads(Some(2))
        .with_rope(Some(mha::RopeConfig::new()))
        .init(device)
}

/// The paged decoder beside each sequence decoded alone, with its memory, through
/// `forward_cached`: every paged step's rows are checked against the reference's.
struct DecoderHarness<'a> {
    decoder: &'a TransformerDecoder,
    device: &'a Device,
    paged: PagedTransformerDecoderCache,
    /// Each sequence's reference cache and memory (`[1, seq_memory, d_model]`).
    alone: BTreeMap<SequenceId, (TransformerDecoderCache, Tensor<3>)>,
    storage: CacheStorage,
}

impl<'a> DecoderHarness<'a> {
    fn new(
        decoder: &'a TransformerDecoder,
        device: &'a Device,
        config: PagedKvCacheConfig,
    ) -> Self {
        Self {
            decoder,
            device,
            paged: decoder.new_paged_cache(config),
            alone: BTreeMap::new(),
            storage: config.storage,
        }
    }

    /// A new sequence over a random memory of `memory_len` positions.
    fn add(&mut self, memory_len: usize) -> SequenceId {
        let memory = randn([memory_len, D_MODEL], self.device);
        let id = self
            .decoder
            .add_paged_sequence(&mut self.paged, memory.clone());
        assert_eq!(self.paged.memory_len(id), Some(memory_len));
        let mut cache = self.decoder.new_cache();
        for layer in &mut cache.self_attention {
            *layer = KvCache::new().with_storage(self.storage);
        }
        let memory = memory.reshape([1, memory_len, D_MODEL]);
        self.alone.insert(id, (cache, memory));
        id
    }

    /// A fork of `id` in the paged cache, and a clone of its reference.
    fn fork(&mut self, id: SequenceId) -> SequenceId {
        let forked = self.paged.fork(id).unwrap();
        let reference = self.alone[&id].clone();
        self.alone.insert(forked, reference);
        forked
    }

    /// Cuts `id` back to `len` target positions, and its reference.
    fn truncate(&mut self, id: SequenceId, len: usize) {
        self.paged.truncate(id, len).unwrap();
        let (cache, _) = self.alone.get_mut(&id).unwrap();
        cache.truncate(len).unwrap();
        assert_eq!(self.paged.len(id), Some(len));
    }

    fn remove(&mut self, id: SequenceId) {
        self.paged.remove_sequence(id).unwrap();
        self.alone.remove(&id);
    }

    /// One paged step of `rows` new target tokens for each sequence, checked against each
    /// sequence decoded alone.
    fn step(&mut self, rows: &[(SequenceId, usize)]) {
        let total = rows.iter().map(|(_, n)| n).sum();
        let target = randn([total, D_MODEL], self.device);
        let output = self
            .decoder
            .forward_paged(target.clone(), &mut self.paged, &row_ids(rows))
            .unwrap();
        let mut start = 0;
        for &(id, n) in rows {
            let (cache, memory) = self.alone.get_mut(&id).unwrap();
            let new = target.clone().narrow(0, start, n).reshape([1, n, D_MODEL]);
            let expected = self
                .decoder
                .forward_cached(TransformerDecoderInput::new(new, memory.clone()), cache)
                .unwrap();
            // A layer's attention gives its output to within f32 rounding of the reference's
            // (the paged and the cached kernels sum in other orders), and the next layer's
            // keys then differ by as much: in f16 and int8 a key feature within that of a
            // rounding boundary may round to its neighbour in one of the two caches. In int8 that
            // moved outputs by more than 1e-5 in 11 of 400 schedules (`MHA_RANDOM_SCHEDULES`),
            // by 2.3e-3 at most; by the size of one int8 step of a feature, up to about 1e-2
            // (an f16 step, by 1/16 of that). A wrong block or scale moves them by far more.
            let tolerance = match self.storage {
                CacheStorage::Float => 1e-5,
                CacheStorage::Half => 1e-3,
                CacheStorage::Int8 => 1e-2,
            };
            assert_close(
                &format!("{:?} {:?}: {id:?}'s rows", self.device, self.storage),
                output.clone().narrow(0, start, n),
                expected.reshape([n, D_MODEL]),
                tolerance,
            );
            assert_eq!(
                self.paged.len(id),
                Some(cache.self_attention[0].len()),
                "{id:?}'s length"
            );
            start += n;
        }
    }
}

#[test]
fn a_decoder_serves_each_sequence_over_its_own_memory_as_decoding_it_alone() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 53);
        for norm_first in [false, true] {
            let decoder = decoder(norm_first, &device);
            for storage in storages(&device) {
                let config = PagedKvCacheConfig::new(64)
                    .with_block_size(4)
                    .with_storage(storage);
                let mut harness = DecoderHarness::new(&decoder, &device, config);
                // Memories of three lengths; prompts prefilled beside other sequences' tokens.
                let (a, b) = (harness.add(7), harness.add(3));
                harness.step(&[(a, 5), (b, 1)]);
                let c = harness.add(11);
                harness.step(&[(a, 1), (b, 2), (c, 6)]);
                // A fork decodes over the same memory as its source, each its own way.
                let d = harness.fork(a);
                harness.step(&[(c, 1), (d, 2), (a, 1), (b, 1)]);
                harness.truncate(c, 4);
                harness.remove(b);
                harness.step(&[(d, 1), (c, 3), (a, 1)]);
                assert_eq!(
                    harness.paged.sequences().collect::<Vec<_>>(),
                    [a, c, d],
                    "{name}"
                );
                // Every block goes back with the last sequence, shared ones included.
                for id in [a, c, d] {
                    harness.remove(id);
                }
                assert!(harness.paged.is_empty(), "{name}");
                assert_eq!(harness.paged.self_attention().blocks_in_use(), 0, "{name}");
            }
        }
    }
}

#[test]
fn an_autodiff_device_serves_each_sequence_as_decoding_it_alone() {
    // Autodiff takes the gathered self-attention and one cross-attention after the other.
    let device = Device::flex().autodiff();
    let _seed = common::seed(&device, 57);
    let decoder = decoder(false, &device);
    let config = PagedKvCacheConfig::new(32).with_block_size(4);
    let mut harness = DecoderHarness::new(&decoder, &device, config);
    let (a, b) = (harness.add(6), harness.add(2));
    harness.step(&[(b, 3), (a, 5)]);
    harness.step(&[(a, 1), (b, 1)]);
    // Two decoding rows in a batched call beside a 33-row prompt attended alone, then two
    // short continuations batched beside a decoding row alone of its kind.
    let c = harness.add(9);
    harness.step(&[(a, 1), (c, 33), (b, 1)]);
    harness.step(&[(c, 1), (a, 2), (b, 3)]);
}

#[test]
fn random_schedules_of_joins_forks_cuts_and_departures_serve_each_sequence_as_alone() {
    let device = Device::flex();
    let _seed = common::seed(&device, 56);
    let decoder = decoder(true, &device);
    for (schedule, storage) in [CacheStorage::Float, CacheStorage::Int8]
        .into_iter()
        .enumerate()
    {
        // Joins, forks, cuts and departures done, so that the schedules are seen to hold each.
        let mut done = [0; 4];
        for seed in schedule_seeds(0x5eed + schedule as u64) {
            println!("{storage:?}: schedule seed {seed}");
            random_schedule((&decoder, &device), storage, seed, &mut done);
        }
        assert!(
            done.iter().all(|&count| count > 0),
            "{storage:?}: joins, forks, cuts, departures: {done:?}"
        );
    }
}

/// One random schedule of 40 operations from `seed`, each followed by a ragged step, counting
/// the joins, forks, cuts and departures in `done`.
fn random_schedule(
    (decoder, device): (&TransformerDecoder, &Device),
    storage: CacheStorage,
    seed: u64,
    done: &mut [usize; 4],
) {
    let mut rng = Rng(seed);
    let config = PagedKvCacheConfig::new(256)
        .with_block_size(4)
        .with_storage(storage);
    let mut harness = DecoderHarness::new(decoder, device, config);
    let mut live: Vec<SequenceId> = Vec::new();
    for _ in 0..40 {
        match rng.below(10) {
            0 | 1 if live.len() < 6 => {
                live.push(harness.add(1 + rng.below(12)));
                done[0] += 1;
            }
            2 if !live.is_empty() => {
                let source = rng.pick(&live);
                if harness.paged.len(source) > Some(0) {
                    live.push(harness.fork(source));
                    done[1] += 1;
                }
            }
            3 if !live.is_empty() => {
                let id = rng.pick(&live);
                let len = harness.paged.len(id).unwrap();
                if len > 1 {
                    harness.truncate(id, 1 + rng.below(len - 1));
                    done[2] += 1;
                }
            }
            4 if live.len() > 1 => {
                let id = live.remove(rng.below(live.len()));
                harness.remove(id);
                done[3] += 1;
            }
            _ => {}
        }
        if live.is_empty() {
            continue;
        }
        // A ragged step: each live sequence, in a shuffled order, with 0-5 rows (a prompt
        // chunk) or one (a decoding token); at least one row in all.
        let mut order = live.clone();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i + 1));
        }
        let mut rows: Vec<(SequenceId, usize)> = order
            .into_iter()
            .map(|id| (id, if rng.chance(0.3) { rng.below(6) } else { 1 }))
            .filter(|&(_, n)| n > 0)
            .collect();
        if rows.is_empty() {
            rows.push((live[0], 1));
        }
        harness.step(&rows);
    }
    assert!(
        harness.paged.sequences().eq(live.iter().copied()),
        "{storage:?}: the cache holds the sequences alive"
    );
}

#[test]
fn a_refused_step_changes_no_sequence_and_decoding_goes_on() {
    let device = Device::flex();
    let _seed = common::seed(&device, 54);
    let decoder = decoder(true, &device);
    let config = PagedKvCacheConfig::new(4).with_block_size(4);
    let mut harness = DecoderHarness::new(&decoder, &device, config);
    let (a, b) = (harness.add(5), harness.add(2));
    harness.step(&[(a, 6), (b, 2)]);
    let blocks = |harness: &DecoderHarness| {
        let pools = harness.paged.self_attention();
        (pools.free_blocks(), pools.blocks_in_use())
    };
    let before = blocks(&harness);
    // Seven more rows of `b` need two blocks; one is free.
    let error = decoder
        .forward_paged(
            randn([8, D_MODEL], &device),
            &mut harness.paged,
            &row_ids(&[(a, 1), (b, 7)]),
        )
        .unwrap_err();
    assert_eq!(
        error,
        PagedCacheError::PoolFull {
            sequence: b,
            needed: 2,
            free: 1
        }
    );
    // A sequence the cache no longer holds: refused before any layer stores the step.
    let removed = harness.add(3);
    harness.remove(removed);
    let error = decoder
        .forward_paged(
            randn([2, D_MODEL], &device),
            &mut harness.paged,
            &[a, removed],
        )
        .unwrap_err();
    assert_eq!(error, PagedCacheError::UnknownSequence(removed));
    assert_eq!(blocks(&harness), before);
    assert_eq!(
        (harness.paged.len(a), harness.paged.len(b)),
        (Some(6), Some(2))
    );
    // Both go on as if the steps had never been tried.
    harness.step(&[(a, 1), (b, 1)]);
    harness.remove(a);
    harness.step(&[(b, 8)]);
}

#[test]
fn bad_arguments_panic_naming_them() {
    let device = Device::flex();
    let _seed = common::seed(&device, 55);
    let stack = decoder(false, &device);
    let mut cache = stack.new_paged_cache(PagedKvCacheConfig::new(8));
    let message =
        panic_message(|| stack.add_paged_sequence(&mut cache, randn([3, D_MODEL + 1], &device)));
    assert!(
        message.contains("`memory` must have shape [seq_memory, d_model = 16]"),
        "{message}"
    );
    let one_layer = TransformerDecoderConfig::new(D_MODEL, 32, 4, 1).init(&device);
    let message =
        panic_message(|| one_layer.add_paged_sequence(&mut cache, randn([3, D_MODEL], &device)));
    assert!(
        message.contains("`cache` has 2 layers, the stack 1"),
        "{message}"
    );
    let id = stack.add_paged_sequence(&mut cache, randn([3, D_MODEL], &device));
    let not_causal = decoder(false, &device).with_causal(false);
    let message =
        panic_message(|| not_causal.forward_paged(randn([1, D_MODEL], &device), &mut cache, &[id]));
    assert!(
        message.contains("decoding needs causal self-attention"),
        "{message}"
    );
    // A sequence whose memory another decoder projected: refused before any layer stores the
    // step.
    let other = decoder(false, &device);
    let len_before = cache.len(id);
    let message =
        panic_message(|| other.forward_paged(randn([1, D_MODEL], &device), &mut cache, &[id]));
    assert!(
        message.contains("TransformerDecoder::forward_paged")
            && message.contains("projected by another decoder"),
        "{message}"
    );
    assert_eq!(cache.len(id), len_before);
    let message = panic_message(|| {
        TransformerDecoderConfig::new(D_MODEL, 32, 4, 0)
            .init(&device)
            .new_paged_cache(PagedKvCacheConfig::new(8))
    });
    assert!(message.contains("the stack has no layers"), "{message}");
}
