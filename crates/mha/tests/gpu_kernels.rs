//! The flash op's CubeCL kernels on wgpu (lavapipe where there is no GPU) against the explicit
//! path on the same device, through the module: every mask, rule and score feature the kernels
//! apply, GQA, causal with more queries than keys and fewer, odd head widths, sequences spanning
//! several tiles, and half precision.
//!
//! The module's projections are identities (and have no bias), so that the kernels' inputs are
//! the test's inputs exactly and the input gradients are the kernels' gradients: these are the
//! op's own comparisons, on the public API. Which calls the kernels take and which go to the
//! generic body (sinks, segments) is the unit test beside the kernels (`flash/cube/tests.rs`).

mod common;

use burn::module::Param;
use burn::tensor::{Bool, Device, FloatDType, Int, Tensor, TensorData};
use mha::{
    AttentionPath, BlockSizes, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig,
    flash_attention_supported,
};

use common::{randn, test_devices};

/// The wgpu test device, if the run has one (`MHA_TEST_DEVICES`, `MHA_REQUIRE_WGPU`: see
/// `common/devices.rs`).
fn wgpu_device() -> Option<Device> {
    let device = test_devices()
        .into_iter()
        .find_map(|(name, device)| (name == "wgpu").then_some(device));
    if device.is_none() {
        eprintln!("*** SKIPPING the GPU kernels' tests: no wgpu device in this run ***");
    }
    device
}

/// The sizes of one comparison.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    batch: usize,
    n_heads: usize,
    n_kv_heads: usize,
    seq_q: usize,
    seq_k: usize,
    head_dim: usize,
}

impl Sizes {
    fn grouped(seq_q: usize, seq_k: usize) -> Self {
        Self {
            batch: 2,
            n_heads: 4,
            n_kv_heads: 2,
            seq_q,
            seq_k,
            head_dim: 5,
        }
    }

