//! [`PagedKvCache`]: the keys and values of many sequences in one bounded pool of fixed-size
//! blocks, a block table per sequence (vLLM's PagedAttention layout), blocks shared between
//! sequences by reference count and copied on the first write that would change a shared one,
//! and whole blocks found again by the tokens they hold (`prefix.rs`).

use core::fmt;
use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;

use burn::tensor::Tensor;

use super::prefix::{PrefixIndex, Token, TokenRecord};
use super::store::{BlockLayout, BlockStore, RowsWrite};
use crate::cache::CacheOwner;

mod config;
mod error;
mod plan;
mod undo;

pub use config::PagedKvCacheConfig;
pub use error::PagedCacheError;
use undo::StepUndo;

/// One sequence of a [`PagedKvCache`], as [`PagedKvCache::add_sequence`] and
/// [`PagedKvCache::fork`] hand it out. Ids are never reused by a cache; an id names a sequence
/// of the cache that made it (another cache may have a sequence of the same number).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SequenceId(u64);

impl SequenceId {
    /// The id's number (in the order the cache handed the ids out).
    pub fn index(self) -> u64 {
        self.0
    }
}

impl fmt::Display for SequenceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sequence {}", self.0)
    }
}

/// A sequence added by [`PagedKvCache::add_sequence_with_prompt`]: its id, and the positions
/// of its prompt the cache holds already (shared whole blocks of an earlier sequence's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptMatch {
    /// The new sequence.
    pub id: SequenceId,
    /// Positions stored: the next step feeds the prompt's rows from this one on.
    pub cached: usize,
}

/// Keys and values of many sequences in one bounded pool of blocks of `block_size` positions
/// (values `[blocks, n_kv_heads, block_size, head_dim]`, keys feature-major, `[blocks,
/// n_kv_heads, head_dim, block_size]`, as vLLM's key cache is), with a block table per
/// sequence. Sequences
/// join ([`add_sequence`](Self::add_sequence), [`fork`](Self::fork),
/// [`fork_prefix`](Self::fork_prefix)) and leave ([`remove_sequence`](Self::remove_sequence),
/// whose blocks go back to the pool at once) between any two steps of
/// [`MultiHeadAttention::forward_paged`](crate::MultiHeadAttention::forward_paged), which
/// decodes and prefills any mix of them in one call.
///
/// A forked sequence shares its parent's blocks (reference-counted); the first step that writes
/// into a shared, partly filled block copies it first (copy-on-write), so a common prompt is
/// stored once however many sequences continue it.
///
/// ```
/// use burn::tensor::{Device, Distribution, Tensor};
/// use mha::{MultiHeadAttentionConfig, PagedKvCacheConfig};
///
/// let device = Device::flex();
/// let attention = MultiHeadAttentionConfig::new(16, 4).init(&device);
/// let mut cache = PagedKvCacheConfig::new(64).init();
/// let (a, b) = (cache.add_sequence(), cache.add_sequence());
/// // A prompt of 3 tokens for `a` and one of 2 for `b`, in one step.
/// let prompts = Tensor::<2>::random([5, 16], Distribution::Default, &device);
/// attention.forward_paged(prompts, &mut cache, &[a, a, a, b, b]).unwrap();
/// // One decoding step for both.
/// let next = Tensor::<2>::random([2, 16], Distribution::Default, &device);
/// let output = attention.forward_paged(next, &mut cache, &[a, b]).unwrap();
/// assert_eq!(output.dims(), [2, 16]);
/// assert_eq!((cache.len(a), cache.len(b)), (Some(4), Some(3)));
/// ```
#[derive(Debug, Clone)]
pub struct PagedKvCache {
    config: PagedKvCacheConfig,
    /// The key blocks, once a step stored some.
    key: Option<BlockStore>,
    /// The value blocks.
    value: Option<BlockStore>,
    /// Sequences referring to each block the pool holds (0 = free); its length is the pool's
    /// size in blocks (its tensors may hold more: `undo.rs`).
    refcounts: Vec<u32>,
    /// The blocks of the pool no sequence refers to.
    free: FreeBlocks,
    sequences: BTreeMap<SequenceId, BlockTable>,
    /// The tokens each sequence's positions hold, as far as they were told.
    records: BTreeMap<SequenceId, TokenRecord>,
    /// Whole blocks by the tokens they hold, in use or free.
    prefixes: PrefixIndex,
    next_id: u64,
    /// The module whose keys and values the cache holds, once a step stored some.
    owner: Option<CacheOwner>,
    /// That module's sliding window, behind which sequences give their blocks back.
    window: Option<usize>,
    /// What the last step changed, kept only for a layer of a [`PagedTransformerCache`]
    /// (`undo.rs`), so that the stack can take a step back that a later layer refused.
    ///
    /// [`PagedTransformerCache`]: crate::transformer::PagedTransformerCache
    undo: UndoLog,
}

