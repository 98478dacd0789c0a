//! Which kernel one forward runs: the policy of [`AttentionPath::Auto`] (documented there, and
//! only there), the checks of a forced path, and the backend facts they rest on.

use burn::tensor::Device;

use crate::flash::{CubeTraits, FlashKernel, cube_traits, flash_kernel};
use crate::input::{AttentionPath, BlockSizes, NeedWeights};

/// Above this many score elements (`batch · n_heads · seq_q · seq_k`, 64 Mi: 256 MiB of f32
/// scores), [`AttentionPath::Auto`] takes the chunked path on a device without autodiff and
/// without the flash kernel whose fused attention op may materialise the scores (every backend
/// but flex, whose fused op is already tiled).
pub const CHUNKED_THRESHOLD: usize = 1 << 26;

/// The chunked path's blocks when `Auto` takes it: larger query blocks than the flash op's
/// default, since each block costs the chunked path a round of tensor operations.
const CHUNKED_AUTO_BLOCKS: BlockSizes = BlockSizes {
    query: 512,
    key: 1024,
};

/// From this many keys in every query's row, [`AttentionPath::Auto`] gives the native flash
/// kernel query blocks of [`LONG_ROW_BLOCKS`].
pub(crate) const LONG_ROW_KEYS: usize = 2048;

/// The native flash kernel's blocks when `Auto` takes it for rows of [`LONG_ROW_KEYS`] keys or
/// more: twice the default's queries.
///
/// Why: the kernel's `gemm` calls pack their key-side factor (`Kᵀ`, `Vᵀ`, `K`: `seq_k × 64`
/// floats each) again for every query block, so twice the queries per block halves that
/// packing per product. At (1, 8192, 512, 8) on flex, 128 against 256 queries in alternating
/// processes: `fwd+bwd` slower with 128 in 15 of 18 pairs (about 3% on average), `fwd` in 4
/// of 4. Not below: at 512 tokens the two were within noise of each other. Nor where causal
/// masking, a window or segments shorten the rows: the blocks on the diagonal waste twice the
/// work, and a causal training step at 4096 tokens ran 0.38-0.40 s with 128 against 0.39-0.44 s
/// with 256 (`long_sequence` bench). Each thread holds two `query × seq_k` blocks in the
/// backward: 16 MiB at 8192 keys.
pub(crate) const LONG_ROW_BLOCKS: BlockSizes = BlockSizes {
    query: 256,
    key: 1024,
};

/// `[batch, n_heads, seq_q, seq_k]` tensors the explicit path keeps for a training step (the
/// scores, the probabilities, and their gradients in the backward), each counted at 4 bytes an
/// element.
const EXPLICIT_TRAINING_SCORE_BYTES: u64 = 4 * 4;

/// The memory [`AttentionPath::Auto`] assumes a CubeCL device has where it does not say.
const UNSTATED_DEVICE_MEMORY: u64 = 16 << 30;

/// Whether [`AttentionPath::Auto`] trains on the CubeCL flash kernels on a device with `traits`
/// (documented on `Auto`). Where the device has no tensor cores the flash kernels are faster
/// than the explicit path at every shape measured on lavapipe, `fwd+bwd` f32 (`cargo bench
/// --bench gpu`, 2026-12-02): (8, 128, 256, 8) 242 against 275 ms, (2, 1024, 256, 4) 806-981
/// against 1044 ms, (1, 2048, 512, 8) 2965 against 4954 ms, in 1/7 to 1/12 of the memory. On
/// tensor cores, Burn's matmuls have hardware the kernels do not use and no GPU has measured
/// the two yet: the explicit path, unless the scores it keeps would take more than half of the
/// device's memory.
fn cube_flash_trains(traits: CubeTraits, score_elements: usize) -> bool {
    let explicit_bytes = (score_elements as u64).saturating_mul(EXPLICIT_TRAINING_SCORE_BYTES);
    let room = traits.memory.unwrap_or(UNSTATED_DEVICE_MEMORY) / 2;
    !traits.tensor_cores || explicit_bytes > room
}

