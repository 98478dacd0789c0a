//! [`PagedKvCacheConfig`]: a paged cache's bound, block size, storage and first allocation.

use std::collections::BTreeMap;

use super::{FreeBlocks, PagedKvCache, UndoLog};
use crate::cache::CacheStorage;
use crate::paged::prefix::PrefixIndex;

/// The configuration of a [`PagedKvCache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedKvCacheConfig {
    /// Blocks the pool holds at most, all sequences together: the cache's memory bound. A step
    /// that would need more is refused with
    /// [`PagedCacheError::PoolFull`](super::PagedCacheError::PoolFull). The pool grows by
    /// doubling as steps need blocks: a growth allocates the larger pool and copies the blocks
    /// into it while the old pool is still held, so that its last growth holds one and a half
    /// to two times the bytes of `max_blocks` blocks for a moment (size `max_blocks` with that
    /// headroom where memory is tight, or allocate the whole pool at once with
    /// [`initial_blocks`](Self::initial_blocks)).
    pub max_blocks: usize,
    /// Blocks the pool allocates when it is first needed (the first step that stores keys and
    /// values, when the module's head sizes and the device are known), at most `max_blocks`;
    /// it grows by doubling from there. Default: 0, as many as the first step takes.
    /// `max_blocks` allocates the whole pool at once, as a server does: no later step grows
    /// the pool (a growth copies every block, a pause in the middle of decoding) and its
    /// memory never exceeds that of `max_blocks` blocks; the blocks are held from the first
    /// step on, used or not.
    pub initial_blocks: usize,
    /// Positions per block. Default: 16 (vLLM's). A sequence wastes at most `block_size - 1`
    /// positions of its last block, and prompts share whole blocks only. On CPUs with AVX-512
    /// blocks of 64 decode faster: the kernel reads a block of 64 as one part of 64 positions
    /// (one softmax update, each query feature's broadcast over four vectors of keys), where
    /// it reads blocks of 16 one at a time (see `docs/benchmarks.md`).
    pub block_size: usize,
    /// How keys and values are stored. Default: [`CacheStorage::Float`].
    pub storage: CacheStorage,
}

impl PagedKvCacheConfig {
    /// A pool of at most `max_blocks` blocks of 16 positions in float storage.
    pub fn new(max_blocks: usize) -> Self {
        Self {
            max_blocks,
            initial_blocks: 0,
            block_size: 16,
            storage: CacheStorage::Float,
        }
    }

    /// The same pool allocating `blocks` blocks when it is first needed
    /// ([`initial_blocks`](Self::initial_blocks); `max_blocks` for the whole pool at once).
    pub fn with_initial_blocks(mut self, blocks: usize) -> Self {
        self.initial_blocks = blocks;
        self
    }

    /// The same pool with `block_size` positions per block.
    pub fn with_block_size(mut self, block_size: usize) -> Self {
        self.block_size = block_size;
        self
    }

    /// The same pool storing keys and values as `storage` says.
    pub fn with_storage(mut self, storage: CacheStorage) -> Self {
        self.storage = storage;
        self
    }

    /// An empty cache. Its pool is allocated on the first step (when the module's head sizes
    /// and the device are known), `initial_blocks` or those the step takes, and grows by
    /// doubling up to `max_blocks`.
    ///
    /// # Panics
    ///
    /// If `max_blocks` or `block_size` is 0, or `initial_blocks` exceeds `max_blocks`.
    pub fn init(&self) -> PagedKvCache {
        assert!(
            self.max_blocks > 0 && self.block_size > 0,
            "PagedKvCacheConfig: `max_blocks` ({}) and `block_size` ({}) must be positive",
            self.max_blocks,
            self.block_size
        );
        assert!(
            self.initial_blocks <= self.max_blocks,
            "PagedKvCacheConfig: `initial_blocks` ({}) must be at most `max_blocks` ({})",
            self.initial_blocks,
            self.max_blocks
        );
        PagedKvCache {
            config: *self,
            key: None,
            value: None,
            undo: UndoLog::Off,
            refcounts: Vec::new(),
            free: FreeBlocks::default(),
            sequences: BTreeMap::new(),
            records: BTreeMap::new(),
            prefixes: PrefixIndex::default(),
            next_id: 0,
            owner: None,
            window: None,
        }
    }
}
