//! Multi-head attention for [Burn](https://burn.dev) 0.22: one [`MultiHeadAttention`] module
//! that runs unchanged on every Burn backend (flex, ndarray, wgpu, …), with autodiff.
//!
//! In Burn 0.22 tensors carry no backend type parameter; the backend is the run-time
//! [`Device`](burn::tensor::Device) a tensor lives on. So the module has no `B: Backend`
//! parameter: the same code path runs on whichever device its parameters were initialised on.
//!
//! Compared with `burn::nn::attention::MultiHeadAttention`, this module adds PyTorch
//! `nn.MultiheadAttention`'s features (key/value widths `kdim`/`vdim`, `add_bias_kv`,
//! `add_zero_attn`, optional per-head or averaged weights, key padding mask with PyTorch's
//! polarity, bool or float attention masks) and grouped-query/multi-query attention, a causal
//! flag, a custom scale, zero (not NaN) output for fully masked queries, a KV cache, RoPE and
//! ALiBi, and a flash-attention kernel whose backward recomputes the scores (memory-bounded
//! training), native on flex and ndarray; elsewhere Burn's fused attention kernel whenever the
//! weights are not needed.
//!
//! # Example
//!
//! ```
//! use burn::tensor::{Bool, Device, Distribution, Tensor};
//! use mha::{MhaInput, MultiHeadAttentionConfig, NeedWeights};
//!
//! let device = Device::flex();
//! let attention = MultiHeadAttentionConfig::new(32, 4).init(&device);
//! let x = Tensor::<3>::random([2, 6, 32], Distribution::Normal(0.0, 1.0), &device);
//!
//! // Causal self-attention; the last two keys of the second sequence are padding.
//! let padding = Tensor::<2, Bool>::from_data(
//!     [[false; 6], [false, false, false, false, true, true]],
//!     &device,
//! );
//! let output = attention.forward(
//!     MhaInput::self_attn(x)
//!         .causal()
//!         .key_padding_mask(padding)
//!         .need_weights(NeedWeights::PerHead),
//! );
//! assert_eq!(output.context.dims(), [2, 6, 32]);
//! let weights = output.weights.unwrap().per_head().unwrap();
//! assert_eq!(weights.dims(), [2, 4, 6, 6]);
//! ```
//!
//! # What is where
//!
//! - [`MultiHeadAttentionConfig`] → [`MultiHeadAttention`]; its input [`MhaInput`] (masks,
//!   causal, segments, [`NeedWeights`], [`AttentionPath`]) and output [`MhaOutput`].
//! - Decoding: [`KvCache`] (unbounded, fixed, sliding or streaming windows, f16 or int8
//!   storage) with [`MultiHeadAttention::forward_cached`], and [`CrossAttentionCache`].
//! - Serving: [`PagedKvCache`] (a bounded pool of blocks for many sequences, forks, prompt
//!   prefixes found by their tokens) with [`MultiHeadAttention::forward_paged`] (a ragged batch
//!   of prompts and decoding steps in one call, continuous batching).
//! - Positions: [`RopeConfig`] (RoPE) and ALiBi ([`alibi_slopes`]), as configuration fields.
//! - Layers: [`transformer`] (encoder and decoder layers and stacks with burn-nn's names).
//! - Interop: [`burn_nn`] (`From` burn-nn's modules), `pytorch` (state dicts, feature
//!   `pytorch`).
//! - Which kernel runs: [`AttentionPath::Auto`]; [`flash_attention_supported`]; on the CPU,
//!   which instruction set's copy of it: `cpu_capability` (`MHA_CPU_CAPABILITY` caps it).
//!
//! # Features
//!
//! | feature | what it adds |
//! |---|---|
//! | `flex` (default) | the native flash kernel and projections on flex's storage, and the output buffer pool (`buffer_pool`) |
//! | `ndarray` | the same on ndarray's storage |
//! | `wgpu`, `vulkan`, `metal`, `cuda`, `rocm` | the flash op's CubeCL kernels on that backend (turns on Burn's `fusion`) |
//! | `pytorch` | `pytorch`: loading and saving `nn.MultiheadAttention` state dicts (`.pt`, `.safetensors`) |
//!
//! The module runs on every backend the user's `burn` enables whatever these features say; they
//! decide which backends get this crate's own kernels.

#![warn(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod alibi;
pub mod burn_nn;
mod cache;
mod config;
mod decoding;
mod dispatch;
// Names burn-ndarray's deprecated backend type, supported while Burn ships it.
#[allow(deprecated)]
mod cpu;
mod execution;
mod extension;
// Names burn-ndarray's deprecated backend type, as `cpu` does.
#[allow(deprecated)]
mod flash;
mod geometry;
mod input;
mod kernel;
mod mask;
mod module;
// Names burn-ndarray's deprecated backend type, as `cpu` does.
#[allow(deprecated)]
mod paged;
mod rotary;
mod rules;
mod shape;
pub mod transformer;

pub use alibi::alibi_slopes;
pub use cache::{CacheError, CacheLimit, CacheOwner, CacheStorage, CrossAttentionCache, KvCache};
pub use config::{AttentionInitializer, ConfigError, MultiHeadAttentionConfig};
pub use dispatch::CHUNKED_THRESHOLD;
pub use flash::flash_attention_supported;
pub use input::{
    AttentionPath, AttentionWeights, AttnMask, BlockSizes, IntoAttnMask, MhaInput, MhaOutput,
    NeedWeights,
};
pub use mask::causal_mask;
pub use module::MultiHeadAttention;
pub use paged::{
    PagedCacheError, PagedKvCache, PagedKvCacheConfig, PromptMatch, SequenceId, Token,
};
pub use rotary::{RopeConfig, RopeLayout, RopeScaling};

#[cfg(feature = "pytorch")]
pub mod pytorch;

#[cfg(any(feature = "flex", feature = "ndarray"))]
pub use cpu::{CPU_CAPABILITY_VARIABLE, CpuCapability, cpu_capability};

#[cfg(any(feature = "flex", feature = "ndarray"))]
pub mod buffer_pool {
    //! The CPU kernels' output buffers, reused between calls on flex: the buffers the flash
    //! kernel and the projections hand to flex tensors go back to a pool when the tensors drop,
    //! so that a loop of calls of one shape writes into memory that is already mapped instead
    //! of faulting fresh pages in on every call. On ndarray, whose tensors own their memory,
    //! outputs are plain allocations.
    //!
    //! The pool is one per process and bounded: it keeps at most [`limit`] bytes idle
    //! ([`DEFAULT_LIMIT`] unless [`set_limit`] changes it; `set_limit(0)` turns it off), in size
    //! classes (four per doubling), oldest out first; buffers under [`MIN_BYTES`] are never
    //! pooled. [`release`] frees every idle buffer; [`idle_bytes`] says how much is held.
    //!
    //! Transparent huge pages are opt-in, as PyTorch's `THP_MEM_ALLOC_ENABLE` makes them:
    //! `MHA_HUGE_PAGES=1` in the environment (read once, at the first large allocation) or
    //! [`set_huge_pages`]`(true)` makes fresh buffers of 2 MiB or more ask Linux for them. They
    //! save page faults and TLB misses on most machines; on a virtual machine whose host takes
    //! freed memory back they can cost more than they save, so measure before turning them on.
    //!
    //! The library reads nothing from `/sys` or `/proc` to decide how to allocate.
    pub use crate::cpu::buffers::{
        DEFAULT_LIMIT, MIN_BYTES, huge_pages, idle_bytes, limit, release, set_huge_pages, set_limit,
    };
}
