//! The chunked and flash paths against the explicit path: outputs and the gradients of the
//! inputs and every parameter, on the calling thread and on rayon's, on every test device; a
//! forced path that cannot run is refused clearly.

mod common;

use burn::tensor::{Bool, Device, Tensor, TensorData};
use common::{assert_close, randn, test_devices, tolerance};
use mha::{
    AttentionPath, BlockSizes, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig, RopeConfig,
    flash_attention_supported,
};

/// The block sizes the chunked and flash paths are tested with on device `name`: ragged ones
/// and the default on the CPU; one on wgpu, where lavapipe compiles kernels for each new shape.
fn block_sizes(name: &str) -> Vec<BlockSizes> {
    let ragged = BlockSizes { query: 4, key: 5 };
    match name {
        "wgpu" => vec![ragged],
        _ => vec![
            ragged,
            BlockSizes { query: 1, key: 3 },
            BlockSizes::default(),
        ],
    }
}

#[test]
fn chunked_path_equals_explicit_path() {
    for (name, device) in test_devices() {
        let _seed = common::seed(&device, 16);
        let module = MultiHeadAttentionConfig::new(16, 4)
            .with_n_kv_heads(Some(2))
            .with_add_bias_kv(true)
            .with_alibi(true)
            .init(&device);
        let query = randn([2, 11, 16], &device);
        let memory = randn([2, 13, 16], &device);
        let padding = Tensor::<2, Bool>::from_data(
            [
                [false; 13],
                [
                    false, false, true, false, false, false, false, false, false, true, true, true,
                    true,
                ],
            ],
            &device,
        );
        let bias = randn([2, 4, 11, 13], &device);
        let inputs = [
            (
                "plain",
                MhaInput::new(query.clone(), memory.clone(), memory.clone()),
            ),
            (
                "padding+causal",
                MhaInput::new(query.clone(), memory.clone(), memory.clone())
                    .key_padding_mask(padding.clone())
                    .causal(),
            ),
            (
                "float mask",
                MhaInput::new(query.clone(), memory.clone(), memory.clone()).attn_mask(bias),
            ),
            ("self causal", MhaInput::self_attn(query.clone()).causal()),
        ];
        for (label, input) in inputs {
            let explicit = module
                .forward(input.clone().path(AttentionPath::Explicit))
                .context;
            for sizes in block_sizes(name) {
                let chunked = module
                    .forward(input.clone().path(AttentionPath::Chunked(sizes)))
                    .context;
                assert_close(
                    &format!("{name} {label} {sizes:?}"),
                    chunked,
                    explicit.clone(),
                    tolerance(name),
                );
            }
        }
    }
}

