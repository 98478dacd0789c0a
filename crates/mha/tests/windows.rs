//! Sliding and streaming windows, through plain forwards and `KvCache`'s window limits (f32, and
//! int8 for the buffers' bounds): the same answers as the matching mask, and buffers that stay
//! bounded however long the sequence.

mod common;

use burn::tensor::{Bool, Device, Tensor, TensorData};
use common::{assert_close, decode, randn, test_devices, tolerance};
use mha::{
    CacheError, CacheLimit, CacheStorage, KvCache, MhaInput, MultiHeadAttentionConfig, RopeConfig,
};

/// `true` where key `k` is outside query `q`'s causal window of `window` positions.
fn band_mask(seq: usize, window: usize, device: &Device) -> Tensor<2, Bool> {
    let values: Vec<bool> = (0..seq)
        .flat_map(|q| (0..seq).map(move |k| k > q || k + window <= q))
        .collect();
    Tensor::from_data(TensorData::new(values, [seq, seq]), device)
}

#[test]
fn sliding_window_cache_equals_banded_attention_and_evicts() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 13);
        let module = MultiHeadAttentionConfig::new(8, 2)
            .with_rope(Some(RopeConfig::new()))
            .init(&device);
        let x = randn([1, 72, 8], &device);
        // A window of 1 keeps nothing between steps (it panicked concatenating no positions).
        for window in [4, 1] {
            let full = module
                .forward(MhaInput::self_attn(x.clone()).attn_mask(band_mask(72, window, &device)))
                .context;
            // The evicted positions left in the buffer pass 64 (when the cache moves what it
            // keeps to the front) in one step, and over several.
            for chunks in [
                [vec![1; 10], vec![62]].concat(),
                vec![3, 1, 4, 2, 30, 20, 10, 1, 1],
            ] {
                let mut cache = KvCache::with_limit(CacheLimit::SlidingWindow(window));
                let decoded = decode(&module, &x, &chunks, &mut cache);
                assert!(
                    cache.stored() < window,
                    "{name}: evicted down to window - 1"
                );
                assert_eq!(cache.len(), 72);
                assert_close(
                    &format!("{name}: sliding window {window} {chunks:?}"),
                    decoded,
                    full.clone(),
                    tolerance(name),
                );
            }
        }
    }
}

/// A window of 1 keeps no position between steps, and still refuses a batch size change (it
/// read the batch from the stored keys, and had none to read).
#[test]
fn a_window_of_one_stores_nothing_and_still_refuses_a_batch_change() {
    let device = Device::flex();
    // Held while this test draws, so that its draws do not interleave with a seeded test's.
    let _seed = common::seed(&device, 75);
    let module = MultiHeadAttentionConfig::new(8, 2).init(&device);
    for limit in [
        CacheLimit::SlidingWindow(1),
        CacheLimit::StreamingWindow {
            sinks: 0,
            window: 1,
        },
    ] {
        let mut cache = KvCache::with_limit(limit);
        module
            .forward_cached(
                MhaInput::self_attn(randn([2, 3, 8], &device)).causal(),
                &mut cache,
            )
            .unwrap();
        assert_eq!((cache.len(), cache.stored(), cache.bytes()), (3, 0, 0));
        let other_batch =
            module.forward_cached(MhaInput::self_attn(randn([3, 1, 8], &device)), &mut cache);
        assert_eq!(
            other_batch.unwrap_err(),
            CacheError::BatchChanged { cached: 2, new: 3 },
            "{limit:?}"
        );
    }
}

/// `true` where key `k` is hidden from query `q` by a causal window of `window` positions that
/// keeps the first `sinks` positions visible (StreamingLLM).
fn streaming_mask(seq: usize, sinks: usize, window: usize, device: &Device) -> Tensor<2, Bool> {
    let values: Vec<bool> = (0..seq)
        .flat_map(|q| (0..seq).map(move |k| k > q || (k >= sinks && k + window <= q)))
        .collect();
    Tensor::from_data(TensorData::new(values, [seq, seq]), device)
}

