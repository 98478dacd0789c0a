//! Planning a step of a [`PagedKvCache`]: the blocks each sequence's new rows take (a block
//! per block boundary crossed, a copy of a shared or filed partial block), drawn from the free
//! blocks and the pool's growth without changing anything, so that a step the pool cannot
//! hold is refused whole and a scheduler can ask beforehand
//! ([`PagedKvCache::blocks_needed`]).

use std::collections::BTreeMap;

use burn::tensor::Device;

use super::{
    BlockCopy, BlockTable, FreeBlocks, PagedCacheError, PagedKvCache, PagedStep, SequenceId,
    SequenceRows, SequenceStep,
};
use crate::cache::{CacheOwner, storage_unsupported};

/// What one sequence's part of a step takes from the pool.
struct PlannedSequence {
    table: BlockTable,
    copy: Option<BlockCopy>,
    unfile: Option<usize>,
    /// Blocks it needs.
    needed: usize,
    /// Whether the pool had them all.
    fits: bool,
}

/// A step as planned: each sequence's part, what it takes from the pool, the blocks it needs
/// (taken or not), and the first sequence the pool could not hold.
struct StepPlan {
    sequences: Vec<SequenceStep>,
    pool: PoolPlan,
    needed: usize,
    refused: Option<SequenceId>,
}

/// What a step takes from the pool, without copying its free lists: the free blocks it takes
/// from them, the blocks the pool grows by, and the blocks taken.
#[derive(Debug)]
pub(super) struct PoolPlan {
    /// Blocks taken from the end of the cache's unfiled free blocks.
    pub(super) free_taken: usize,
    /// Blocks taken from the front of its filed free blocks.
    pub(super) filed_taken: usize,
    /// Blocks the pool holds, grown for the step.
    pub(super) blocks: usize,
    max_blocks: usize,
    /// Blocks the pool's first growth reaches at least (`PagedKvCacheConfig::initial_blocks`).
    initial_blocks: usize,
    /// Blocks the pool grew by that the step has not taken, taken from the end.
    pub(super) grown: Vec<usize>,
    pub(super) taken: Vec<usize>,
}

impl PoolPlan {
    /// An unfiled block of `free` not taken yet, else one the pool grows by (doubling, from
    /// `initial_blocks` at least, up to its bound), else a filed one; `None` when the pool is
    /// full.
    fn take(&mut self, free: &FreeBlocks) -> Option<usize> {
        let block = if self.free_taken < free.unfiled.len() {
            self.free_taken += 1;
            free.unfiled[free.unfiled.len() - self.free_taken]
        } else {
            if self.grown.is_empty() && self.blocks < self.max_blocks {
                let grown = (2 * self.blocks)
                    .max(self.initial_blocks)
                    .clamp(self.blocks + 1, self.max_blocks);
                // Reversed, so that blocks are taken in increasing order.
                self.grown.extend((self.blocks..grown).rev());
                self.blocks = grown;
            }
            match self.grown.pop() {
                Some(block) => block,
                None => {
                    let block = *free.filed.get(self.filed_taken)?;
                    self.filed_taken += 1;
                    block
                }
            }
        };
        self.taken.push(block);
        Some(block)
    }
}

impl PagedKvCache {
    /// The blocks a step of `sequences` (one id per row, each sequence's rows consecutive, as
    /// [`MultiHeadAttention::forward_paged`](crate::MultiHeadAttention::forward_paged) takes
    /// them) would take from the pool: one per block boundary its sequences cross, and a copy
    /// of each partly filled last block they write into that another sequence holds or that
    /// is filed (copy-on-write). The step fits if and only if they are at most
    /// [`free_blocks`](Self::free_blocks), so that a scheduler can ask before it runs a step
    /// (vLLM's `can_append_slots`). Nothing changes.
    ///
    /// # Errors
    ///
    /// [`PagedCacheError::UnknownSequence`] if a sequence is not in the cache.
    ///
    /// # Panics
    ///
    /// If `sequences` names a sequence in two separate runs of rows.
    pub fn blocks_needed(&self, sequences: &[SequenceId]) -> Result<usize, PagedCacheError> {
        let runs = crate::paged::step::sequence_rows("PagedKvCache::blocks_needed", sequences);
        Ok(self.plan(&runs)?.needed)
    }

