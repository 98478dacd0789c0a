//! The Transformer layers (`mha::transformer`) and the conversion from burn-nn: a converted
//! burn-nn attention, encoder and decoder give burn-nn's outputs on the same inputs, through
//! every path, on every device; cached decoding through a whole stack equals its full forward.

mod common;

use burn::module::Param;
use burn::nn::LayerNorm;
use burn::nn::attention::{
    MhaInput as BurnMhaInput, MultiHeadAttentionConfig as BurnMhaConfig,
    generate_autoregressive_mask,
};
use burn::nn::transformer::{
    TransformerDecoderConfig as BurnDecoderConfig, TransformerDecoderInput as BurnDecoderInput,
    TransformerEncoderConfig as BurnEncoderConfig, TransformerEncoderInput as BurnEncoderInput,
};
use burn::tensor::{Bool, Device, Tensor, TensorData};
use common::{assert_close, randn, test_devices, tolerance};
use mha::transformer::{
    TransformerDecoder, TransformerDecoderConfig, TransformerDecoderInput, TransformerEncoder,
    TransformerEncoderConfig, TransformerEncoderInput,
};
use mha::{KvCache, MhaInput, MultiHeadAttention, RopeConfig};

/// `[batch, seq]` padding: the second sequence's last `padded` positions.
fn padding(batch: usize, seq: usize, padded: usize, device: &Device) -> Tensor<2, Bool> {
    let values: Vec<bool> = (0..batch * seq)
        .map(|i| i / seq == 1 && i % seq >= seq - padded)
        .collect();
    Tensor::from_data(TensorData::new(values, [batch, seq]), device)
}

/// A layer norm with random scales and shifts (a fresh one is the identity map, which would
/// hide a norm put in another's place).
fn randomized(norm: &mut LayerNorm) {
    let device = norm.gamma.device();
    let width = norm.gamma.dims()[0];
    norm.gamma = Param::from_tensor(randn([width], &device).mul_scalar(0.3).add_scalar(1.0));
    norm.beta = Some(Param::from_tensor(randn([width], &device).mul_scalar(0.3)));
}

#[test]
fn a_converted_burn_nn_attention_gives_burn_nns_outputs() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 51);
        for quiet_softmax in [false, true] {
            let theirs = BurnMhaConfig::new(16, 4)
                .with_dropout(0.0)
                .with_quiet_softmax(quiet_softmax)
                .init(&device);
            let ours = MultiHeadAttention::from(theirs.clone());
            let (query, memory) = (randn([2, 5, 16], &device), randn([2, 7, 16], &device));
            let pad = padding(2, 7, 3, &device);
            let expected = theirs
                .forward(
                    BurnMhaInput::new(query.clone(), memory.clone(), memory.clone())
                        .mask_pad(pad.clone()),
                )
                .context;
            let paths = if quiet_softmax {
                vec![mha::AttentionPath::Explicit, mha::AttentionPath::Auto]
            } else {
                common::paths(&device)
            };
            for path in paths {
                let actual = ours
                    .forward(
                        MhaInput::new(query.clone(), memory.clone(), memory.clone())
                            .key_padding_mask(pad.clone())
                            .path(path),
                    )
                    .context;
                assert_close(
                    &format!("{name} quiet {quiet_softmax} {path:?}"),
                    actual,
                    expected.clone(),
                    tolerance(name),
                );
            }
        }
    }
}

#[test]
fn a_converted_burn_nn_encoder_gives_burn_nns_outputs_pre_and_post_norm() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 52);
        for norm_first in [false, true] {
            let mut theirs = BurnEncoderConfig::new(16, 24, 4, 2)
                .with_dropout(0.0)
                .with_norm_first(norm_first)
                .init(&device);
            for layer in &mut theirs.layers {
                randomized(&mut layer.norm_1);
                randomized(&mut layer.norm_2);
            }
            let x = randn([2, 6, 16], &device);
            let pad = padding(2, 6, 2, &device);
            let expected = theirs.forward(
                BurnEncoderInput::new(x.clone())
                    .mask_pad(pad.clone())
                    .mask_attn(generate_autoregressive_mask(2, 6, &device)),
            );
            let ours = TransformerEncoder::from(theirs.clone());
            let with_mask = ours.forward(
                TransformerEncoderInput::new(x.clone())
                    .mask_pad(pad.clone())
                    .mask_attn(generate_autoregressive_mask(2, 6, &device)),
            );
            let causal = ours
                .with_causal(true)
                .forward(TransformerEncoderInput::new(x).mask_pad(pad));
            for (how, actual) in [("mask", with_mask), ("causal flag", causal)] {
                assert_close(
                    &format!("{name} norm_first {norm_first}: {how}"),
                    actual,
                    expected.clone(),
                    tolerance(name),
                );
            }
        }
    }
}