/// Whether a cache keeps what its last step changed, and that record.
#[derive(Debug, Clone, Default)]
enum UndoLog {
    /// Nothing is kept (a cache of one module).
    #[default]
    Off,
    /// Kept; `None` before the first step and once taken back.
    On(Option<Box<StepUndo>>),
}

/// Where one sequence's positions live: position `p` is at offset `p % block_size` of block
/// `blocks[p / block_size]`, from the first block it still holds on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct BlockTable {
    /// A block per started block of positions; [`RELEASED`] for the first `released`.
    pub blocks: Vec<usize>,
    /// Positions stored.
    pub len: usize,
    /// Leading blocks given back to the pool because every position in them lies behind the
    /// module's sliding window for every query the sequence will still run
    /// ([`PagedKvCache::release_behind_window`]).
    pub released: usize,
}

/// What a block table holds in place of a block it gave back: no pool has a block of that
/// number, so a read through it panics instead of reading another sequence's positions.
pub(crate) const RELEASED: usize = usize::MAX;

impl BlockTable {
    /// The blocks the sequence holds, from its first not given back.
    pub fn held(&self) -> &[usize] {
        &self.blocks[self.released..]
    }

    /// The first position whose keys and values the sequence holds.
    pub fn first_held(&self, block_size: usize) -> usize {
        self.released * block_size
    }
}

/// A sequence's rows in one step: rows `rows` of the step's input are its new tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SequenceRows {
    pub id: SequenceId,
    pub rows: Range<usize>,
}

/// One sequence's part of a checked step: the positions it held before and its table once the
/// step's blocks are allocated.
#[derive(Debug, Clone)]
pub(crate) struct SequenceStep {
    pub id: SequenceId,
    pub rows: Range<usize>,
    /// Positions stored before the step (the first new token's position).
    pub past: usize,
    /// The table after the step: blocks for `past + rows.len()` positions.
    pub table: BlockTable,
    /// A shared, partly filled last block copied into a block of its own before the write.
    copy: Option<BlockCopy>,
    /// A filed, partly filled last block this sequence alone holds, written in place because
    /// the pool had no block to copy it into: its filing is forgotten.
    unfile: Option<usize>,
}

/// A copy-on-write: block `from` copied into block `to`.
#[derive(Debug, Clone, Copy)]
struct BlockCopy {
    from: usize,
    to: usize,
}

/// A checked step: every sequence's new table, and the blocks it takes from the pool.
#[derive(Debug)]
pub(crate) struct PagedStep {
    pub owner: CacheOwner,
    pub sequences: Vec<SequenceStep>,
    pool: plan::PoolPlan,
    /// The module's sliding window: after the step, each sequence gives back its blocks wholly
    /// behind it.
    window: Option<usize>,
}

