//! f16 storage of the KV caches (`CacheStorage::Half`): within f16's rounding of f32 storage
//! at half the bytes, keys and values beyond f16's range refused rather than stored as
//! infinities, and backends without f16 tensors refused by name.

mod common;

use burn::tensor::{DType, Device, Tensor};
use common::{max_abs_diff, randn, test_devices};
use mha::{
    CacheError, CacheStorage, KvCache, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig,
    PagedCacheError, PagedKvCacheConfig, RopeConfig,
};

const D_MODEL: usize = 32;

fn module(device: &Device) -> MultiHeadAttention {
    MultiHeadAttentionConfig::new(D_MODEL, 4)
        .with_n_kv_heads(Some(2))
        .with_rope(Some(RopeConfig::new()))
        .init(device)
}

/// A prompt of 32 tokens, then 8 decoding steps: each step's output, `[tokens, d_model]`. Both
/// caches then hold 64 positions: the f32 one doubles 32 to 64, the f16 one on the CPU backends
/// holds a whole tile of 64 from the first step.
fn decode(module: &MultiHeadAttention, cache: &mut KvCache, tokens: &Tensor<2>) -> Tensor<2> {
    let device = tokens.device();
    let mut outputs = Vec::new();
    let mut start = 0;
    for length in std::iter::once(32).chain([1; 8]) {
        let step = tokens.clone().narrow(0, start, length);
        let input = MhaInput::self_attn(step.reshape([1, length, D_MODEL])).causal();
        let output = module.forward_cached(input, cache).unwrap().context;
        outputs.push(output.reshape([length, D_MODEL]));
        start += length;
    }
    assert_eq!(outputs[0].device(), device);
    Tensor::cat(outputs, 0)
}

#[test]
fn a_half_cache_decodes_within_f16_rounding_of_a_float_one_in_half_the_bytes() {
    for (name, device) in test_devices() {
        if !device.supports_dtype(DType::F16) {
            continue;
        }
        let _seed = common::seed(&device, 51);
        let module = module(&device);
        let tokens = randn([40, D_MODEL], &device);
        let mut float = KvCache::new();
        let mut half = KvCache::new().with_storage(CacheStorage::Half);
        let (expected, actual) = (
            decode(&module, &mut float, &tokens),
            decode(&module, &mut half, &tokens),
        );
        // Keys and values rounded to 11 significant bits (a relative 2^-11 each); the outputs
        // are within a few times that of the f32 cache's, not equal to them.
        let difference = max_abs_diff(expected, actual);
        assert!(difference < 5e-3, "{name}: {difference}");
        assert!(difference > 0.0, "{name}: the half cache rounds nothing");
        assert_eq!(half.len(), float.len());
        assert_eq!(2 * half.bytes(), float.bytes(), "{name}");
    }
}

#[test]
fn keys_beyond_f16_range_are_refused_by_both_caches_which_keep_what_they_held() {
    let device = Device::flex();
    let _seed = common::seed(&device, 52);
    let module = module(&device);
    let small = randn([3, D_MODEL], &device);
    // Projections of inputs a million times larger: keys and values far beyond 65504.
    let huge = randn([1, D_MODEL], &device) * 1e6;

    let mut cache = KvCache::new().with_storage(CacheStorage::Half);
    let input = |x: Tensor<2>, n| MhaInput::self_attn(x.reshape([1, n, D_MODEL])).causal();
    module.forward_cached(input(small, 3), &mut cache).unwrap();
    let error = module
        .forward_cached(input(huge.clone(), 1), &mut cache)
        .unwrap_err();
    assert!(
        matches!(error, CacheError::BeyondHalfRange { largest } if largest > 65504.0),
        "{error}"
    );
    assert!(error.to_string().contains("CacheStorage::Float"), "{error}");
    assert_eq!(cache.len(), 3);

    let mut paged = PagedKvCacheConfig::new(8)
        .with_storage(CacheStorage::Half)
        .init();
    let id = paged.add_sequence();
    let error = module.forward_paged(huge, &mut paged, &[id]).unwrap_err();
    assert!(
        matches!(error, PagedCacheError::BeyondHalfRange { largest } if largest > 65504.0),
        "{error}"
    );
    assert_eq!((paged.len(id), paged.blocks_in_use()), (Some(0), 0));
}