/// The implementation one forward uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kernel {
    Fused,
    Explicit,
    Chunked(BlockSizes),
    Flash(BlockSizes),
}

/// What the kernel choice depends on, gathered from the module and the input.
#[derive(Debug, Clone)]
pub(crate) struct KernelRequest<'a> {
    pub path: AttentionPath,
    pub need_weights: NeedWeights,
    /// Dropout changes the weights in this forward (training mode, autodiff device, p > 0).
    pub dropout_active: bool,
    /// The softmax has a sink logit (learned attention sinks, or the quiet softmax's 0), which
    /// Burn's fused op has no place for.
    pub sinks: bool,
    /// The caller's float attention mask is a tensor that needs a gradient.
    pub float_mask_requires_grad: bool,
    /// `batch · n_heads · seq_q · seq_k`, appended keys included.
    pub score_elements: usize,
    /// Every query's row holds at least [`LONG_ROW_KEYS`] keys (appended ones included) that no
    /// positional rule (causal, window, segments) hides.
    pub long_rows: bool,
    pub device: &'a Device,
}

/// The kernel that runs `request`.
///
/// # Panics
///
/// If the request forces a path that cannot compute it (weights or dropout on anything but the
/// explicit path; a sink logit on the fused path; the flash path where it is not compiled or
/// with a float mask that needs a gradient), or forces block sizes of zero.
#[track_caller]
pub(crate) fn choose_kernel(request: &KernelRequest) -> Kernel {
    let explicit_only = explicit_only_reason(request);
    let flash_blocker = explicit_only.or_else(|| flash_blocker(request));
    let without_weights = explicit_only.or_else(|| weights_reason(request));
    let forced = |kernel: Kernel, name: &str, reason: Option<&str>| match reason {
        None => kernel,
        Some(reason) => panic!(
            "MultiHeadAttention: `{name}` was forced but {reason}, which that kernel cannot do; \
             use `AttentionPath::Auto` or `AttentionPath::Explicit`"
        ),
    };
    match request.path {
        AttentionPath::Explicit => Kernel::Explicit,
        AttentionPath::Fused => forced(
            Kernel::Fused,
            "AttentionPath::Fused",
            without_weights.or(request
                .sinks
                .then_some("the softmax has a sink (attention sinks or the quiet softmax)")),
        ),
        AttentionPath::Chunked(blocks) => {
            check_blocks(blocks, "AttentionPath::Chunked");
            forced(
                Kernel::Chunked(blocks),
                "AttentionPath::Chunked",
                without_weights,
            )
        }
        AttentionPath::Flash(blocks) => {
            check_blocks(blocks, "AttentionPath::Flash");
            forced(Kernel::Flash(blocks), "AttentionPath::Flash", flash_blocker)
        }
        AttentionPath::Auto if explicit_only.is_some() => Kernel::Explicit,
        // Where the flash kernel runs natively on the backend's storage (`flash/cpu.rs`) it
        // beats every other path at every size measured, inference and training, on flex and on
        // ndarray, and writes the weights for inference as it goes (`cargo bench --workspace
        // --bench table`).
        AttentionPath::Auto
            if flash_blocker.is_none()
                && flash_kernel(request.device) == Some(FlashKernel::Native) =>
        {
            Kernel::Flash(if request.long_rows {
                LONG_ROW_BLOCKS
            } else {
                BlockSizes::default()
            })
        }
        // Elsewhere (the CubeCL backends, `flash/cube/`) for training where it was measured
        // faster or the explicit path's scores would not fit (`cube_flash_trains`); inference
        // goes to Burn's fused kernel below, which autotunes on the device.
        AttentionPath::Auto
            if flash_blocker.is_none()
                && request.device.is_autodiff()
                && cube_traits(request.device)
                    .is_some_and(|traits| cube_flash_trains(traits, request.score_elements)) =>
        {
            Kernel::Flash(BlockSizes::default())
        }
        // Without the flash op, Burn's autodiff runs the fused op as a decomposed fallback that
        // scales and clamps the full score matrix; the explicit path scales the queries instead
        // and uses the one-op softmax: 400 ms against 485 ms for a forward + backward at batch
        // 4, 512 tokens, d_model 512, 8 heads on flex (`cargo bench --workspace --bench table`).
        AttentionPath::Auto if request.device.is_autodiff() => Kernel::Explicit,
        // The generic body would recompute every score block for the weights, several launches
        // each, where the explicit path is three ops.
        AttentionPath::Auto if request.need_weights != NeedWeights::No => Kernel::Explicit,
        AttentionPath::Auto
            if request.score_elements > CHUNKED_THRESHOLD && !runs_on_flex(request.device) =>
        {
            Kernel::Chunked(CHUNKED_AUTO_BLOCKS)
        }
        // Burn's fused op has no sink logit.
        AttentionPath::Auto if request.sinks => Kernel::Explicit,
        AttentionPath::Auto => Kernel::Fused,
    }
}