/// The flash kernel's custom backward, and autodiff through the chunked path, against autodiff
/// through the explicit path: the context and the gradients of the inputs and of every
/// parameter. Once with keys appended (`add_bias_kv`, which moves the causal mask into the
/// bool mask) and once without (the kernels' own causal handling).
#[test]
fn flash_and_chunked_paths_equal_the_explicit_path_in_outputs_and_gradients() {
    for (name, device) in test_devices() {
        let device = device.autodiff();
        let _seed = common::seed(&device, 18);
        let appended = MultiHeadAttentionConfig::new(16, 4)
            .with_n_kv_heads(Some(2))
            .with_add_bias_kv(true)
            .with_alibi(true)
            .with_rope(Some(RopeConfig::new()))
            .init(&device);
        let plain = MultiHeadAttentionConfig::new(16, 4)
            .with_n_kv_heads(Some(2))
            .with_scale(Some(0.4))
            .init(&device);
        let inputs = GradientInputs::new(&device);
        for (module_label, module) in [("appended keys", &appended), ("no appended keys", &plain)] {
            for blocks in block_sizes(name) {
                let mut paths = vec![AttentionPath::Chunked(blocks)];
                if flash_attention_supported(&device) {
                    paths.push(AttentionPath::Flash(blocks));
                }
                for (case, _) in GradientInputs::CASES {
                    let explicit = inputs.run(module, case, AttentionPath::Explicit);
                    for &path in &paths {
                        let actual = inputs.run(module, case, path);
                        for ((what, expected), (_, actual)) in explicit.iter().zip(actual) {
                            // Outputs as tight as every other path; gradients sum over more
                            // terms.
                            let bound = if *what == "context" {
                                tolerance(name)
                            } else {
                                1e-4
                            };
                            assert_close(
                                &format!("{name} {module_label} {case} {path:?}: {what}"),
                                actual,
                                expected.clone(),
                                bound,
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The inputs of the gradient comparisons: query, memory, masks.
struct GradientInputs {
    query: Tensor<3>,
    memory: Tensor<3>,
    short: Tensor<3>,
    padding: Tensor<2, Bool>,
    all_padded: Tensor<2, Bool>,
    bias: Tensor<4>,
}

impl GradientInputs {
    /// Each case and what it exercises.
    const CASES: [(&'static str, &'static str); 5] = [
        ("float mask", "a float attention mask, cross-attention"),
        (
            "padding+causal",
            "key padding with fully padded keys at the end, causal",
        ),
        ("self causal", "causal self-attention"),
        (
            "causal, seq_q > seq_k",
            "more queries than keys: the first see no key",
        ),
        (
            "causal, seq_q < seq_k",
            "fewer queries than keys: bottom-right alignment",
        ),
    ];

    fn new(device: &Device) -> Self {
        let mut padding = vec![false; 2 * 13];
        for key in [2, 9, 10, 11, 12] {
            padding[13 + key] = true;
        }
        Self {
            query: randn([2, 11, 16], device),
            memory: randn([2, 13, 16], device),
            short: randn([2, 5, 16], device),
            padding: Tensor::from_data(TensorData::new(padding, [2, 13]), device),
            all_padded: Tensor::from_data(
                TensorData::new([vec![false; 13], vec![true; 13]].concat(), [2, 13]),
                device,
            ),
            bias: randn([2, 4, 11, 13], device),
        }
    }

    /// The context and every gradient, flattened and named.
    fn run(
        &self,
        module: &MultiHeadAttention,
        case: &str,
        path: AttentionPath,
    ) -> Vec<(&'static str, Tensor<1>)> {
        let query = self.query.clone().detach().require_grad();
        let memory = match case {
            "self causal" => None,
            "causal, seq_q > seq_k" => Some(self.short.clone()),
            "causal, seq_q < seq_k" => Some(self.memory.clone()),
            _ => Some(self.memory.clone()),
        }
        .map(|memory| memory.detach().require_grad());
        let query_input = match case {
            "causal, seq_q < seq_k" => query.clone().narrow(1, 0, 6),
            _ => query.clone(),
        };
        let mut input = match &memory {
            Some(memory) => MhaInput::new(query_input, memory.clone(), memory.clone()),
            None => MhaInput::self_attn(query_input),
        };
        input = match case {
            "float mask" => input.attn_mask(self.bias.clone()),
            "padding+causal" => input.key_padding_mask(self.padding.clone()).causal(),
            "fully padded" => input.key_padding_mask(self.all_padded.clone()),
            _ => input.causal(),
        };
        let context = module.forward(input.path(path)).context;
        // A loss whose gradient differs from element to element.
        let grads = (context.clone() * context.clone().sin()).sum().backward();
        let flat = |tensor: Tensor<2>| tensor.reshape([-1]);
        let mut named = vec![
            ("context", context.inner().reshape([-1])),
            ("d query", query.grad(&grads).unwrap().reshape([-1])),
            ("d W_q", flat(module.query.weight.grad(&grads).unwrap())),
            ("d W_k", flat(module.key.weight.grad(&grads).unwrap())),
            ("d W_v", flat(module.value.weight.grad(&grads).unwrap())),
            ("d W_o", flat(module.output.weight.grad(&grads).unwrap())),
        ];
        if let Some(bias_k) = &module.bias_k {
            named.push(("d bias_k", bias_k.grad(&grads).unwrap()));
        }
        if let Some(memory) = &memory {
            named.push(("d memory", memory.grad(&grads).unwrap().reshape([-1])));
        }
        named
    }
}

/// Large enough that the native flash kernel spreads heads over threads (small calls, such as
/// decoding steps, run on the calling thread).
#[test]
fn flash_path_equals_explicit_path_on_threads() {
    for (name, device) in test_devices() {
        let device = device.autodiff();
        if !flash_attention_supported(&device) {
            continue;
        }
        let _seed = common::seed(&device, 19);
        let module = MultiHeadAttentionConfig::new(64, 4)
            .with_n_kv_heads(Some(2))
            .init(&device);
        let x = randn([2, 160, 64], &device);
        let mut padding = vec![false; 2 * 160];
        padding[160 + 150..].fill(true);
        let padding = Tensor::<2, Bool>::from_data(TensorData::new(padding, [2, 160]), &device);
        let run = |path: AttentionPath| {
            let x = x.clone().detach().require_grad();
            let context = module
                .forward(
                    MhaInput::self_attn(x.clone())
                        .causal()
                        .key_padding_mask(padding.clone())
                        .path(path),
                )
                .context;
            let grads = (context.clone() * context.clone().sin()).sum().backward();
            [
                context.inner().reshape([-1]),
                x.grad(&grads).unwrap().reshape([-1]),
                module.key.weight.grad(&grads).unwrap().reshape([-1]),
                module.value.weight.grad(&grads).unwrap().reshape([-1]),
            ]
        };
        let explicit = run(AttentionPath::Explicit);
        let flash = run(AttentionPath::Flash(BlockSizes::default()));
        for (what, (expected, actual)) in ["context", "d x", "d W_k", "d W_v"]
            .into_iter()
            .zip(explicit.into_iter().zip(flash))
        {
            let bound = if what == "context" {
                tolerance(name)
            } else {
                1e-4
            };
            assert_close(&format!("{name}: {what}"), actual, expected, bound);
        }
    }
}

/// Where a forced kernel cannot run, forcing it says so; `Auto` trains on another path.
#[test]
fn forced_paths_are_refused_clearly_where_they_cannot_run() {
    let device = Device::flex();
    // Held while this test draws, so that its draws do not interleave with a seeded test's.
    let _seed = common::seed(&device, 78);
    for config in [
        MultiHeadAttentionConfig::new(8, 2).with_quiet_softmax(true),
        MultiHeadAttentionConfig::new(8, 2).with_attention_sinks(true),
    ] {
        let module = config.init(&device);
        let x = randn([1, 3, 8], &device);
        let message = common::panic_message(|| {
            module.forward(MhaInput::self_attn(x.clone()).path(AttentionPath::Fused))
        });
        assert!(
            message.contains("`AttentionPath::Fused` was forced but the softmax has a sink"),
            "{message}"
        );
    }
    for (name, device) in test_devices() {
        if flash_attention_supported(&device) {
            continue;
        }
        let device = device.autodiff();
        let module = MultiHeadAttentionConfig::new(8, 2).init(&device);
        let x = randn([1, 3, 8], &device);
        let message = common::panic_message(|| {
            module.forward(
                MhaInput::self_attn(x.clone()).path(AttentionPath::Flash(BlockSizes::default())),
            )
        });
        assert!(message.contains("has no flash kernel"), "{name}: {message}");
        let context = module.forward(MhaInput::self_attn(x).causal()).context;
        assert_eq!(context.dims(), [1, 3, 8], "{name}: `Auto` still trains");
    }
}