    /// Checks a step of `sequences`' new rows by `owner` (whose sliding `window`, if any, the
    /// sequences give back their blocks behind once the step is stored) on `device`, and
    /// allocates nothing: a refused step leaves the cache as it was.
    pub(crate) fn begin(
        &self,
        owner: CacheOwner,
        window: Option<usize>,
        sequences: &[SequenceRows],
        device: &Device,
    ) -> Result<PagedStep, PagedCacheError> {
        if let Some(cached) = self.owner
            && cached != owner
        {
            return Err(PagedCacheError::OtherModule {
                cached,
                module: owner,
            });
        }
        if let Some(reason) = storage_unsupported(self.config.storage, device) {
            return Err(PagedCacheError::Storage { reason });
        }
        let plan = self.plan(sequences)?;
        if let Some(sequence) = plan.refused {
            return Err(PagedCacheError::PoolFull {
                sequence,
                needed: plan.needed,
                free: self.free_blocks(),
            });
        }
        Ok(PagedStep {
            owner,
            sequences: plan.sequences,
            pool: plan.pool,
            window,
        })
    }

    /// The blocks a step of `sequences`' new rows takes, planned in order without changing
    /// anything.
    fn plan(&self, sequences: &[SequenceRows]) -> Result<StepPlan, PagedCacheError> {
        let mut pool = PoolPlan {
            free_taken: 0,
            filed_taken: 0,
            blocks: self.refcounts.len(),
            max_blocks: self.config.max_blocks,
            initial_blocks: self.config.initial_blocks,
            grown: Vec::new(),
            taken: Vec::new(),
        };
        // Copies-on-write of this step, per block copied from.
        let mut copied: BTreeMap<usize, u32> = BTreeMap::new();
        let (mut needed, mut refused) = (0, None);
        let mut steps = Vec::with_capacity(sequences.len());
        for SequenceRows { id, rows } in sequences {
            let table = self
                .sequences
                .get(id)
                .ok_or(PagedCacheError::UnknownSequence(*id))?;
            let planned = self.plan_sequence(table, rows.len(), &mut pool, &mut copied);
            needed += planned.needed;
            if !planned.fits {
                refused = refused.or(Some(*id));
            }
            steps.push(SequenceStep {
                id: *id,
                rows: rows.clone(),
                past: table.len,
                table: planned.table,
                copy: planned.copy,
                unfile: planned.unfile,
            });
        }
        Ok(StepPlan {
            sequences: steps,
            pool,
            needed,
            refused,
        })
    }

    /// The blocks `new` positions appended to `table` take from `pool`: a block per block
    /// boundary crossed, and a copy of a shared, partly filled last block (counted in `copied`,
    /// per block copied from: a block shared by `n` sequences is copied by the first `n - 1`
    /// that write into it, and the last writes in place).
    fn plan_sequence(
        &self,
        table: &BlockTable,
        new: usize,
        pool: &mut PoolPlan,
        copied: &mut BTreeMap<usize, u32>,
    ) -> PlannedSequence {
        let block_size = self.config.block_size;
        let past = table.len;
        let mut planned = PlannedSequence {
            table: BlockTable {
                len: past + new,
                ..table.clone()
            },
            copy: None,
            unfile: None,
            needed: 0,
            fits: true,
        };
        let partial_block =
            (!past.is_multiple_of(block_size) && new > 0).then(|| table.blocks[past / block_size]);
        // A partial block is copied before the write if another sequence still refers to it,
        // or if it is filed (whole for the sequence it was forked from, which may have left):
        // a filed block's positions must stay what its tokens say.
        let holders =
            |block: usize| self.refcounts[block] - copied.get(&block).copied().unwrap_or(0);
        let shared_partial_block =
            partial_block.filter(|&block| holders(block) > 1 || self.prefixes.is_filed(block));
        let new_blocks = planned.table.len.div_ceil(block_size) - table.blocks.len();
        planned.needed = new_blocks;
        if let Some(from) = shared_partial_block {
            let sole_holder = holders(from) == 1;
            // Counted whether or not the pool has the block, so that the sharers after this one
            // are counted as the step would run: the last one writing in place.
            *copied.entry(from).or_default() += 1;
            match pool.take(&self.free) {
                Some(to) => {
                    planned.needed += 1;
                    planned.copy = Some(BlockCopy { from, to });
                    *planned.table.blocks.last_mut().expect("a partial block") = to;
                }
                // Only the filing asks for the copy: without a block for it, the sequence loses
                // the cached prefix rather than its step.
                None if sole_holder => planned.unfile = Some(from),
                None => {
                    planned.needed += 1;
                    planned.fits = false;
                }
            }
        }
        for _ in 0..new_blocks {
            match pool.take(&self.free) {
                Some(block) => planned.table.blocks.push(block),
                None => planned.fits = false,
            }
        }
        planned
    }
}