/// Why only the explicit path can run the request, if it must.
fn explicit_only_reason(request: &KernelRequest) -> Option<&'static str> {
    if request.dropout_active {
        Some("dropout is active")
    } else if request.need_weights != NeedWeights::No && request.device.is_autodiff() {
        // The flash op's weights carry no gradient.
        Some(
            "attention weights are requested on an autodiff device (they take part in the gradient)",
        )
    } else {
        None
    }
}

/// Why the fused and chunked paths, which return no weights, cannot run the request.
fn weights_reason(request: &KernelRequest) -> Option<&'static str> {
    (request.need_weights != NeedWeights::No).then_some("attention weights are requested")
}

/// Why the flash kernel cannot run the request (besides [`explicit_only_reason`]), if it cannot.
fn flash_blocker(request: &KernelRequest) -> Option<&'static str> {
    if flash_kernel(request.device).is_none() {
        Some("this backend has no flash kernel (see `flash_attention_supported`)")
    } else if request.float_mask_requires_grad {
        Some("the float attention mask requires a gradient")
    } else {
        None
    }
}

#[track_caller]
fn check_blocks(blocks: BlockSizes, name: &str) {
    assert!(
        blocks.query > 0 && blocks.key > 0,
        "MultiHeadAttention: `{name}` needs positive block sizes, got {blocks:?}"
    );
}

