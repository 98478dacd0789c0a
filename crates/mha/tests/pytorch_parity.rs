//! `MultiHeadAttention` against `torch.nn.MultiheadAttention(batch_first=True)`, on every test
//! device, through every attention path. Fixtures: `tests/fixtures/generate_pytorch_fixtures.py`.

mod common;

use common::{Fixture, assert_close, test_devices, tolerance};
use mha::{MhaInput, NeedWeights};

const CASES: [&str; 13] = [
    "self_basic",
    "cross_kdim_vdim",
    "cross_same_width",
    "no_bias",
    "add_bias_kv",
    "add_zero_attn",
    "bias_kv_zero_attn_padding",
    "key_padding",
    "causal",
    "causal_padding",
    "float_mask",
    "bool_mask_per_head",
    "single_head_wide",
];

fn input(fixture: &Fixture, device: &burn::tensor::Device) -> MhaInput {
    let query = fixture.input::<3>("query", device).unwrap();
    let mut input = if fixture.arg_bool("self_attention") {
        MhaInput::self_attn(query)
    } else {
        MhaInput::new(
            query,
            fixture.input::<3>("key", device).unwrap(),
            fixture.input::<3>("value", device).unwrap(),
        )
    };
    if let Some(mask) = fixture.bool_input::<2>("key_padding_mask", device) {
        input = input.key_padding_mask(mask);
    }
    if let Some(mask) = fixture.input::<2>("attn_mask_float", device) {
        input = input.attn_mask(mask);
    }
    if let Some(mask) = fixture.bool_input::<4>("attn_mask_bool", device) {
        input = input.attn_mask(mask);
    }
    if fixture.arg_bool("causal") {
        input = input.causal();
    }
    input
}

#[test]
fn outputs_and_weights_match_pytorch() {
    for (device_name, device) in test_devices() {
        let bound = tolerance(device_name);
        for case in CASES {
            let fixture = Fixture::load(case);
            let module = fixture.module(&device);
            let expected_output = fixture.output::<3>("attn_output", &device);
            let what = |part: &str| format!("{case} on {device_name}: {part}");

            let per_head =
                module.forward(input(&fixture, &device).need_weights(NeedWeights::PerHead));
            assert_close(
                &what("output (explicit path)"),
                per_head.context,
                expected_output.clone(),
                bound,
            );
            let weights = per_head.weights.unwrap().per_head().unwrap();
            assert_close(
                &what("per-head weights"),
                weights,
                fixture.output::<4>("attn_weights_per_head", &device),
                bound,
            );

            let averaged =
                module.forward(input(&fixture, &device).need_weights(NeedWeights::Averaged));
            assert_close(
                &what("averaged weights"),
                averaged.weights.unwrap().averaged(),
                fixture.output::<3>("attn_weights_averaged", &device),
                bound,
            );

            // Every other path, `Auto` (what a caller gets by default) among them.
            for path in common::paths(&device) {
                let output = module.forward(input(&fixture, &device).path(path));
                assert!(output.weights.is_none());
                assert_close(
                    &what(&format!("output ({path:?})")),
                    output.context,
                    expected_output.clone(),
                    bound,
                );
            }
        }
    }
}
