//! A causal Transformer stack served through its paged cache (`PagedTransformerCache`): every
//! sequence of a ragged step gets what decoding it alone through the stack's own cache gives
//! it, in every storage; a step its pools cannot hold is refused and every layer keeps its state;
//! a stack without layers has no paged cache.

mod common;

use std::collections::BTreeMap;

use burn::tensor::Device;
use common::{assert_close, panic_message, randn, row_ids, storages};
use mha::transformer::{
    PagedTransformerCache, TransformerEncoder, TransformerEncoderCache, TransformerEncoderInput,
};
use mha::{CacheStorage, KvCache, PagedCacheError, PagedKvCacheConfig, SequenceId};

const D_MODEL: usize = 16;

#[test]
fn a_causal_transformer_stack_serves_each_sequence_as_decoding_it_alone() {
    for name in ["flex", "ndarray"] {
        let device = common::device_by_name(name).unwrap();
        stack_serves_each_sequence_as_decoding_it_alone(&device);
    }
}

fn stack_serves_each_sequence_as_decoding_it_alone(device: &Device) {
    let _seed = common::seed(device, 37);
    let stack = common::causal_stack(D_MODEL, device);
    for storage in storages(device) {
        let config = PagedKvCacheConfig::new(64)
            .with_block_size(4)
            .with_storage(storage);
        let mut harness = StackHarness::new(&stack, device, config);
        let (a, b) = (harness.add(), harness.add());
        let c = harness.add();
        harness.step(&[(a, 6), (b, 1)]);
        harness.step(&[(a, 1), (b, 1), (c, 5)]);
        harness.step(&[(c, 1), (a, 2), (b, 1)]);
        assert_eq!(harness.paged.len(a), Some(9));
        harness.paged.remove_sequence(b).unwrap();
        assert!(harness.paged.bytes_in_use() > 0);
    }
}

#[test]
fn a_stack_refuses_a_step_its_pools_cannot_hold_and_every_layer_keeps_its_state() {
    let device = Device::flex();
    let _seed = common::seed(&device, 40);
    let stack = common::causal_stack(D_MODEL, &device);
    for storage in [CacheStorage::Float, CacheStorage::Int8] {
        let config = PagedKvCacheConfig::new(4)
            .with_block_size(4)
            .with_storage(storage);
        let mut harness = StackHarness::new(&stack, &device, config);
        let (a, b) = (harness.add(), harness.add());
        harness.step(&[(a, 6), (b, 2)]);
        let ids = row_ids(&[(a, 1), (b, 7)]);
        let error = stack
            .forward_paged(randn([8, D_MODEL], &device), &mut harness.paged, &ids)
            .unwrap_err();
        assert_eq!(
            error,
            PagedCacheError::PoolFull {
                sequence: b,
                needed: 2,
                free: 1
            },
            "{storage:?}"
        );
        let paged = &harness.paged;
        assert_eq!((paged.len(a), paged.len(b)), (Some(6), Some(2)));
        assert_eq!(paged.free_blocks(), 1, "{storage:?}");
        // Both sequences go on, through every layer, as if the step had never been tried.
        harness.step(&[(a, 1), (b, 3)]);
        harness.paged.remove_sequence(a).unwrap();
        harness.step(&[(b, 8)]);
    }
}

/// A causal stack's paged cache and, per sequence, the stack's own cache that decodes it
/// alone: each step is checked against the reference, row by row.
struct StackHarness<'a> {
    stack: &'a TransformerEncoder,
    device: &'a Device,
    paged: PagedTransformerCache,
    alone: BTreeMap<SequenceId, TransformerEncoderCache>,
    storage: CacheStorage,
}

impl<'a> StackHarness<'a> {
    fn new(stack: &'a TransformerEncoder, device: &'a Device, config: PagedKvCacheConfig) -> Self {
        Self {
            stack,
            device,
            paged: stack.new_paged_cache(config),
            alone: BTreeMap::new(),
            storage: config.storage,
        }
    }

    fn add(&mut self) -> SequenceId {
        let id = self.paged.add_sequence();
        let mut cache = self.stack.new_cache();
        cache
            .layers
            .iter_mut()
            .for_each(|layer| *layer = KvCache::new().with_storage(self.storage));
        self.alone.insert(id, cache);
        id
    }

    /// One paged step of `rows` new tokens for each sequence through the stack, checked
    /// against each sequence decoded alone.
    fn step(&mut self, rows: &[(SequenceId, usize)]) {
        let total = rows.iter().map(|(_, n)| n).sum();
        let x = randn([total, D_MODEL], self.device);
        let ids = row_ids(rows);
        let output = self
            .stack
            .forward_paged(x.clone(), &mut self.paged, &ids)
            .unwrap();
        let mut start = 0;
        for &(id, n) in rows {
            let tokens = x.clone().narrow(0, start, n).reshape([1, n, D_MODEL]);
            let expected = self
                .stack
                .forward_cached(
                    TransformerEncoderInput::new(tokens),
                    self.alone.get_mut(&id).unwrap(),
                )
                .unwrap()
                .reshape([n, D_MODEL]);
            let label = format!(
                "stack {:?} {:?} {id} rows {start}..{}",
                self.device,
                self.storage,
                start + n
            );
            assert_close(&label, output.clone().narrow(0, start, n), expected, 1e-5);
            start += n;
        }
    }
}

#[test]
fn a_stack_without_layers_has_no_paged_cache() {
    use mha::transformer::TransformerEncoderConfig;
    let device = Device::flex();
    // Held while this test draws, so that its draws do not interleave with a seeded test's.
    let _seed = common::seed(&device, 81);
    let stack = TransformerEncoderConfig::new(D_MODEL, 32, 4, 0)
        .with_causal(true)
        .init(&device);
    let message = panic_message(|| stack.new_paged_cache(PagedKvCacheConfig::new(8)));
    assert!(message.contains("n_layers = 0"), "{message}");
}