/// Whether `device` (or the device under its autodiff) is flex, where two choices pay off that
/// were measured nowhere else:
/// - Where the flash kernel cannot run (a float mask that needs a gradient, or this crate's
///   `flex` feature off), Burn's fused attention op is a kernel whose memory does not grow with
///   `seq_q × seq_k` (it tiles keys with an online softmax above 256 Ki score elements per head,
///   and at 8192 tokens runs in 2.5 s where the chunked path takes 4.6 s), so it needs no
///   chunked path. Other backends may materialise the scores (ndarray always does).
/// - Head-major projections (`MultiHeadAttention::project_heads`) feed its attention kernel
///   faster; on ndarray they are slightly slower than a `Linear` and a split.
///
/// Burn exposes no backend query that compiles whatever backends are enabled, hence the
/// device's `Debug` form (a test pins it).
pub(crate) fn runs_on_flex(device: &Device) -> bool {
    format!("{:?}", device.clone().inner()).starts_with("Device<Flex")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(device: &Device) -> KernelRequest<'_> {
        KernelRequest {
            path: AttentionPath::Auto,
            need_weights: NeedWeights::No,
            dropout_active: false,
            sinks: false,
            float_mask_requires_grad: false,
            score_elements: 1,
            long_rows: false,
            device,
        }
    }

    /// Pins the `Debug` form `runs_on_flex` reads, so that a Burn upgrade that changes it
    /// fails here rather than silently sending flex to the slower chunked path.
    #[test]
    fn flex_is_recognised_and_ndarray_is_not() {
        assert!(runs_on_flex(&Device::flex()));
        assert!(runs_on_flex(&Device::flex().autodiff()));
        #[allow(deprecated)]
        let ndarray = Device::ndarray();
        assert!(!runs_on_flex(&ndarray));
    }

    #[test]
    fn auto_takes_the_explicit_path_for_weights_and_dropout() {
        let device = Device::flex().autodiff();
        let base = request(&device);
        let cases = [
            KernelRequest {
                need_weights: NeedWeights::Averaged,
                ..base.clone()
            },
            KernelRequest {
                dropout_active: true,
                ..base.clone()
            },
        ];
        for case in cases {
            assert_eq!(choose_kernel(&case), Kernel::Explicit, "{case:?}");
        }
        assert_eq!(
            choose_kernel(&base),
            Kernel::Flash(BlockSizes::default()),
            "flex trains on the flash kernel"
        );
        let mask_needs_grad = KernelRequest {
            float_mask_requires_grad: true,
            ..base
        };
        assert_eq!(choose_kernel(&mask_needs_grad), Kernel::Explicit);
    }

    #[test]
    fn weights_for_inference_come_from_the_native_flash_kernel() {
        #[allow(deprecated)]
        let ndarray = Device::ndarray();
        for device in [Device::flex(), ndarray] {
            for need_weights in [NeedWeights::PerHead, NeedWeights::Averaged] {
                let case = KernelRequest {
                    need_weights,
                    ..request(&device)
                };
                assert_eq!(
                    choose_kernel(&case),
                    Kernel::Flash(BlockSizes::default()),
                    "{case:?}"
                );
            }
        }
    }

    #[test]
    fn long_rows_get_larger_query_blocks_on_the_native_kernel_only() {
        #[allow(deprecated)]
        let ndarray = Device::ndarray();
        for device in [Device::flex(), Device::flex().autodiff(), ndarray] {
            let short = request(&device);
            let long = KernelRequest {
                long_rows: true,
                ..short.clone()
            };
            assert_eq!(choose_kernel(&short), Kernel::Flash(BlockSizes::default()));
            assert_eq!(choose_kernel(&long), Kernel::Flash(LONG_ROW_BLOCKS));
            let forced = KernelRequest {
                path: AttentionPath::Flash(BlockSizes::default()),
                ..long
            };
            assert_eq!(
                choose_kernel(&forced),
                Kernel::Flash(BlockSizes::default()),
                "forced blocks are the caller's"
            );
        }
    }

    /// Without tensor cores the CubeCL kernels train at every size; with them, only where the
    /// explicit path's scores would take more than half of the device's memory (16 GiB
    /// assumed where the device does not say).
    #[test]
    fn cube_devices_train_on_the_flash_kernels_without_tensor_cores_or_room() {
        let gib = 1u64 << 30;
        let software = CubeTraits {
            tensor_cores: false,
            memory: None,
        };
        let gpu = CubeTraits {
            tensor_cores: true,
            memory: Some(80 * gib),
        };
        // 4 tensors of 4 bytes: 1 Gi score elements are 16 GiB.
        let giga = 1usize << 30;
        assert!(cube_flash_trains(software, 1));
        assert!(!cube_flash_trains(gpu, 1));
        assert!(!cube_flash_trains(gpu, 2 * giga), "32 GiB of 80 fit");
        assert!(cube_flash_trains(gpu, 3 * giga), "48 GiB of 80 do not");
        let unstated = CubeTraits {
            memory: None,
            ..gpu
        };
        assert!(!cube_flash_trains(unstated, giga / 2), "8 GiB of 16 fit");
        assert!(cube_flash_trains(unstated, giga), "16 GiB of 16 do not");
        assert!(cube_flash_trains(gpu, usize::MAX), "no overflow");
    }

    #[test]
    #[should_panic(expected = "attention weights are requested on an autodiff device")]
    fn forced_flash_with_weights_is_refused_under_autodiff() {
        let device = Device::flex().autodiff();
        choose_kernel(&KernelRequest {
            path: AttentionPath::Flash(BlockSizes::default()),
            need_weights: NeedWeights::PerHead,
            ..request(&device)
        });
    }

    #[test]
    #[should_panic(expected = "`AttentionPath::Chunked` needs positive block sizes")]
    fn zero_block_sizes_are_refused() {
        let device = Device::flex();
        choose_kernel(&KernelRequest {
            path: AttentionPath::Chunked(BlockSizes { query: 0, key: 4 }),
            ..request(&device)
        });
    }
}