#[test]
fn a_backend_without_f16_tensors_refuses_a_half_cache_by_name() {
    let device = common::device_by_name("ndarray").unwrap();
    // Held while this test draws, so that its draws do not interleave with a seeded test's.
    let _seed = common::seed(&device, 80);
    let module = module(&device);
    let mut cache = KvCache::new().with_storage(CacheStorage::Half);
    let input = MhaInput::self_attn(randn([1, 2, D_MODEL], &device)).causal();
    let error = module.forward_cached(input, &mut cache).unwrap_err();
    assert!(
        matches!(&error, CacheError::Storage { reason } if reason.contains("f16")),
        "{error}"
    );
    assert!(cache.is_empty());
}

#[test]
fn an_infinite_row_does_not_hide_another_rows_key_beyond_f16_range() {
    let device = Device::flex();
    let _seed = common::seed(&device, 53);
    let module = module(&device);
    let mut paged = PagedKvCacheConfig::new(8)
        .with_storage(CacheStorage::Half)
        .init();
    let (a, b) = (paged.add_sequence(), paged.add_sequence());
    // `a`'s row infinite (stored as it is, as in f32), `b`'s finite but far beyond 65504.
    let rows = Tensor::cat(
        vec![
            Tensor::<2>::full([1, D_MODEL], f32::INFINITY, &device),
            randn([1, D_MODEL], &device) * 1e6,
        ],
        0,
    );
    let error = module.forward_paged(rows, &mut paged, &[a, b]).unwrap_err();
    assert!(
        matches!(error, PagedCacheError::BeyondHalfRange { largest } if largest.is_finite() && largest > 65504.0),
        "{error}"
    );
    assert_eq!(paged.blocks_in_use(), 0);
}

#[test]
fn a_stack_refused_by_a_later_layer_takes_the_step_back_in_every_layer() {
    use mha::transformer::TransformerEncoderInput;
    let device = Device::flex();
    let _seed = common::seed(&device, 54);
    let normal = common::causal_stack(D_MODEL, &device);
    let stack = common::overflowing_in_its_second_layer(&normal);
    let config = PagedKvCacheConfig::new(16)
        .with_block_size(4)
        .with_storage(CacheStorage::Half);
    // `b` shares `a`'s partial block holding one position fewer: in the refused step `a` copies
    // it and `b` writes in place over `a`'s position 5 (in the first layer).
    let prompt = randn([6, D_MODEL], &device);
    let history = |paged: &mut mha::transformer::PagedTransformerCache| {
        let a = paged.add_sequence();
        normal
            .forward_paged(prompt.clone(), paged, &[a; 6])
            .unwrap();
        let b = paged.fork_prefix(a, 5).unwrap();
        (a, b)
    };
    let mut paged = normal.new_paged_cache(config);
    let (a, b) = history(&mut paged);
    let mut untouched = normal.new_paged_cache(config);
    history(&mut untouched);

    let error = stack
        .forward_paged(randn([3, D_MODEL], &device), &mut paged, &[a, b, b])
        .unwrap_err();
    assert!(
        matches!(error, PagedCacheError::BeyondHalfRange { .. }),
        "{error}"
    );
    assert_eq!((paged.len(a), paged.len(b)), (Some(6), Some(5)));
    for (layer, expected) in paged.layers().iter().zip(untouched.layers()) {
        assert_eq!(layer.blocks_in_use(), expected.blocks_in_use());
        assert_eq!(layer.free_blocks(), expected.free_blocks());
    }
    // Both sequences go on as if the refused step had never been tried.
    let next = randn([2, D_MODEL], &device);
    let output = normal
        .forward_paged(next.clone(), &mut paged, &[a, b])
        .unwrap();
    let expected = normal.forward_paged(next, &mut untouched, &[a, b]).unwrap();
    assert_eq!(max_abs_diff(output, expected), 0.0);

    let mut cache = normal.new_cache();
    cache
        .layers
        .iter_mut()
        .for_each(|layer| *layer = KvCache::new().with_storage(CacheStorage::Half));
    let input = TransformerEncoderInput::new(randn([1, 3, D_MODEL], &device));
    let error = stack.forward_cached(input, &mut cache).unwrap_err();
    assert!(
        matches!(error, CacheError::BeyondHalfRange { .. }),
        "{error}"
    );
    assert!(cache.layers.iter().all(KvCache::is_empty));
    assert!(
        cache
            .layers
            .iter()
            .all(|layer| layer.storage() == CacheStorage::Half)
    );
}