/// The blocks of the pool no sequence refers to: those whose positions nothing can share,
/// and those still filed by their tokens, which a later prompt may share. A step takes the
/// first kind first, then grows the pool, and only then overwrites filed blocks, the least
/// recently freed first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct FreeBlocks {
    /// Taken from the end.
    unfiled: Vec<usize>,
    /// Taken from the front, freed to the back.
    filed: VecDeque<usize>,
}

impl FreeBlocks {
    fn len(&self) -> usize {
        self.unfiled.len() + self.filed.len()
    }
}

impl PagedKvCache {
    /// The configuration the cache was made with.
    pub fn config(&self) -> PagedKvCacheConfig {
        self.config
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.config.block_size
    }

    /// A new, empty sequence.
    pub fn add_sequence(&mut self) -> SequenceId {
        let id = SequenceId(self.next_id);
        self.next_id += 1;
        self.sequences.insert(id, BlockTable::default());
        self.records.insert(id, TokenRecord::default());
        id
    }

    /// A new sequence whose positions will hold `prompt`'s tokens, sharing the whole blocks of
    /// the longest prefix of `prompt` that the cache holds already (filed by sequences told
    /// their tokens, in use or freed and not yet taken again): the returned
    /// [`PromptMatch::cached`] positions are stored, and the next step feeds the rows of
    /// `prompt[cached..]`. At least the last token is left to compute, so that the step gives
    /// its output.
    ///
    /// Sharing is sound only if every sequence told its tokens is fed, row by row, what those
    /// tokens give, through the same weights: the cache compares tokens, not keys.
    pub fn add_sequence_with_prompt(&mut self, prompt: &[Token]) -> PromptMatch {
        self.add_sequence_matching(prompt, usize::MAX)
    }

    /// Tells the cache the tokens of `id`'s next positions, from the first it was not told
    /// (the tokens a step fed or will feed, such as those sampled): its whole blocks of known
    /// tokens can then be shared by [`add_sequence_with_prompt`](Self::add_sequence_with_prompt).
    ///
    /// # Errors
    ///
    /// [`PagedCacheError::UnknownSequence`] if `id` is not a sequence of this cache.
    pub fn extend_tokens(
        &mut self,
        id: SequenceId,
        tokens: &[Token],
    ) -> Result<(), PagedCacheError> {
        self.records
            .get_mut(&id)
            .ok_or(PagedCacheError::UnknownSequence(id))?
            .tokens
            .extend_from_slice(tokens);
        self.file_whole_blocks(id);
        Ok(())
    }

    /// Whole blocks of `prompt` the cache holds, at most all but its last token's.
    pub(crate) fn matched_blocks(&self, prompt: &[Token]) -> usize {
        let block_size = self.config.block_size;
        self.prefixes
            .matching(
                prompt,
                block_size,
                Self::prompt_block_limit(prompt, block_size),
            )
            .len()
    }

    /// The most whole blocks of `prompt` a sequence may share: all but its last token's, so
    /// that a step computes at least that token.
    fn prompt_block_limit(prompt: &[Token], block_size: usize) -> usize {
        prompt.len().saturating_sub(1) / block_size
    }

    /// [`add_sequence_with_prompt`](Self::add_sequence_with_prompt) sharing at most `blocks`
    /// of `prompt`'s whole blocks (the fewest any layer of a stack holds).
    pub(crate) fn add_sequence_matching(&mut self, prompt: &[Token], blocks: usize) -> PromptMatch {
        let block_size = self.config.block_size;
        let limit = blocks.min(Self::prompt_block_limit(prompt, block_size));
        let matched = self.prefixes.matching(prompt, block_size, limit);
        for block in matched.iter().map(|matched| matched.block) {
            if self.refcounts[block] == 0 {
                let filed = &mut self.free.filed;
                let at = filed.iter().position(|&free| free == block);
                filed.remove(at.expect("a filed block no sequence refers to is free"));
            }
            self.refcounts[block] += 1;
        }
        let id = self.add_sequence();
        let cached = matched.len() * block_size;
        self.sequences.insert(
            id,
            BlockTable {
                blocks: matched.iter().map(|matched| matched.block).collect(),
                len: cached,
                released: 0,
            },
        );
        self.records.insert(
            id,
            TokenRecord {
                tokens: prompt.to_vec(),
                filed: matched.iter().map(|matched| matched.entry).collect(),
            },
        );
        PromptMatch { id, cached }
    }