#[test]
fn a_converted_burn_nn_decoder_gives_burn_nns_outputs_pre_and_post_norm() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 53);
        for norm_first in [false, true] {
            let mut theirs = BurnDecoderConfig::new(16, 24, 4, 2)
                .with_dropout(0.0)
                .with_norm_first(norm_first)
                .init(&device);
            for layer in &mut theirs.layers {
                randomized(&mut layer.norm_1);
                randomized(&mut layer.norm_2);
                randomized(&mut layer.norm_3);
            }
            let (target, memory) = (randn([2, 5, 16], &device), randn([2, 7, 16], &device));
            let memory_pad = padding(2, 7, 3, &device);
            let expected = theirs.forward(
                BurnDecoderInput::new(target.clone(), memory.clone())
                    .target_mask_attn(generate_autoregressive_mask(2, 5, &device))
                    .memory_mask_pad(memory_pad.clone()),
            );
            let ours = TransformerDecoder::from(theirs.clone());
            let actual = ours
                .forward(TransformerDecoderInput::new(target, memory).memory_mask_pad(memory_pad));
            assert_close(
                &format!("{name} norm_first {norm_first}"),
                actual,
                expected,
                tolerance(name),
            );
        }
    }
}

/// `x` fed in steps of `chunks` positions through `step`, the outputs concatenated.
fn in_steps(
    x: &Tensor<3>,
    chunks: &[usize],
    mut step: impl FnMut(Tensor<3>) -> Tensor<3>,
) -> Tensor<3> {
    let mut start = 0;
    let outputs = chunks
        .iter()
        .map(|&length| {
            let output = step(x.clone().narrow(1, start, length));
            start += length;
            output
        })
        .collect();
    Tensor::cat(outputs, 1)
}

#[test]
fn cached_decoding_through_a_stack_equals_its_full_forward() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 54);
        for norm_first in [true, false] {
            let encoder = TransformerEncoderConfig::new(16, 32, 4, 2)
                .with_dropout(0.0)
                .with_norm_first(norm_first)
                .with_n_kv_heads(Some(2))
                .with_rope(Some(RopeConfig::new()))
                .with_window(Some(4))
                .with_causal(true)
                .init(&device);
            let x = randn([2, 8, 16], &device);
            let full = encoder.forward(TransformerEncoderInput::new(x.clone()));
            let mut cache = encoder.new_cache();
            let decoded = in_steps(&x, &[3, 1, 4], |step| {
                encoder
                    .forward_cached(TransformerEncoderInput::new(step), &mut cache)
                    .unwrap()
            });
            assert_close(
                &format!("{name} encoder norm_first {norm_first}"),
                decoded,
                full,
                tolerance(name),
            );
            // The layers' window of 4: their caches keep the 3 positions the next query sees.
            assert!(
                cache.layers.iter().all(|layer| layer.stored() == 3),
                "{name}: the windowed layers' caches hold {:?}",
                cache.layers.iter().map(KvCache::stored).collect::<Vec<_>>()
            );

            let decoder = TransformerDecoderConfig::new(16, 32, 4, 2)
                .with_dropout(0.0)
                .with_norm_first(norm_first)
                .with_n_kv_heads(Some(1))
                .with_alibi(true)
                .init(&device);
            let memory = randn([2, 5, 16], &device);
            let memory_pad = padding(2, 5, 2, &device);
            let input = |target: Tensor<3>| {
                TransformerDecoderInput::new(target, memory.clone())
                    .memory_mask_pad(memory_pad.clone())
            };
            let full = decoder.forward(input(x.clone()));
            let mut cache = decoder.new_cache();
            let decoded = in_steps(&x, &[1, 5, 2], |step| {
                decoder.forward_cached(input(step), &mut cache).unwrap()
            });
            assert_close(
                &format!("{name} decoder norm_first {norm_first}"),
                decoded,
                full,
                tolerance(name),
            );
        }
    }
}

