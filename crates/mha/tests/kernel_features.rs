//! The kernel features — sliding window, soft cap, attention sinks, packed segments, ALiBi —
//! against PyTorch (`nn.MultiheadAttention`'s weights around attention in plain f64 tensor
//! math, with torch.autograd's gradients; fixtures `pytorch/feature_*.json` from
//! `tests/fixtures/generate_pytorch_fixtures.py --only features`), through every path, on
//! every test device; and the properties that define them: a packed batch equals its documents
//! run one by one, a window of `seq` or more changes nothing.

mod common;

use burn::tensor::{Device, Int, Tensor};
use common::{Fixture, assert_close, randn, test_devices, tolerance};
use mha::{AttentionPath, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};

const CASES: [&str; 8] = [
    "feature_window_causal",
    "feature_window_cross",
    "feature_softcap",
    "feature_sinks",
    "feature_segments",
    "feature_segments_cross",
    "feature_alibi",
    "feature_everything",
];

/// The fixture's input on `device`; `query` (and the memory of a cross-attention) as given.
fn input(fixture: &Fixture, query: Tensor<3>, memory: Option<Tensor<3>>) -> MhaInput {
    let device = query.device();
    let mut input = match memory {
        Some(memory) => MhaInput::new(query, memory.clone(), memory),
        None => MhaInput::self_attn(query),
    };
    if let Some(mask) = fixture.bool_input::<2>("key_padding_mask", &device) {
        input = input.key_padding_mask(mask);
    }
    let ids = |key: &str| -> Option<Tensor<2, Int>> {
        fixture
            .input::<2>(key, &device)
            .map(|ids| ids.round().int())
    };
    if let (Some(query_ids), Some(key_ids)) = (ids("segment_ids_query"), ids("segment_ids_key")) {
        input = if fixture.arg_bool("self_attention") {
            input.segment_ids(query_ids)
        } else {
            input.segment_ids_cross(query_ids, key_ids)
        };
    }
    if fixture.arg_bool("causal") {
        input = input.causal();
    }
    input
}

/// The paths that run `module`, with blocks small enough that several (and a short last one)
/// are taken; the fused path only where it has no sink to add.
fn paths(module: &MultiHeadAttention, device: &Device, training: bool) -> Vec<AttentionPath> {
    common::paths(device)
        .into_iter()
        .filter(|path| *path != AttentionPath::Fused || (module.sinks.is_none() && !training))
        .collect()
}

// Longer than most: every fixture through every path, outputs and each gradient.
#[test]
fn features_match_pytorch_in_outputs_and_every_gradient() {
    for (device_name, device) in test_devices() {
        let bound = tolerance(device_name);
        for case in CASES {
            let fixture = Fixture::load(case);
            let what = |part: &str| format!("{case} on {device_name}: {part}");
            let expected = fixture.output::<3>("attn_output", &device);
            let query = fixture.input::<3>("query", &device).unwrap();
            let memory = (!fixture.arg_bool("self_attention"))
                .then(|| fixture.input::<3>("key", &device).unwrap());

            let module = fixture.module(&device);
            for path in paths(&module, &device, false) {
                let context = module
                    .forward(input(&fixture, query.clone(), memory.clone()).path(path))
                    .context;
                assert_close(
                    &what(&format!("output ({path:?})")),
                    context,
                    expected.clone(),
                    bound,
                );
            }

            let training = device.clone().autodiff();
            let module = fixture.module(&training);
            let upstream = fixture.input::<3>("upstream", &training).unwrap();
            for path in paths(&module, &training, true) {
                let query = fixture
                    .input::<3>("query", &training)
                    .unwrap()
                    .require_grad();
                let memory = memory
                    .is_some()
                    .then(|| fixture.input::<3>("key", &training).unwrap().require_grad());
                let context = module
                    .forward(input(&fixture, query.clone(), memory.clone()).path(path))
                    .context;
                let grads = (context * upstream.clone()).sum().backward();
                let label = |part: &str| what(&format!("{part} ({path:?})"));
                let expect = |key: &str| fixture.output::<2>(key, &device);
                let weight_grad =
                    |linear: &burn::nn::Linear| linear.weight.grad(&grads).unwrap().transpose();
                assert_close(
                    &label("d query"),
                    query.grad(&grads).unwrap(),
                    fixture.output::<3>("grad_query", &device),
                    10.0 * bound,
                );
                if let Some(memory) = &memory {
                    assert_close(
                        &label("d memory"),
                        memory.grad(&grads).unwrap(),
                        fixture.output::<3>("grad_memory", &device),
                        10.0 * bound,
                    );
                }
                let in_proj = Tensor::cat(
                    vec![
                        weight_grad(&module.query),
                        weight_grad(&module.key),
                        weight_grad(&module.value),
                    ],
                    0,
                );
                assert_close(
                    &label("d in_proj_weight"),
                    in_proj,
                    expect("grad_in_proj_weight"),
                    10.0 * bound,
                );
                assert_close(
                    &label("d out_proj.weight"),
                    weight_grad(&module.output),
                    expect("grad_out_proj.weight"),
                    10.0 * bound,
                );
                if let Some(sinks) = &module.sinks {
                    assert_close(
                        &label("d sinks"),
                        sinks.grad(&grads).unwrap(),
                        fixture.output::<1>("grad_sinks", &device),
                        10.0 * bound,
                    );
                }
            }
        }
    }
}