    fn kv_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// What a case sets beyond the sizes: configuration and input.
#[derive(Clone, Default)]
struct Features {
    window: Option<usize>,
    alibi: bool,
    softcap: Option<f64>,
    sinks: bool,
}

/// One case: its label, its features and how it builds its input from q, k, v.
struct Case {
    label: &'static str,
    features: Features,
    input: Box<dyn Fn([Tensor<3>; 3]) -> MhaInput>,
}

/// The cases every kernel test runs: each mask, rule and score feature, alone and combined.
/// The float bias is rounded to `exact_in` (and back) where given, so that it is exact in that
/// type.
// Longer than most: a table, one case per entry; it grows by an entry per feature.
fn cases(device: &Device, sizes: Sizes, exact_in: Option<FloatDType>) -> Vec<Case> {
    let Sizes {
        batch,
        n_heads,
        seq_q,
        seq_k,
        ..
    } = sizes;
    // The second sequence's last two keys padded; a fully masked query row on top.
    let mut padding = vec![false; batch * seq_k];
    padding[2 * seq_k - 2..].fill(true);
    let padding = Tensor::<2, Bool>::from_data(TensorData::new(padding, [batch, seq_k]), device);
    let mut row = vec![false; seq_q * seq_k];
    row[seq_k..2 * seq_k].fill(true);
    let dead_row = Tensor::<2, Bool>::from_data(TensorData::new(row, [seq_q, seq_k]), device);
    let bias = randn([batch, n_heads, seq_q, seq_k], device);
    let bias = match exact_in {
        Some(dtype) => bias.cast(dtype).cast(FloatDType::F32),
        None => bias,
    };
    // Two documents per row, split at a different place in each batch element.
    let split = |len: usize, b: usize| (0..len).map(move |i| i64::from(i >= len / 2 + b));
    let ids = |len: usize| {
        let ids: Vec<i64> = (0..batch).flat_map(|b| split(len, b)).collect();
        Tensor::<2, Int>::from_data(TensorData::new(ids, [batch, len]), device)
    };
    let (query_ids, key_ids) = (ids(seq_q), ids(seq_k));
    let case = |label, features, input: Box<dyn Fn([Tensor<3>; 3]) -> MhaInput>| Case {
        label,
        features,
        input,
    };
    let plain = |[q, k, v]: [Tensor<3>; 3]| MhaInput::new(q, k, v);
    let segments = {
        let (query_ids, key_ids) = (query_ids.clone(), key_ids.clone());
        move |heads| plain(heads).segment_ids_cross(query_ids.clone(), key_ids.clone())
    };
    let with_dead_row = {
        let dead_row = dead_row.clone();
        move |heads| plain(heads).causal().attn_mask(dead_row.clone())
    };
    vec![
        case("none", Features::default(), Box::new(plain)),
        case(
            "causal",
            Features::default(),
            Box::new(move |heads| plain(heads).causal()),
        ),
        case(
            "padding + dead row + causal",
            Features::default(),
            Box::new(move |heads| with_dead_row(heads).key_padding_mask(padding.clone())),
        ),
        case(
            "float bias",
            Features::default(),
            Box::new(move |heads| plain(heads).attn_mask(bias.clone())),
        ),
        case(
            "window 3, causal, ALiBi",
            Features {
                window: Some(3),
                alibi: true,
                ..Features::default()
            },
            Box::new(move |heads| plain(heads).causal()),
        ),
        case(
            "segments, causal",
            Features::default(),
            Box::new({
                let segments = segments.clone();
                move |heads| segments(heads).causal()
            }),
        ),
        case(
            "two-sided window 2, segments",
            Features {
                window: Some(2),
                ..Features::default()
            },
            Box::new(segments),
        ),
        case(
            "soft cap 1.5",
            Features {
                softcap: Some(1.5),
                ..Features::default()
            },
            Box::new(plain),
        ),
        case(
            "sinks + dead row + causal",
            Features {
                sinks: true,
                ..Features::default()
            },
            Box::new(move |heads| plain(heads).causal().attn_mask(dead_row.clone())),
        ),
    ]
}

/// A `size × size` identity in `dtype`.
fn identity(size: usize, dtype: FloatDType, device: &Device) -> Param<Tensor<2>> {
    Param::from_tensor(Tensor::<2>::eye(size, device).cast(dtype))
}

/// A module of `sizes` with `features` whose projections are identities without biases, its
/// sinks (when it has them) `sinks`, in `dtype`.
fn identity_module(
    sizes: Sizes,
    features: &Features,
    sinks: &Tensor<1>,
    dtype: FloatDType,
    device: &Device,
) -> MultiHeadAttention {
    let d_model = sizes.n_heads * sizes.head_dim;
    let mut module = MultiHeadAttentionConfig::new(d_model, sizes.n_heads)
        .with_n_kv_heads(Some(sizes.n_kv_heads))
        .with_d_key_input(Some(sizes.kv_width()))
        .with_d_value_input(Some(sizes.kv_width()))
        .with_bias(false)
        .with_scale(Some(0.35))
        .with_window(features.window)
        .with_alibi(features.alibi)
        .with_softcap(features.softcap)
        .with_attention_sinks(features.sinks)
        .init(device);
    module.query.weight = identity(d_model, dtype, device);
    module.key.weight = identity(sizes.kv_width(), dtype, device);
    module.value.weight = identity(sizes.kv_width(), dtype, device);
    module.output.weight = identity(d_model, dtype, device);
    if features.sinks {
        module.sinks = Some(Param::from_tensor(sinks.clone().cast(dtype)));
    }
    module
}

/// The context and the gradients of the query, key and value inputs (and of the sinks) of
/// `loss = Σ context · weight(context)`.
fn outputs_and_grads(
    module: &MultiHeadAttention,
    heads: &[Tensor<3>; 3],
    input: &dyn Fn([Tensor<3>; 3]) -> MhaInput,
    path: AttentionPath,
    loss_weight: &dyn Fn(&Tensor<3>) -> Tensor<3>,
) -> Vec<Tensor<3>> {
    let heads = heads.clone().map(|tensor| tensor.detach().require_grad());
    let context = module.forward(input(heads.clone()).path(path)).context;
    let grads = (context.clone() * loss_weight(&context)).sum().backward();
    let mut all = vec![context.inner()];
    all.extend(
        heads
            .iter()
            .map(|tensor| tensor.grad(&grads).expect("an input gradient")),
    );
    if let Some(sinks) = &module.sinks {
        let grad = sinks.grad(&grads).expect("a sink gradient");
        all.push(grad.reshape([1, 1, -1]));
    }
    all
}

const WHAT: [&str; 5] = ["context", "d query", "d key", "d value", "d sinks"];

fn max_difference(a: &Tensor<3>, b: &Tensor<3>) -> f32 {
    (a.clone().cast(FloatDType::F32) - b.clone().cast(FloatDType::F32))
        .abs()
        .max()
        .into_scalar::<f32>()
}

/// Flash against explicit on `sizes`, every case, in f32: context and every gradient within
/// `tolerance`.
fn assert_flash_equals_explicit(device: &Device, sizes: Sizes, cases: &[Case], tolerance: f32) {
    let heads = [
        randn(
            [sizes.batch, sizes.seq_q, sizes.n_heads * sizes.head_dim],
            device,
        ),
        randn([sizes.batch, sizes.seq_k, sizes.kv_width()], device),
        randn([sizes.batch, sizes.seq_k, sizes.kv_width()], device),
    ];
    let sinks = randn([sizes.n_heads], device);
    let sine = |context: &Tensor<3>| context.clone().sin();
    for case in cases {
        let module = identity_module(sizes, &case.features, &sinks, FloatDType::F32, device);
        let run = |path| outputs_and_grads(&module, &heads, &*case.input, path, &sine);
        let expected = run(AttentionPath::Explicit);
        let actual = run(AttentionPath::Flash(BlockSizes::default()));
        assert_eq!(actual.len(), expected.len(), "{}", case.label);
        for (index, (actual, expected)) in actual.iter().zip(&expected).enumerate() {
            let difference = max_difference(actual, expected);
            assert!(
                difference <= tolerance,
                "{} {sizes:?}: {} differs by {difference}",
                case.label,
                WHAT[index]
            );
        }
    }
}

/// Every case, GQA, causal with more queries than keys and fewer, and lengths spanning
/// several key tiles (45 × 70) and several cubes of queries and of keys with partial tiles on
/// both sides (300 × 530: the kernels' blocks are 256 rows, their tiles 16): the kernels'
/// outputs and gradients (and the generic body's, for sinks and segments) equal the explicit
/// path's within 1e-4.
#[test]
fn the_gpu_kernels_equal_the_explicit_path_in_outputs_and_gradients() {
    let Some(device) = wgpu_device() else {
        return;
    };
    assert!(flash_attention_supported(&device));
    let device = device.autodiff();
    let _seeded = common::seed(&device, 37);
    // Each new shape costs lavapipe new shaders for the explicit path and Burn's kernels (the
    // flash kernels take lengths at run time): no more shapes than these properties need.
    for (seq_q, seq_k) in [(7, 3), (45, 70), (300, 530)] {
        let sizes = Sizes::grouped(seq_q, seq_k);
        assert_flash_equals_explicit(&device, sizes, &cases(&device, sizes, None), 1e-4);
    }
}

/// Head width 64 over 600 queries and keys: a unit's loops run more than 65535 iterations
/// unless the ones over the head width are unrolled, and lavapipe's (llvmpipe's) loop limiter
/// cuts a shader short past that, silently.
#[test]
fn the_gpu_kernels_run_long_loops_to_the_end() {
    let Some(device) = wgpu_device() else {
        return;
    };
    let device = device.autodiff();
    let _seeded = common::seed(&device, 38);
    let sizes = Sizes {
        batch: 1,
        n_heads: 2,
        n_kv_heads: 1,
        seq_q: 600,
        seq_k: 600,
        head_dim: 64,
    };
    let causal: Box<dyn Fn([Tensor<3>; 3]) -> MhaInput> =
        Box::new(|[q, k, v]| MhaInput::new(q, k, v).causal());
    let case = Case {
        label: "causal 600x600, head width 64",
        features: Features::default(),
        input: causal,
    };
    assert_flash_equals_explicit(&device, sizes, &[case], 1e-4);
}

/// A call just inside llvmpipe's loop limit as `flash/cube/plan.rs` counts it runs to the end:
/// 16 000 keys are 1000 tiles of 16 for the `dQ` kernel at 65 loop iterations each, 65 000 of
/// the 65 535 llvmpipe allows a shader in all (the plan's unit tests check that the kernels
/// take this call). A loop the count missed would cut the shader short and fail the
/// comparison; on a GPU it is one more long case.
#[test]
fn the_gpu_kernels_run_to_the_end_up_to_llvmpipes_loop_limit() {
    let Some(device) = wgpu_device() else {
        return;
    };
    let device = device.autodiff();
    let _seeded = common::seed(&device, 39);
    let sizes = Sizes {
        batch: 1,
        n_heads: 1,
        n_kv_heads: 1,
        seq_q: 8,
        seq_k: 16_000,
        head_dim: 4,
    };
    let plain: Box<dyn Fn([Tensor<3>; 3]) -> MhaInput> =
        Box::new(|[q, k, v]| MhaInput::new(q, k, v));
    let case = Case {
        label: "8 queries × 16 000 keys",
        features: Features::default(),
        input: plain,
    };
    assert_flash_equals_explicit(&device, sizes, &[case], 1e-4);
}

/// Half precision on the GPU kernels (f16 and bf16 inputs, f32 accumulation), two ways.
///
/// - FlashAttention's rule: against the explicit path in f32, the error of the output and of
///   each gradient is at most twice the explicit path's own in the same precision.
/// - f32 accumulation: on inputs that are exact in the half type (and a loss whose output
///   gradient is too), each result differs from the f32 reference by its final rounding alone,
///   at most one half-precision epsilon of the largest value; sums carried in the half type
///   would round at every step.
///
/// Odd widths and lengths spanning several tiles; a dtype the adapter lacks is skipped with a
/// note.
#[test]
fn the_gpu_kernels_in_half_precision_round_once_and_err_at_most_twice_the_explicit_path() {
    let Some(device) = wgpu_device() else {
        return;
    };
    let device = device.autodiff();
    let _seeded = common::seed(&device, 41);
    // The shape of the f32 test above, whose explicit-path shaders this one reuses.
    let sizes = Sizes::grouped(45, 70);
    let heads = [
        randn(
            [sizes.batch, sizes.seq_q, sizes.n_heads * sizes.head_dim],
            &device,
        ),
        randn([sizes.batch, sizes.seq_k, sizes.kv_width()], &device),
        randn([sizes.batch, sizes.seq_k, sizes.kv_width()], &device),
    ];
    let loss_weight = randn(
        [sizes.batch, sizes.seq_q, sizes.n_heads * sizes.head_dim],
        &device,
    );
    let sinks = randn([sizes.n_heads], &device);
    let picked = ["causal", "padding + dead row + causal", "float bias"];
    for (dtype, epsilon) in [
        (FloatDType::F16, 2f32.powi(-10)),
        (FloatDType::BF16, 2f32.powi(-7)),
    ] {
        if !device.supports_dtype(dtype) {
            eprintln!("*** SKIPPING {dtype:?} on wgpu: the adapter does not support it ***");
            continue;
        }
        let narrow = |tensor: &Tensor<3>| tensor.clone().cast(dtype);
        let exact = |tensor: &Tensor<3>| narrow(tensor).cast(FloatDType::F32);
        let exact_heads = heads.each_ref().map(exact);
        let half_heads = heads.each_ref().map(narrow);
        let exact_weight = exact(&loss_weight);
        let half_weight = narrow(&loss_weight);
        for case in cases(&device, sizes, Some(dtype))
            .iter()
            .filter(|case| picked.contains(&case.label))
        {
            let input = &*case.input;
            let wide = identity_module(sizes, &case.features, &sinks, FloatDType::F32, &device);
            let half = identity_module(sizes, &case.features, &sinks, dtype, &device);
            let reference =
                outputs_and_grads(&wide, &exact_heads, input, AttentionPath::Explicit, &|_| {
                    exact_weight.clone()
                });
            let run =
                |path| outputs_and_grads(&half, &half_heads, input, path, &|_| half_weight.clone());
            let explicit = run(AttentionPath::Explicit);
            let flash = run(AttentionPath::Flash(BlockSizes::default()));
            for (index, reference) in reference.iter().enumerate() {
                let label = format!("{dtype:?} {}: {}", case.label, WHAT[index]);
                assert_eq!(flash[index].dtype(), dtype.into(), "{label} keeps its type");
                let ours = max_difference(&flash[index], reference);
                let theirs = max_difference(&explicit[index], reference);
                let largest = reference.clone().abs().max().into_scalar::<f32>();
                assert!(
                    ours <= 2.0 * theirs + 1e-6,
                    "{label}: error {ours} > 2 × the explicit path's {theirs}"
                );
                assert!(
                    ours <= epsilon * largest,
                    "{label}: error {ours} > one rounding ({epsilon} × {largest})"
                );
            }
        }
    }
}