    /// Files `id`'s whole blocks of known tokens that are not filed yet, and gives the blocks
    /// filed under new entries.
    fn file_whole_blocks(&mut self, id: SequenceId) -> Vec<usize> {
        let block_size = self.config.block_size;
        let mut newly_filed = Vec::new();
        let (Some(table), Some(record)) = (self.sequences.get(&id), self.records.get_mut(&id))
        else {
            return newly_filed;
        };
        let known = table.len.min(record.tokens.len()) / block_size;
        while record.filed.len() < known {
            let index = record.filed.len();
            if index < table.released {
                // Given back before its tokens were told: another sequence may hold it now.
                break;
            }
            let tokens = &record.tokens[index * block_size..][..block_size];
            let block = table.blocks[index];
            let was_filed = self.prefixes.is_filed(block);
            let filed = self.prefixes.file(record.last_entry(), tokens, block);
            // `None`: the block is filed under other tokens (a fork told tokens its shared
            // blocks do not hold); what it holds stays filed as it was.
            let Some(entry) = filed else { break };
            record.filed.push(entry);
            if !was_filed && self.prefixes.is_filed(block) {
                newly_filed.push(block);
            }
        }
        newly_filed
    }

    /// Removes a sequence; the blocks no other sequence shares are free at once.
    ///
    /// # Errors
    ///
    /// [`PagedCacheError::UnknownSequence`] if `id` is not a sequence of this cache.
    pub fn remove_sequence(&mut self, id: SequenceId) -> Result<(), PagedCacheError> {
        let table = self
            .sequences
            .remove(&id)
            .ok_or(PagedCacheError::UnknownSequence(id))?;
        self.records.remove(&id);
        for &block in table.held() {
            self.release_block(block);
        }
        Ok(())
    }

    /// A new sequence that continues `id` as it is now (beam search, parallel sampling): it
    /// shares every block, and the two part at their next writes. Of the tokens `id` was told
    /// ([`extend_tokens`](Self::extend_tokens), a prompt), the fork keeps those of the
    /// positions it holds: tokens told ahead of a step (a prompt not yet fed) are `id`'s own.
    ///
    /// # Errors
    ///
    /// [`PagedCacheError::UnknownSequence`] if `id` is not a sequence of this cache.
    pub fn fork(&mut self, id: SequenceId) -> Result<SequenceId, PagedCacheError> {
        let len = self.len(id).ok_or(PagedCacheError::UnknownSequence(id))?;
        self.fork_prefix(id, len)
    }

    /// A new sequence holding the first `prefix` positions of `id` (a shared prompt), sharing
    /// their blocks, and the tokens `id` was told of them.
    ///
    /// # Errors
    ///
    /// [`PagedCacheError::UnknownSequence`] if `id` is not a sequence of this cache,
    /// [`PagedCacheError::PrefixTooLong`] if it holds fewer than `prefix` positions,
    /// [`PagedCacheError::PrefixReleased`] if the fork's next query would see positions that
    /// `id` gave back behind the module's sliding window
    /// ([`first_held`](Self::first_held)).
    pub fn fork_prefix(
        &mut self,
        id: SequenceId,
        prefix: usize,
    ) -> Result<SequenceId, PagedCacheError> {
        self.check_prefix(id, prefix)?;
        let table = &self.sequences[&id];
        let block_size = self.config.block_size;
        let blocks = table.blocks[..prefix.div_ceil(block_size)].to_vec();
        let released = table.released.min(blocks.len());
        for &block in &blocks[released..] {
            self.refcounts[block] += 1;
        }
        let record = self.records[&id].prefix(prefix, block_size);
        let forked = self.add_sequence();
        self.sequences.insert(
            forked,
            BlockTable {
                blocks,
                len: prefix,
                released,
            },
        );
        self.records.insert(forked, record);
        Ok(forked)
    }

