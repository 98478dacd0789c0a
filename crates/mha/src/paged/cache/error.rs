//! [`PagedCacheError`]: why a paged step or a sequence operation was refused.

use core::fmt;

use super::SequenceId;
use crate::cache::CacheOwner;

/// Why a paged step or a sequence operation was refused. No sequence is changed; a step of a
/// [`PagedTransformerCache`](crate::transformer::PagedTransformerCache) that a later layer
/// refuses ([`BeyondHalfRange`](Self::BeyondHalfRange)) may leave fewer blocks filed for later
/// prompts to share.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum PagedCacheError {
    /// The pool has too few free blocks for the step: no sequence's state was touched.
    PoolFull {
        /// The first sequence of the step whose blocks did not fit.
        sequence: SequenceId,
        /// Blocks the whole step needs.
        needed: usize,
        /// Blocks free now, counting those the pool may still grow by.
        free: usize,
    },
    /// The id is not (or no longer) a sequence of this cache.
    UnknownSequence(SequenceId),
    /// [`PagedKvCache::fork_prefix`](super::PagedKvCache::fork_prefix) asked for more
    /// positions than the sequence holds.
    PrefixTooLong {
        /// The sequence forked.
        sequence: SequenceId,
        /// Positions asked for.
        prefix: usize,
        /// Positions it holds.
        len: usize,
    },
    /// [`PagedKvCache::fork_prefix`](super::PagedKvCache::fork_prefix) or
    /// [`PagedKvCache::truncate`](super::PagedKvCache::truncate) asked for a prefix whose last
    /// positions the sequence no longer holds: they fell behind the module's sliding window
    /// and their blocks went back to the pool, and the prefix's next query would see them.
    PrefixReleased {
        /// The sequence forked.
        sequence: SequenceId,
        /// Positions asked for.
        prefix: usize,
        /// The first position the sequence holds
        /// ([`first_held`](super::PagedKvCache::first_held)).
        first_held: usize,
    },
    /// The cache's storage cannot live on this device (int8 where the backend has no i8, f16
    /// where it has no f16).
    Storage {
        /// What the device lacks.
        reason: String,
    },
    /// A new key or value of the step is beyond f16's range (±65504), which
    /// [`CacheStorage::Half`](crate::CacheStorage::Half) would store as an infinity.
    BeyondHalfRange {
        /// The largest magnitude among the step's new keys and values.
        largest: f32,
    },
    /// The cache holds keys and values of another attention module.
    OtherModule {
        /// The module that filled the cache.
        cached: CacheOwner,
        /// The module of this step.
        module: CacheOwner,
    },
}

impl fmt::Display for PagedCacheError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::PoolFull {
                sequence,
                needed,
                free,
            } => write!(
                f,
                "paged KV cache full: the step needs {needed} blocks ({sequence} did not fit), \
                 {free} are free; remove finished sequences or make the pool larger"
            ),
            Self::UnknownSequence(id) => {
                write!(f, "paged KV cache: {id} is not a sequence of this cache")
            }
            Self::PrefixTooLong {
                sequence,
                prefix,
                len,
            } => write!(
                f,
                "paged KV cache: fork_prefix: `prefix` is {prefix} positions, but {sequence} \
                 holds only {len}"
            ),
            Self::PrefixReleased {
                sequence,
                prefix,
                first_held,
            } => write!(
                f,
                "paged KV cache: the first {prefix} positions of {sequence} (`prefix`) cannot \
                 go on alone: their next query would see positions before {first_held}, which \
                 {sequence} gave back to the pool when they fell behind the module's sliding \
                 window"
            ),
            Self::Storage { reason } => write!(f, "paged KV cache storage: {reason}"),
            Self::BeyondHalfRange { largest } => write!(
                f,
                "paged KV cache: a new key or value of magnitude {largest} is beyond f16's range \
                 (65504), which CacheStorage::Half cannot hold; use CacheStorage::Float"
            ),
            Self::OtherModule { cached, module } => write!(
                f,
                "paged KV cache filled by another attention module ({cached}) than this step's \
                 ({module}); each layer needs its own cache"
            ),
        }
    }
}

impl core::error::Error for PagedCacheError {}