/// A streaming cache keeps its sink positions for good and a window behind each query, at the
/// positions they were first seen (RoPE, ALiBi): decoding in any steps equals one forward with
/// the matching mask, and the cache never holds more than `sinks + window - 1` positions.
#[test]
fn streaming_window_cache_keeps_its_sinks_and_equals_the_masked_forward() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 19);
        let (sinks, window, seq) = (2, 3, 80);
        for (label, config) in [
            (
                "gqa+rope",
                MultiHeadAttentionConfig::new(16, 4)
                    .with_n_kv_heads(Some(2))
                    .with_rope(Some(RopeConfig::new())),
            ),
            (
                "alibi",
                MultiHeadAttentionConfig::new(16, 4).with_alibi(true),
            ),
        ] {
            let module = config.init(&device);
            let x = randn([2, seq, 16], &device);
            let full = module
                .forward(
                    MhaInput::self_attn(x.clone())
                        .attn_mask(streaming_mask(seq, sinks, window, &device)),
                )
                .context;
            // The positions evicted between the sinks and the window pass 64 (when the cache
            // moves what it keeps together) in one step, and over several.
            for chunks in [
                [vec![1; 12], vec![68]].concat(),
                vec![3, 1, 4, 2, 2, 30, 30, 8],
                vec![1, 5, 6, 68],
            ] {
                let mut cache = KvCache::with_limit(CacheLimit::StreamingWindow { sinks, window });
                let decoded = decode(&module, &x, &chunks, &mut cache);
                assert!(
                    cache.stored() < sinks + window,
                    "{name} {label}: {} stored",
                    cache.stored()
                );
                assert_eq!(cache.len(), seq);
                assert_close(
                    &format!("{name} {label}: streaming {chunks:?}"),
                    decoded,
                    full.clone(),
                    tolerance(name),
                );
            }
        }
    }
}

/// The config's `window` holds in plain forwards and under any cache, with padding: the same
/// answers as the banded mask on a module without it.
#[test]
fn config_window_equals_the_banded_mask_plain_and_cached() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 21);
        let windowed = MultiHeadAttentionConfig::new(16, 4)
            .with_n_kv_heads(Some(2))
            .with_rope(Some(RopeConfig::new()))
            .with_window(Some(3))
            .init(&device);
        let plain = common::with_projections_of(
            MultiHeadAttentionConfig::new(16, 4)
                .with_n_kv_heads(Some(2))
                .with_rope(Some(RopeConfig::new()))
                .init(&device),
            &windowed,
        );
        let x = randn([2, 9, 16], &device);
        let padding = Tensor::<2, Bool>::from_data(
            TensorData::new(
                (0..18).map(|i| i == 4 || i == 17).collect::<Vec<_>>(),
                [2, 9],
            ),
            &device,
        );
        let expected = plain
            .forward(
                MhaInput::self_attn(x.clone())
                    .key_padding_mask(padding.clone())
                    .attn_mask(band_mask(9, 3, &device)),
            )
            .context;
        for path in common::paths(&device) {
            let actual = windowed
                .forward(
                    MhaInput::self_attn(x.clone())
                        .key_padding_mask(padding.clone())
                        .causal()
                        .path(path),
                )
                .context;
            assert_close(
                &format!("{name} {path:?}: window 3"),
                actual,
                expected.clone(),
                tolerance(name),
            );
        }
        let mut cache = KvCache::new();
        let mut outputs = Vec::new();
        for (start, length) in [(0, 4), (4, 1), (5, 4)] {
            let step = MhaInput::self_attn(x.clone().narrow(1, start, length))
                .key_padding_mask(padding.clone().narrow(1, start, length))
                .causal();
            outputs.push(windowed.forward_cached(step, &mut cache).unwrap().context);
        }
        assert_close(
            &format!("{name}: window 3 under an unbounded cache"),
            Tensor::cat(outputs, 1),
            expected,
            tolerance(name),
        );
    }
}