/// A causal encoder stack (GQA, RoPE) and a decoder stack (ALiBi), two layers of d_model 16.
fn small_stacks(device: &Device) -> (TransformerEncoder, TransformerDecoder) {
    let encoder = TransformerEncoderConfig::new(16, 32, 4, 2)
        .with_dropout(0.0)
        .with_n_kv_heads(Some(2))
        .with_rope(Some(RopeConfig::new()))
        .with_causal(true)
        .init(device);
    let decoder = TransformerDecoderConfig::new(16, 32, 4, 2)
        .with_dropout(0.0)
        .with_alibi(true)
        .init(device);
    (encoder, decoder)
}

/// Draft tokens rejected through a whole stack: each layer's cache cut back
/// (`TransformerEncoderCache::truncate`, `TransformerDecoderCache::truncate`) decodes the next
/// tokens as the caches that were only fed the accepted ones; a cut that one layer's window
/// refuses changes no layer.
#[test]
fn a_cut_stack_cache_decodes_as_if_only_its_first_positions_had_been_fed() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 56);
        let (encoder, decoder) = small_stacks(&device);
        let (prompt, accepted) = (randn([2, 5, 16], &device), randn([2, 2, 16], &device));
        let (rejected, next) = (randn([2, 3, 16], &device), randn([2, 2, 16], &device));
        let drafted = Tensor::cat(vec![accepted.clone(), rejected], 1);
        let memory = randn([2, 4, 16], &device);

        let encode = |x: &Tensor<3>, cache: &mut _| {
            encoder
                .forward_cached(TransformerEncoderInput::new(x.clone()), cache)
                .unwrap()
        };
        let (mut reference, mut cut) = (encoder.new_cache(), encoder.new_cache());
        encode(&prompt, &mut reference);
        encode(&accepted, &mut reference);
        encode(&prompt, &mut cut);
        encode(&drafted, &mut cut);
        cut.truncate(7).unwrap();
        assert!(cut.layers.iter().all(|layer| layer.len() == 7), "{name}");
        assert_close(
            &format!("{name} encoder"),
            encode(&next, &mut cut),
            encode(&next, &mut reference),
            tolerance(name),
        );

        let decode = |x: &Tensor<3>, cache: &mut _| {
            decoder
                .forward_cached(
                    TransformerDecoderInput::new(x.clone(), memory.clone()),
                    cache,
                )
                .unwrap()
        };
        let (mut reference, mut cut) = (decoder.new_cache(), decoder.new_cache());
        decode(&prompt, &mut reference);
        decode(&accepted, &mut reference);
        decode(&prompt, &mut cut);
        decode(&drafted, &mut cut);
        cut.truncate(7).unwrap();
        assert_close(
            &format!("{name} decoder"),
            decode(&next, &mut cut),
            decode(&next, &mut reference),
            tolerance(name),
        );

        // The second layer's cache keeps a window of 4: it evicted what a cut to 6 needs.
        let mut cache = encoder.new_cache();
        cache.layers[1] = KvCache::with_limit(mha::CacheLimit::SlidingWindow(4));
        encode(&prompt, &mut cache);
        encode(&accepted, &mut cache);
        assert_eq!(
            cache.truncate(6),
            Err(mha::CacheError::Evicted {
                len: 6,
                sees_from: 3,
                held_from: 4
            }),
            "{name}"
        );
        assert!(
            cache.layers.iter().all(|layer| layer.len() == 7),
            "{name}: a refused cut changed a layer"
        );
    }
}

