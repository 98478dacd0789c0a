//! Taking a stored step back, for the layers of a
//! [`PagedTransformerCache`](crate::transformer::PagedTransformerCache): a later layer may
//! refuse a step after the layers before it stored it (its keys beyond f16's range,
//! [`PagedCacheError::BeyondHalfRange`](super::PagedCacheError), or, where the layers' sliding
//! windows differ, a pool with fewer free blocks), and every layer must then be as it was: the
//! same sequences, and, where the layers are alike, the same block tables, free blocks and
//! filed prefixes.
//!
//! Bookkeeping is restored from what [`StepUndo`] kept. Block contents need restoring in one
//! case only: a block shared by several sequences of the step, copied by all but the last,
//! which wrote into it in place over positions that a sharer with more positions holds. The
//! copy of that sharer still has them, and is copied back. Every other write of a step lands in
//! positions no sequence holds once the step is taken back, except in filed blocks (taken from
//! the free ones, or a fork's filed partial block written in place): their filings cannot be
//! restored, so every layer forgets them ([`PagedKvCache::forget_overwritten`]).

use std::collections::BTreeMap;

use super::{BlockCopy, BlockTable, CacheOwner, PagedKvCache, PagedStep, SequenceId, UndoLog};

/// What one stored step changed in a [`PagedKvCache`], as far as taking it back needs: the
/// blocks it touched, not the whole pool's bookkeeping, so that keeping it costs a step what
/// the step costs.
#[derive(Debug, Clone)]
pub(super) struct StepUndo {
    /// The pool's size in blocks before the step grew it.
    pool_blocks: usize,
    /// The free blocks the step took from the end of the unfiled ones, in their order there.
    unfiled_taken: Vec<usize>,
    /// The free blocks it took from the front of the filed ones, in their order there.
    filed_taken: Vec<usize>,
    /// Blocks the pool grew by that the step left free (at the end of the unfiled ones).
    grown_left: usize,
    /// Every block the step took (free before it).
    taken: Vec<usize>,
    /// The shared blocks copied, each released once by its copier, in the step's order.
    copied_from: Vec<usize>,
    /// The tables of the step's sequences before it.
    tables: Vec<(SequenceId, BlockTable)>,
    /// The filed whole blocks of the step's sequences before it.
    filed_lens: Vec<(SequenceId, usize)>,
    /// The prefix index's last entry id before the step.
    last_entry: u64,
    owner: Option<CacheOwner>,
    window: Option<usize>,
    /// Shared blocks written in place, to copy back from a sharer's copy.
    restores: Vec<BlockCopy>,
    /// Filed blocks the step wrote into (their filings forgotten).
    pub overwritten_filings: Vec<usize>,
    /// Blocks the step filed under new entries.
    pub newly_filed: Vec<usize>,
    /// Blocks given back behind the window after the step, in order.
    pub released: Vec<usize>,
}

impl StepUndo {
    /// What `cache` holds before it stores `step`.
    pub fn before(cache: &PagedKvCache, step: &PagedStep) -> StepUndo {
        let tables = step
            .sequences
            .iter()
            .map(|sequence| (sequence.id, cache.sequences[&sequence.id].clone()))
            .collect();
        let filed_lens = step
            .sequences
            .iter()
            .map(|sequence| (sequence.id, cache.records[&sequence.id].filed.len()))
            .collect();
        let pool = &step.pool;
        let unfiled = &cache.free.unfiled;
        StepUndo {
            pool_blocks: cache.refcounts.len(),
            unfiled_taken: unfiled[unfiled.len() - pool.free_taken..].to_vec(),
            filed_taken: cache
                .free
                .filed
                .range(..pool.filed_taken)
                .copied()
                .collect(),
            grown_left: pool.grown.len(),
            taken: pool.taken.clone(),
            copied_from: step
                .sequences
                .iter()
                .filter_map(|sequence| Some(sequence.copy?.from))
                .collect(),
            tables,
            filed_lens,
            last_entry: cache.prefixes.last_id(),
            owner: cache.owner,
            window: cache.window,
            restores: restores(cache, step),
            overwritten_filings: Vec::new(),
            newly_filed: Vec::new(),
            released: Vec::new(),
        }
    }
}

/// For each shared block that the last of its sharers in `step` writes in place: a copy back
/// from the copy of the sharer that held the most positions, if it held more than the writer
/// (positions from the writer's first new one up to that sharer's end were overwritten).
fn restores(cache: &PagedKvCache, step: &PagedStep) -> Vec<BlockCopy> {
    // Per block copied from: the copier that held the most positions, and its copy.
    let mut longest_copier: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
    for sequence in &step.sequences {
        if let Some(BlockCopy { from, to }) = sequence.copy {
            let longest = longest_copier.entry(from).or_insert((sequence.past, to));
            if sequence.past > longest.0 {
                *longest = (sequence.past, to);
            }
        }
    }
    let block_size = cache.config.block_size;
    step.sequences
        .iter()
        .filter(|writer| writer.copy.is_none() && !writer.past.is_multiple_of(block_size))
        .filter_map(|writer| {
            let block = cache.sequences[&writer.id].blocks[writer.past / block_size];
            let &(past, copy) = longest_copier.get(&block)?;
            (past > writer.past).then_some(BlockCopy {
                from: copy,
                to: block,
            })
        })
        .collect()
}