/// A window's cache leaves the positions it evicts in its buffer until there are 64, then
/// moves what it keeps together: however long the sequence, its buffers hold the window (and
/// its sinks), 64 evicted positions and room for 64 more (in tiles of 64 for int8 on flex).
#[test]
fn a_window_cache_holds_a_bounded_buffer_however_long_the_sequence() {
    let device = Device::flex();
    // Held while this test draws, so that its draws do not interleave with a seeded test's.
    let _seed = common::seed(&device, 76);
    let module = MultiHeadAttentionConfig::new(16, 4)
        .with_n_kv_heads(Some(2))
        .init(&device);
    let window = 8;
    for ((storage, per_position), sinks) in [
        (CacheStorage::Float, 2 * 2 * 4 * 4),
        (CacheStorage::Int8, 2 * 2 * (4 + 4)),
    ]
    .into_iter()
    .flat_map(|storage| [(storage, 0), (storage, 2)])
    {
        let limit = match sinks {
            0 => CacheLimit::SlidingWindow(window),
            _ => CacheLimit::StreamingWindow { sinks, window },
        };
        let mut cache = KvCache::with_limit(limit).with_storage(storage);
        let mut most = 0;
        for _ in 0..300 {
            module
                .forward_cached(
                    MhaInput::self_attn(randn([1, 1, 16], &device)).causal(),
                    &mut cache,
                )
                .expect("a window evicts");
            most = most.max(cache.bytes() / per_position);
        }
        assert_eq!((cache.len(), cache.stored()), (300, sinks + window - 1));
        assert!(
            most <= (sinks + window + 2 * 64).next_multiple_of(64),
            "{storage:?}: {most} positions held for a window of {window} and {sinks} sinks"
        );
    }
}

/// Masks over every position fed (`[batch, len + new]` padding, `[new, len + new]` attention
/// masks), as Hugging Face's models pass them, hold under windows that evicted positions: the
/// same answers as one forward with the window's mask, the padding and the attention mask.
#[test]
fn masks_over_every_position_fed_hold_after_a_window_evicts() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 23);
        let module = MultiHeadAttentionConfig::new(16, 4)
            .with_n_kv_heads(Some(2))
            .with_rope(Some(RopeConfig::new()))
            .init(&device);
        let seq = 12;
        let x = randn([2, seq, 16], &device);
        // Sequence 0 pads position 1 (a sink) and 6, sequence 1 position 8.
        let padded = |b: usize, k: usize| (b == 0 && (k == 1 || k == 6)) || (b == 1 && k == 8);
        let padding_values: Vec<bool> = (0..2)
            .flat_map(|b| (0..seq).map(move |k| padded(b, k)))
            .collect();
        let padding =
            Tensor::<2, Bool>::from_data(TensorData::new(padding_values, [2, seq]), &device);
        // Every third query may not see the key just before it.
        let hidden = |q: usize, k: usize| q.is_multiple_of(3) && k + 1 == q;
        for (sinks, window) in [(0, 4), (2, 3)] {
            let limit = if sinks == 0 {
                CacheLimit::SlidingWindow(window)
            } else {
                CacheLimit::StreamingWindow { sinks, window }
            };
            let mask_values: Vec<bool> = (0..seq)
                .flat_map(|q| {
                    (0..seq).map(move |k| k > q || (k >= sinks && k + window <= q) || hidden(q, k))
                })
                .collect();
            let full = module
                .forward(
                    MhaInput::self_attn(x.clone())
                        .attn_mask(Tensor::<2, Bool>::from_data(
                            TensorData::new(mask_values, [seq, seq]),
                            &device,
                        ))
                        .key_padding_mask(padding.clone()),
                )
                .context;
            let attn_values: Vec<bool> = (0..seq)
                .flat_map(|q| (0..seq).map(move |k| hidden(q, k)))
                .collect();
            let attn =
                Tensor::<2, Bool>::from_data(TensorData::new(attn_values, [seq, seq]), &device);
            let mut cache = KvCache::with_limit(limit);
            let mut outputs = Vec::new();
            let mut start = 0;
            for len in [3, 1, 2, 1, 1, 4] {
                let fed = start + len;
                let step = MhaInput::self_attn(x.clone().narrow(1, start, len))
                    .causal()
                    .key_padding_mask(padding.clone().narrow(1, 0, fed))
                    .attn_mask(attn.clone().narrow(0, start, len).narrow(1, 0, fed));
                outputs.push(module.forward_cached(step, &mut cache).unwrap().context);
                start = fed;
            }
            assert!(cache.stored() < cache.len());
            assert_close(
                &format!("{name}: {limit:?}"),
                Tensor::cat(outputs, 1),
                full,
                tolerance(name),
            );
        }
    }
}

