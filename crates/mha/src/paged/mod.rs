//! Serving many sequences at once: [`PagedKvCache`] keeps the keys and values of any number of
//! sequences in one bounded pool of fixed-size blocks, with a block table per sequence (vLLM's
//! PagedAttention, Kwon et al. 2023), and
//! [`MultiHeadAttention::forward_paged`](crate::MultiHeadAttention::forward_paged) runs one
//! step for a ragged batch of them: prompts being prefilled beside tokens being decoded, each
//! at its own position (continuous batching, Orca, Yu et al. 2022).
//!
//! - `cache.rs`: the sequences, their block tables, the pool's free blocks and reference counts
//!   (sharing, copy-on-write), and the checks that refuse a step before it changes anything;
//! - `prefix.rs`: whole blocks filed by the tokens they hold, so that a prompt starting with
//!   tokens the cache holds shares their blocks (prefix caching);
//! - `store.rs`: the blocks themselves, as tensors (float, f16 or int8);
//! - `step.rs`: the step — projections, RoPE at each row's position, the writes, and which
//!   path attends each sequence;
//! - `gathered.rs`: the attention through tensor ops on any backend, the blocks gathered (the
//!   decoding sequences of a step in one call);
//! - `cpu.rs`: the attention read through the block tables in place on flex and ndarray;
//!   `cpu/sequence.rs` walks one sequence's rows through its table, `cpu/write.rs` writes a
//!   step's rows into a pool in place (f32, f16, or quantized to int8).

mod cache;
#[cfg(any(feature = "flex", feature = "ndarray"))]
mod cpu;
mod gathered;
mod prefix;
mod step;
mod store;

pub(crate) use cache::SequenceRows;
pub(crate) use cpu::{native_cached_attention, native_kernel_runs};
pub(crate) use step::{IN_PLACE_ROWS, StepHeads, sequence_rows};
pub(crate) use store::{BlockTensor, StoredBlocks};

pub use cache::{PagedCacheError, PagedKvCache, PagedKvCacheConfig, PromptMatch, SequenceId};
pub use prefix::Token;

/// Without a CPU backend compiled in, every paged step gathers its blocks.
#[cfg(not(any(feature = "flex", feature = "ndarray")))]
mod cpu {
    use burn::tensor::{Int, Tensor};

    use super::cache::{PagedKvCache, SequenceStep};
    use super::step::StepHeads;
    use crate::module::MultiHeadAttention;

    /// Where a step's row goes (read by the in-place writer only, not compiled here).
    #[derive(Debug, Clone, Copy)]
    #[allow(dead_code)]
    pub(crate) struct Slot {
        pub row: usize,
        pub block: usize,
        pub offset: usize,
    }

    /// What `native_write` did with the pool: without a CPU backend, always declined.
    pub(crate) enum PoolWrite<T = Tensor<4>> {
        #[allow(dead_code)]
        Written(T),
        Declined(T),
    }

    /// An int8 pool's tensors.
    pub(crate) struct Int8Blocks {
        pub values: Tensor<4, Int>,
        pub scales: Tensor<4>,
    }

    pub(crate) fn native_write(
        pool: Tensor<4>,
        _: &Tensor<4>,
        _: Vec<Slot>,
        _: super::store::BlockLayout,
    ) -> PoolWrite {
        PoolWrite::Declined(pool)
    }

    pub(crate) fn native_write_int8(
        pool: Int8Blocks,
        _: &Tensor<4>,
        _: Vec<Slot>,
        _: super::store::BlockLayout,
    ) -> PoolWrite<Int8Blocks> {
        PoolWrite::Declined(pool)
    }

    pub(crate) fn native_paged_attention(
        _: &MultiHeadAttention,
        _: &StepHeads,
        _: &[&SequenceStep],
        _: &PagedKvCache,
    ) -> Option<Tensor<4>> {
        None
    }

    pub(crate) fn native_kernel_runs(_: &MultiHeadAttention, _: &Tensor<4>) -> bool {
        false
    }

    pub(crate) fn native_cached_attention(
        _: &MultiHeadAttention,
        _: StepHeads,
        _: crate::cache::CompressedCache,
        _: Option<usize>,
        _: Option<&[usize]>,
    ) -> Option<Tensor<4>> {
        None
    }
}