    /// Cuts `id` back to its first `len` positions, as if its later steps had not run: draft
    /// tokens a speculative step rejected, or a reply regenerated from some point. The blocks
    /// past them go back to the pool at once (or to their other sharers), and the tokens it
    /// was told past them are forgotten. A `len` at or past its length changes nothing. The
    /// next step writes from position `len` on, into a copy of the last block if another
    /// sequence shares it or later prompts may (filed).
    ///
    /// # Errors
    ///
    /// [`PagedCacheError::UnknownSequence`] if `id` is not a sequence of this cache,
    /// [`PagedCacheError::PrefixReleased`] if the query at position `len` would see positions
    /// `id` gave back behind the module's sliding window; `id` is then unchanged.
    pub fn truncate(&mut self, id: SequenceId, len: usize) -> Result<(), PagedCacheError> {
        self.check_truncate(id, len)?;
        if self.len(id).is_some_and(|held| len >= held) {
            return Ok(());
        }
        let block_size = self.config.block_size;
        let table = self.sequences.get_mut(&id).expect("a sequence checked");
        let kept = len.div_ceil(block_size);
        // Given back already: the blocks before `released`, all kept unless `len` is 0.
        let dropped: Vec<usize> = table.blocks.split_off(kept.max(table.released));
        table.blocks.truncate(kept);
        table.released = table.released.min(kept);
        table.len = len;
        let record = self.records.get_mut(&id).expect("a sequence's record");
        *record = record.prefix(len, block_size);
        for block in dropped {
            self.release_block(block);
        }
        Ok(())
    }

    /// The refusal [`truncate`](Self::truncate) would give, if any: a cut that changes nothing
    /// is never refused.
    pub(crate) fn check_truncate(&self, id: SequenceId, len: usize) -> Result<(), PagedCacheError> {
        match self.len(id) {
            None => Err(PagedCacheError::UnknownSequence(id)),
            Some(held) if len >= held => Ok(()),
            Some(_) => self.check_prefix(id, len),
        }
    }

    /// The refusal [`fork_prefix`](Self::fork_prefix) (or [`truncate`](Self::truncate)) would
    /// give for a sequence of `id`'s first `prefix` positions, if any.
    pub(crate) fn check_prefix(
        &self,
        id: SequenceId,
        prefix: usize,
    ) -> Result<(), PagedCacheError> {
        let table = self
            .sequences
            .get(&id)
            .ok_or(PagedCacheError::UnknownSequence(id))?;
        if prefix > table.len {
            return Err(PagedCacheError::PrefixTooLong {
                sequence: id,
                prefix,
                len: table.len,
            });
        }
        // What the prefix reads next: the positions its next query (at `prefix`) sees before
        // its own, and a partly filled last block, which its next step writes into.
        let block_size = self.config.block_size;
        let seen = self
            .window
            .map_or(0, |window| (prefix + 1).saturating_sub(window));
        let partial_block = prefix / block_size * block_size;
        let needed = seen.min(partial_block)..prefix;
        let first_held = table.first_held(block_size);
        if !needed.is_empty() && needed.start < first_held {
            return Err(PagedCacheError::PrefixReleased {
                sequence: id,
                prefix,
                first_held,
            });
        }
        Ok(())
    }

    /// The tokens `id` was told ([`add_sequence_with_prompt`](Self::add_sequence_with_prompt),
    /// [`extend_tokens`](Self::extend_tokens), those of the positions a fork took over), token
    /// `i` the one at position `i`; they run ahead of the positions it holds
    /// ([`len`](Self::len)) until a step feeds them. `None` if `id` is not a sequence of this
    /// cache.
    pub fn tokens(&self, id: SequenceId) -> Option<&[Token]> {
        self.records.get(&id).map(|record| record.tokens.as_slice())
    }