/// Several documents packed into one row with segment ids give, row for row, what each
/// document gives alone — causal, with a window, on every path, output and input gradient.
#[test]
fn a_packed_row_equals_its_documents_run_alone() {
    let lengths = [5, 1, 7, 3];
    let total: usize = lengths.iter().sum();
    for (device_name, device) in test_devices() {
        let device = device.autodiff();
        let _seed = common::seed(&device, 41);
        let module = MultiHeadAttentionConfig::new(8, 4)
            .with_n_kv_heads(Some(2))
            .with_window(Some(4))
            .with_attention_sinks(true)
            .init(&device);
        let packed = randn([1, total, 8], &device);
        let ids: Vec<i64> = lengths
            .iter()
            .enumerate()
            .flat_map(|(id, &length)| std::iter::repeat_n(id as i64, length))
            .collect();
        let ids = Tensor::<1, Int>::from_ints(ids.as_slice(), &device).reshape([1, total]);
        for path in paths(&module, &device, true) {
            let x = packed.clone().detach().require_grad();
            let context = module
                .forward(
                    MhaInput::self_attn(x.clone())
                        .segment_ids(ids.clone())
                        .causal()
                        .path(path),
                )
                .context;
            let grads = context.clone().sum().backward();
            let d_packed = x.grad(&grads).unwrap();
            let mut start = 0;
            for &length in &lengths {
                let alone = packed
                    .clone()
                    .narrow(1, start, length)
                    .detach()
                    .require_grad();
                let expected = module
                    .forward(MhaInput::self_attn(alone.clone()).causal().path(path))
                    .context;
                let alone_grads = expected.clone().sum().backward();
                let label = format!("{device_name} {path:?} document at {start}");
                assert_close(
                    &format!("{label}: output"),
                    context.clone().narrow(1, start, length).inner(),
                    expected.inner(),
                    tolerance(device_name),
                );
                assert_close(
                    &format!("{label}: d input"),
                    d_packed.clone().narrow(1, start, length),
                    alone.grad(&alone_grads).unwrap(),
                    10.0 * tolerance(device_name),
                );
                start += length;
            }
        }
    }
}

/// A window as long as the sequence hides nothing, and a window of 1 with causal masking
/// leaves each query its own key alone.
#[test]
fn window_edges_mean_what_they_say() {
    for (device_name, device) in test_devices() {
        let _seed = common::seed(&device, 42);
        let plain = MultiHeadAttentionConfig::new(8, 2).init(&device);
        let x = randn([2, 6, 8], &device);
        for path in common::paths(&device) {
            let unwindowed = plain.forward(MhaInput::self_attn(x.clone()).causal().path(path));
            let windowed = |window| {
                common::with_projections_of(
                    MultiHeadAttentionConfig::new(8, 2)
                        .with_window(Some(window))
                        .init(&device),
                    &plain,
                )
            };
            let (wide, narrow) = (windowed(6), windowed(1));
            let windowed = wide.forward(MhaInput::self_attn(x.clone()).causal().path(path));
            assert_close(
                &format!("{device_name} {path:?}: window 6 over 6 tokens"),
                windowed.context,
                unwindowed.context,
                tolerance(device_name),
            );
            // Each query sees only its own key: the output is its own value, projected.
            let own = narrow.forward(MhaInput::self_attn(x.clone()).causal().path(path));
            let values = plain.value.forward(x.clone());
            assert_close(
                &format!("{device_name} {path:?}: window 1"),
                own.context,
                plain.output.forward(values),
                tolerance(device_name),
            );
        }
    }
}
