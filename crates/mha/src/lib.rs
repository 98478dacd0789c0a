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
mod flash;
mod geometry;
mod input;
mod kernel;
mod mask;
mod module;
// Names burn-ndarray's deprecated backend type, as `flash` does.
#[allow(deprecated)]
mod projection;
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
pub use rotary::{RopeConfig, RopeLayout, RopeScaling};

#[cfg(feature = "pytorch")]
pub mod pytorch;

#[cfg(any(feature = "flex", feature = "ndarray"))]
pub mod buffer_pool {
    //! The CPU kernels' output buffers, recycled between calls on flex: the buffers the flash
    //! kernel and the projections hand to flex tensors go back to a bounded pool when the
    //! tensors drop, so that a loop of calls of one shape writes into memory that is already
    //! mapped instead of faulting fresh pages in on every call. The pool keeps at most
    //! [`POOL_BYTES`] idle and resident, in buffers of 128 KiB to a quarter of that, oldest out
    //! first; larger buffers it keeps lazily freed (Linux's `MADV_FREE`, at most a quarter of
    //! the machine's memory), pages that the kernel takes back whenever it needs memory
    //! ([`lazily_freed_bytes`]). [`release`] frees all of them.
    pub use crate::flash::recycle::{POOL_BYTES, idle_bytes, lazily_freed_bytes, release};
}