/// A window's cache is cut back ([`KvCache::truncate`]) while it holds every position its next
/// query sees: before a sliding window has evicted, or to a streaming window's sinks; past
/// that a cut is refused, naming the positions, and the cache goes on unchanged.
#[test]
fn a_window_cache_is_cut_back_only_to_positions_it_still_holds() {
    let device = Device::flex();
    let _seed = common::seed(&device, 31);
    let module = MultiHeadAttentionConfig::new(8, 2)
        .with_rope(Some(RopeConfig::new()))
        .init(&device);
    let x = randn([1, 12, 8], &device);
    let other = randn([1, 4, 8], &device);
    let step = |x: Tensor<3>, cache: &mut KvCache| {
        module
            .forward_cached(MhaInput::self_attn(x).causal(), cache)
            .unwrap()
            .context
    };
    let limits = [
        CacheLimit::SlidingWindow(4),
        CacheLimit::StreamingWindow {
            sinks: 2,
            window: 4,
        },
    ];
    for limit in limits {
        // Three positions: a window of 4 has evicted none, and a cut to 2 goes on as a cache
        // fed 2.
        let mut cut = KvCache::with_limit(limit);
        step(x.clone().narrow(1, 0, 2), &mut cut);
        step(other.clone().narrow(1, 0, 1), &mut cut);
        cut.truncate(2).unwrap();
        let mut reference = KvCache::with_limit(limit);
        step(x.clone().narrow(1, 0, 2), &mut reference);
        assert_close(
            &format!("{limit:?} cut before evicting"),
            decode(&module, &x.clone().narrow(1, 2, 7), &[1, 3, 2, 1], &mut cut),
            decode(
                &module,
                &x.clone().narrow(1, 2, 7),
                &[1, 3, 2, 1],
                &mut reference,
            ),
            1e-5,
        );
        // Nine positions: the window evicted up to 6 (after the sinks), which the query at 8
        // sees from 5.
        assert_eq!(
            cut.truncate(8),
            Err(CacheError::Evicted {
                len: 8,
                sees_from: 5,
                held_from: 6
            }),
            "{limit:?}"
        );
        assert_eq!(
            (cut.len(), cut.stored()),
            reference_sizes(&reference),
            "{limit:?}"
        );
        assert_close(
            &format!("{limit:?} after a refused cut"),
            step(x.clone().narrow(1, 9, 3), &mut cut),
            step(x.clone().narrow(1, 9, 3), &mut reference),
            1e-5,
        );
    }
    // A window of 1 holds nothing: a cut only moves the next position (which its outputs, each
    // query attending to itself alone, do not show).
    let mut cut = KvCache::with_limit(CacheLimit::SlidingWindow(1));
    decode(&module, &x, &[2, 1], &mut cut);
    cut.truncate(1).unwrap();
    assert_eq!((cut.len(), cut.stored()), (1, 0));
    // The sinks are held for good: a streaming cache is cut back to them however long it is,
    // and not one position past them.
    let limit = CacheLimit::StreamingWindow {
        sinks: 2,
        window: 4,
    };
    let mut cut = KvCache::with_limit(limit);
    decode(&module, &x, &[5, 7], &mut cut);
    assert_eq!(
        cut.truncate(3),
        Err(CacheError::Evicted {
            len: 3,
            sees_from: 2,
            held_from: 9
        })
    );
    cut.truncate(2).unwrap();
    assert_eq!((cut.len(), cut.stored()), (2, 2));
    let mut reference = KvCache::with_limit(limit);
    step(x.clone().narrow(1, 0, 2), &mut reference);
    assert_close(
        "streaming cut to its sinks",
        step(other.clone(), &mut cut),
        step(other, &mut reference),
        1e-5,
    );
}

/// A cache's length and positions held.
fn reference_sizes(cache: &KvCache) -> (usize, usize) {
    (cache.len(), cache.stored())
}