/// Beams through whole stacks: every layer's cache (and the decoder's projected memory) keeps
/// the chosen batch elements, reordered and repeated, and the next steps equal the stacks'
/// caches fed the chosen rows from the start.
#[test]
fn stack_caches_of_chosen_batch_elements_continue_each_chosen_sequence() {
    let chosen = [1usize, 1, 0];
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 57);
        let rows = Tensor::<1, burn::tensor::Int>::from_data(
            TensorData::new(chosen.map(|row| row as i64).to_vec(), [chosen.len()]),
            &device,
        );
        let chosen_rows = |x: &Tensor<3>| x.clone().select(0, rows.clone());
        let (encoder, decoder) = small_stacks(&device);
        let (prompt, next) = (randn([2, 4, 16], &device), randn([3, 2, 16], &device));
        let memory = randn([2, 5, 16], &device);
        let memory_pad = padding(2, 5, 2, &device);

        let encode = |x: Tensor<3>, cache: &mut _| {
            encoder
                .forward_cached(TransformerEncoderInput::new(x), cache)
                .unwrap()
        };
        let (mut selected, mut reference) = (encoder.new_cache(), encoder.new_cache());
        encode(prompt.clone(), &mut selected);
        selected.select_batch(&chosen);
        encode(chosen_rows(&prompt), &mut reference);
        assert_close(
            &format!("{name} encoder"),
            encode(next.clone(), &mut selected),
            encode(next.clone(), &mut reference),
            tolerance(name),
        );

        let decode = |x: Tensor<3>, memory: &Tensor<3>, pad: &Tensor<2, Bool>, cache: &mut _| {
            decoder
                .forward_cached(
                    TransformerDecoderInput::new(x, memory.clone()).memory_mask_pad(pad.clone()),
                    cache,
                )
                .unwrap()
        };
        let (mut selected, mut reference) = (decoder.new_cache(), decoder.new_cache());
        decode(prompt.clone(), &memory, &memory_pad, &mut selected);
        selected.select_batch(&chosen);
        let (memory_kept, pad_kept) = (
            chosen_rows(&memory),
            Tensor::cat(
                chosen
                    .iter()
                    .map(|&row| memory_pad.clone().narrow(0, row, 1))
                    .collect(),
                0,
            ),
        );
        decode(
            chosen_rows(&prompt),
            &memory_kept,
            &pad_kept,
            &mut reference,
        );
        // The selected cache's step gets the memory of two sequences: the projected memory it
        // kept is what it attends to.
        assert_close(
            &format!("{name} decoder"),
            decode(next.clone(), &memory, &memory_pad, &mut selected),
            decode(next.clone(), &memory_kept, &pad_kept, &mut reference),
            tolerance(name),
        );
    }
}

/// Training through the layers reaches every parameter: attention (the flash path under
/// `Auto` on CPU), feed-forward and norms.
#[test]
fn every_parameter_of_a_stack_gets_a_gradient() {
    let device = Device::flex().autodiff();
    let _seed = common::seed(&device, 55);
    let decoder = TransformerDecoderConfig::new(16, 32, 4, 1)
        .with_n_kv_heads(Some(2))
        .init(&device);
    let target = randn([2, 5, 16], &device);
    let memory = randn([2, 3, 16], &device).require_grad();
    let output = decoder.forward(TransformerDecoderInput::new(target, memory.clone()));
    let grads = output.powi_scalar(2).mean().backward();
    assert!(memory.grad(&grads).is_some());
    let layer = &decoder.layers[0];
    let weights = [
        ("self W_q", &layer.self_attention.query.weight),
        ("self W_o", &layer.self_attention.output.weight),
        ("cross W_k", &layer.cross_attention.key.weight),
        ("cross W_v", &layer.cross_attention.value.weight),
        ("ff inner", &layer.feed_forward.linear_inner.weight),
        ("ff outer", &layer.feed_forward.linear_outer.weight),
    ];
    for (what, weight) in weights {
        let grad = weight
            .grad(&grads)
            .unwrap_or_else(|| panic!("{what}: no gradient"));
        assert!(
            grad.abs().sum().into_scalar::<f32>() > 0.0,
            "{what}: zero gradient"
        );
    }
    for (what, norm) in [
        ("self norm", &layer.self_attention_norm),
        ("cross norm", &layer.cross_attention_norm),
        ("ff norm", &layer.feed_forward_norm),
    ] {
        assert!(norm.gamma.grad(&grads).is_some(), "{what}: no gradient");
    }
}

#[test]
fn decoding_a_stack_that_is_not_causal_is_refused_clearly() {
    let device = Device::flex();
    // Held while this test draws, so that its draws do not interleave with a seeded test's.
    let _seed = common::seed(&device, 79);
    let encoder = TransformerEncoderConfig::new(8, 16, 2, 1).init(&device);
    let x = randn([1, 3, 8], &device);
    let message = common::panic_message(|| {
        let mut cache = encoder.new_cache();
        encoder.forward_cached(TransformerEncoderInput::new(x.clone()), &mut cache)
    });
    assert!(
        message.contains("decoding needs a causal stack"),
        "{message}"
    );
    let decoder = TransformerDecoderConfig::new(8, 16, 2, 1).init(&device);
    let message = common::panic_message(|| {
        let mut cache = decoder.new_cache();
        decoder.forward_cached(
            TransformerDecoderInput::new(x.clone(), x.clone())
                .memory_mask_attn(Tensor::<2, Bool>::zeros([3, 3], &device)),
            &mut cache,
        )
    });
    assert!(
        message.contains("`memory_mask_attn` is not taken"),
        "{message}"
    );
}