impl PagedKvCache {
    /// Keeps what each step changes from now on, for [`take_back`](Self::take_back):
    /// the blocks it took and copied and its sequences' tables, until the next step.
    pub(crate) fn keep_undo(&mut self) {
        self.undo = UndoLog::On(None);
    }

    /// Takes back the last step stored by each of `stored` (the layers before the one that
    /// refused it; a cache alone is a stack of one), and has every layer, `stored` and `later`,
    /// forget the filings of the filed blocks any of them wrote into: the same blocks, in the
    /// same order, so that alike layers keep the same free lists, in the same order, and take
    /// the same blocks at later steps. Gives those blocks.
    ///
    /// # Panics
    ///
    /// If a cache of `stored` does not keep its steps ([`keep_undo`](Self::keep_undo)) or has
    /// no step to take back.
    pub(crate) fn take_back(stored: &mut [PagedKvCache], later: &mut [PagedKvCache]) -> Vec<usize> {
        let mut overwritten: Vec<usize> = Vec::new();
        for cache in stored.iter_mut() {
            for block in cache.undo_last_step() {
                if !overwritten.contains(&block) {
                    overwritten.push(block);
                }
            }
        }
        for cache in stored.iter_mut().chain(later) {
            cache.forget_overwritten(&overwritten);
        }
        overwritten
    }

    /// Takes back the last step stored: every sequence holds the positions and blocks it held
    /// before it, with what they held. Gives the filed blocks the step wrote into, in the order
    /// it took them, whose filings the cache still holds: they no longer hold what they were
    /// filed under, and [`take_back`](Self::take_back) has every layer forget them.
    fn undo_last_step(&mut self) -> Vec<usize> {
        let UndoLog::On(last) = &mut self.undo else {
            panic!("PagedKvCache::take_back: the cache keeps no steps");
        };
        let undo = *last.take().expect("a stored step to take back");
        if !undo.restores.is_empty() {
            let (mut key, mut value) = (self.key.take(), self.value.take());
            for &BlockCopy { from, to } in &undo.restores {
                key = key.map(|store| store.with_block_copied(from, to));
                value = value.map(|store| store.with_block_copied(from, to));
            }
            (self.key, self.value) = (key, value);
        }
        for &block in &undo.newly_filed {
            self.prefixes.forget(block);
        }
        self.prefixes.rewind_ids(undo.last_entry);
        self.restore_pool(&undo);
        self.sequences.extend(undo.tables);
        for (id, filed) in undo.filed_lens {
            let record = self.records.get_mut(&id).expect("a sequence of the step");
            record.filed.truncate(filed);
        }
        (self.owner, self.window) = (undo.owner, undo.window);
        if self.owner.is_none() {
            // The step was the first: the next may be another module's, of other shapes.
            (self.key, self.value) = (None, None);
        }
        undo.overwritten_filings
    }

    /// The reference counts and free blocks as they were before the step `undo` recorded, in
    /// the reverse order of the step's changes (`store`).
    fn restore_pool(&mut self, undo: &StepUndo) {
        // Released behind the window after the copies' releases: taken back before them.
        for &block in undo
            .released
            .iter()
            .rev()
            .chain(undo.copied_from.iter().rev())
        {
            self.unrelease(block);
        }
        let free = &mut self.free;
        for &block in &undo.taken {
            self.refcounts[block] = 0;
        }
        free.unfiled.truncate(free.unfiled.len() - undo.grown_left);
        free.unfiled.extend(&undo.unfiled_taken);
        for &block in undo.filed_taken.iter().rev() {
            free.filed.push_front(block);
        }
        self.refcounts.truncate(undo.pool_blocks);
    }

    /// Takes back the last release of `block`: a sequence refers to it again.
    fn unrelease(&mut self, block: usize) {
        if self.refcounts[block] == 0 {
            // Released last, onto the back of one of the free lists.
            let free = &mut self.free;
            if free.filed.back() == Some(&block) {
                free.filed.pop_back();
            } else {
                assert_eq!(free.unfiled.pop(), Some(block), "a released block is free");
            }
        }
        self.refcounts[block] += 1;
    }

    /// Forgets the filings of `blocks` (written by a step that another layer took back); those
    /// no sequence refers to become free blocks nothing can share, at the end of the unfiled
    /// ones in the order of `blocks`. A block forgotten already is left where it is.
    pub(crate) fn forget_overwritten(&mut self, blocks: &[usize]) {
        for &block in blocks {
            self.prefixes.forget(block);
            if let Some(at) = self.free.filed.iter().position(|&free| free == block) {
                self.free.filed.remove(at);
                self.free.unfiled.push(block);
            }
        }
    }

    /// Whether the two caches' bookkeeping (sequences, tables, reference counts, free blocks,
    /// prefix index) is the same.
    #[cfg(test)]
    pub(crate) fn same_bookkeeping(&self, other: &PagedKvCache) -> bool {
        self.refcounts == other.refcounts
            && self.free == other.free
            && self.sequences == other.sequences
            && self.records == other.records
            && self.prefixes == other.prefixes
            && self.next_id == other.next_id
            && self.owner == other.owner
            && self.window == other.window
    }
}