#[test]
fn kv_cache_stacks_refused_by_a_later_layer_take_the_step_back_in_every_layer() {
    use mha::CacheLimit;
    use mha::transformer::{
        TransformerDecoderConfig, TransformerDecoderInput, TransformerEncoderInput,
    };
    let device = Device::flex();
    let _seed = common::seed(&device, 55);
    let normal = common::causal_stack(D_MODEL, &device);
    let overflowing = common::overflowing_in_its_second_layer(&normal);
    let tokens = randn([1, 9, D_MODEL], &device);
    let step = |start, len| TransformerEncoderInput::new(tokens.clone().narrow(1, start, len));
    // Appended in place (taken back by its length), and two windows that evict in the refused
    // step (taken back to their tensors before it).
    for limit in [
        CacheLimit::Unbounded,
        CacheLimit::SlidingWindow(4),
        CacheLimit::StreamingWindow {
            sinks: 1,
            window: 4,
        },
    ] {
        let fresh = || {
            let mut cache = normal.new_cache();
            for layer in &mut cache.layers {
                *layer = KvCache::with_limit(limit).with_storage(CacheStorage::Half);
            }
            cache
        };
        let (mut cache, mut untouched) = (fresh(), fresh());
        normal.forward_cached(step(0, 5), &mut cache).unwrap();
        normal.forward_cached(step(0, 5), &mut untouched).unwrap();
        let error = overflowing
            .forward_cached(step(5, 2), &mut cache)
            .unwrap_err();
        assert!(
            matches!(error, CacheError::BeyondHalfRange { .. }),
            "{limit:?}: {error}"
        );
        for (layer, expected) in cache.layers.iter().zip(&untouched.layers) {
            assert_eq!(
                (layer.len(), layer.stored()),
                (expected.len(), expected.stored()),
                "{limit:?}"
            );
        }
        let output = normal.forward_cached(step(7, 2), &mut cache).unwrap();
        let expected = normal.forward_cached(step(7, 2), &mut untouched).unwrap();
        assert_eq!(max_abs_diff(output, expected), 0.0, "{limit:?}");
    }

    let decoder = TransformerDecoderConfig::new(D_MODEL, 32, 4, 2)
        .with_dropout(0.0)
        .with_norm_first(true)
        .init(&device);
    let mut overflowing = decoder.clone();
    let norm = &mut overflowing.layers[1].self_attention_norm;
    norm.gamma = norm.gamma.clone().map(|gamma| gamma * 1e6);
    let memory = randn([1, 3, D_MODEL], &device);
    let input = |start, len| {
        TransformerDecoderInput::new(tokens.clone().narrow(1, start, len), memory.clone())
    };
    let fresh = || {
        let mut cache = decoder.new_cache();
        for layer in &mut cache.self_attention {
            *layer = KvCache::new().with_storage(CacheStorage::Half);
        }
        cache
    };
    let (mut cache, mut untouched) = (fresh(), fresh());
    let error = overflowing
        .forward_cached(input(0, 2), &mut cache)
        .unwrap_err();
    assert!(
        matches!(error, CacheError::BeyondHalfRange { .. }),
        "{error}"
    );
    assert!(cache.self_attention.iter().all(KvCache::is_empty));
    for cache in [&mut cache, &mut untouched] {
        decoder.forward_cached(input(0, 5), cache).unwrap();
    }
    overflowing
        .forward_cached(input(5, 2), &mut cache)
        .unwrap_err();
    assert!(cache.self_attention.iter().all(|layer| layer.len() == 5));
    let output = decoder.forward_cached(input(7, 2), &mut cache).unwrap();
    let expected = decoder.forward_cached(input(7, 2), &mut untouched).unwrap();
    assert_eq!(max_abs_diff(output, expected), 0.0);
}