    /// Positions `id` holds, or `None` if it is not a sequence of this cache.
    pub fn len(&self, id: SequenceId) -> Option<usize> {
        self.sequences.get(&id).map(|table| table.len)
    }

    /// The first of `id`'s positions whose keys and values the cache still holds: 0, or under
    /// a module with a sliding `window` the first position of the first block not wholly
    /// behind the window of `id`'s next query (position [`len`](Self::len)). The blocks before
    /// it went back to the pool after the step that left them behind. `None` if `id` is not a
    /// sequence of this cache.
    pub fn first_held(&self, id: SequenceId) -> Option<usize> {
        let block_size = self.config.block_size;
        self.sequences
            .get(&id)
            .map(|table| table.first_held(block_size))
    }

    /// The sequences of the cache, in the order they were added.
    pub fn sequences(&self) -> impl Iterator<Item = SequenceId> + '_ {
        self.sequences.keys().copied()
    }

    /// Whether the cache has no sequence.
    pub fn is_empty(&self) -> bool {
        self.sequences.is_empty()
    }

    /// Blocks some sequence refers to (a shared block counted once).
    pub fn blocks_in_use(&self) -> usize {
        self.refcounts.len() - self.free.len()
    }

    /// Blocks a step may still take: the pool's free ones and those it may grow by.
    pub fn free_blocks(&self) -> usize {
        // In this order: `max_blocks` may be as large as `usize::MAX`.
        self.config.max_blocks - self.refcounts.len() + self.free.len()
    }

    /// Blocks the pool has allocated (in use or free), at most `max_blocks`.
    pub fn reserved_blocks(&self) -> usize {
        self.refcounts.len()
    }

    /// Bytes one block takes, keys and values together; 0 before the first step.
    pub fn block_bytes(&self) -> usize {
        [&self.key, &self.value]
            .into_iter()
            .flatten()
            .map(BlockStore::block_bytes)
            .sum()
    }

    /// Bytes of the blocks in use: within one block per sequence of the positions held (from
    /// [`first_held`](Self::first_held) on).
    pub fn bytes_in_use(&self) -> usize {
        self.blocks_in_use() * self.block_bytes()
    }

    /// Bytes the pool has allocated: those of [`reserved_blocks`](Self::reserved_blocks), or
    /// more in a layer of a stack that took back a step that grew the pool (its tensors keep
    /// the blocks until a later step takes them).
    pub fn reserved_bytes(&self) -> usize {
        let allocated = self.key.as_ref().map_or(0, BlockStore::blocks);
        allocated.max(self.reserved_blocks()) * self.block_bytes()
    }

    #[cfg(test)]
    fn table(&self, id: SequenceId) -> Option<&BlockTable> {
        self.sequences.get(&id)
    }

    pub(crate) fn stores(&self) -> Option<(&BlockStore, &BlockStore)> {
        self.key.as_ref().zip(self.value.as_ref())
    }

    /// Blocks filed by their tokens (in use or free), which later prompts may share.
    pub fn filed_blocks(&self) -> usize {
        self.prefixes.len()
    }

    /// Gives back to the pool `id`'s leading blocks that lie wholly behind the window of its
    /// next query (at position `len`): no later query of the sequence sees them, since each
    /// sees the `window` positions up to its own. Gives the blocks released, in order.
    ///
    /// The step that left them behind reads them still: its attention reads through the
    /// step's own tables, and nothing writes to the pool between the store and the reads.
    fn release_behind_window(&mut self, id: SequenceId) -> Vec<usize> {
        let (Some(window), Some(table)) = (self.window, self.sequences.get_mut(&id)) else {
            return Vec::new();
        };
        let behind = (table.len + 1).saturating_sub(window) / self.config.block_size;
        let mut released = Vec::new();
        while table.released < behind {
            released.push(std::mem::replace(
                &mut table.blocks[table.released],
                RELEASED,
            ));
            table.released += 1;
        }
        for &block in &released {
            self.release_block(block);
        }
        released
    }

    fn release_block(&mut self, block: usize) {
        self.refcounts[block] -= 1;
        if self.refcounts[block] == 0 {
            if self.prefixes.is_filed(block) {
                self.free.filed.push_back(block);
            } else {
                self.free.unfiled.push(block);
            }
        }
    }

    /// Takes the step's blocks, copies the shared blocks it writes into, and stores the new
    /// keys and values (`[1, n_kv_heads, rows, head_dim]`, the step's rows in order).
    pub(crate) fn store(&mut self, step: &PagedStep, key: &Tensor<4>, value: &Tensor<4>) {
        let mut undo = matches!(self.undo, UndoLog::On(_)).then(|| StepUndo::before(self, step));
        let [_, n_kv_heads, _, head_dim] = key.dims();
        let value_dim = value.dims()[3];
        let (config, pool) = (self.config, &step.pool);
        let store = |side: BlockLayout, dim: usize, like: &Tensor<4>| {
            let options = (&like.device(), like.dtype());
            BlockStore::new(config, side, (n_kv_heads, dim), options)
        };
        let mut key_store = self
            .key
            .take()
            .unwrap_or_else(|| store(BlockLayout::FeatureMajor, head_dim, key))
            .grown(pool.blocks);
        let mut value_store = self
            .value
            .take()
            .unwrap_or_else(|| store(BlockLayout::PositionMajor, value_dim, value))
            .grown(pool.blocks);
        self.refcounts.resize(pool.blocks, 0);
        let unfiled = &mut self.free.unfiled;
        unfiled.truncate(unfiled.len() - pool.free_taken);
        unfiled.extend(&pool.grown);
        self.free.filed.drain(..pool.filed_taken);
        for &block in &pool.taken {
            self.refcounts[block] = 1;
            // Written now: what it held can no longer be shared.
            if let Some(undo) = &mut undo
                && self.prefixes.is_filed(block)
            {
                undo.overwritten_filings.push(block);
            }
            self.prefixes.forget(block);
        }
        // The copies first, so that each reads its block as it was before the step, even the
        // one its last sharer writes in place in this step.
        for sequence in &step.sequences {
            if let Some(BlockCopy { from, to }) = sequence.copy {
                key_store = key_store.with_block_copied(from, to);
                value_store = value_store.with_block_copied(from, to);
                self.release_block(from);
            }
        }
        for block in step.sequences.iter().filter_map(|sequence| sequence.unfile) {
            if let Some(undo) = &mut undo {
                undo.overwritten_filings.push(block);
            }
            self.prefixes.forget(block);
        }
        let writes: Vec<RowsWrite> = step
            .sequences
            .iter()
            .map(|sequence| RowsWrite {
                table: &sequence.table,
                past: sequence.past,
                rows: sequence.rows.clone(),
            })
            .collect();
        self.key = Some(key_store.written_all(&writes, key));
        self.value = Some(value_store.written_all(&writes, value));
        for sequence in &step.sequences {
            self.sequences.insert(sequence.id, sequence.table.clone());
        }
        self.owner = Some(step.owner);
        self.window = step.window;
        for sequence in &step.sequences {
            let filed = self.file_whole_blocks(sequence.id);
            let released = self.release_behind_window(sequence.id);
            if let Some(undo) = &mut undo {
                undo.newly_filed.extend(filed);
                undo.released.extend(released);
            }
        }
        if let UndoLog::On(last) = &mut self.undo {
            *last = undo.map(Box::new);
        }
    }
}

#[cfg(test)]
mod tests;
