//! Prefix caching: whole blocks filed under the tokens they hold and the blocks before them, so
//! that a new sequence whose prompt starts with the same tokens shares those blocks instead of
//! computing and storing them again (vLLM's automatic prefix caching).
//!
//! A block is filed under its own tokens and the entry of the block before it: two blocks of
//! the same tokens after different prefixes never match, and no hash can collide, as the map
//! compares the tokens themselves. Only whole blocks are filed; they are never written again,
//! so an entry stays true until its block is taken for other positions ([`PrefixIndex::forget`]).

use std::collections::HashMap;

/// A token id, as a tokenizer hands it out.
pub type Token = u32;

/// An entry of the index: the prefix of whole blocks that ends with one filed block.
/// [`EntryId::EMPTY`] is the empty prefix. Ids are not reused, so an entry forgotten and
/// filed again is a new prefix: what was filed after the old one can no longer be reached. (A
/// step taken back hands its ids out again, once every entry it filed is forgotten: nothing
/// refers to them.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct EntryId(u64);

impl EntryId {
    /// The prefix of no blocks, which every sequence starts from.
    pub const EMPTY: EntryId = EntryId(0);
}

/// What a block is filed under: the prefix before it and its own tokens.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct BlockKey {
    before: EntryId,
    tokens: Box<[Token]>,
}

/// A filed block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    id: EntryId,
    block: usize,
}

/// One block of a matched prefix: the pool block that holds it and its entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MatchedBlock {
    pub entry: EntryId,
    pub block: usize,
}

/// The pool's whole blocks by the tokens they hold. At most one entry per block, so the index
/// never outgrows the pool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PrefixIndex {
    entries: HashMap<BlockKey, Entry>,
    /// The key each filed block is filed under.
    keys: HashMap<usize, BlockKey>,
    /// The last entry id handed out.
    last: u64,
}

impl PrefixIndex {
    /// The filed blocks holding `tokens`' first whole blocks of `block_size`, in order, as far
    /// as they are filed: at most `limit` blocks.
    pub fn matching(&self, tokens: &[Token], block_size: usize, limit: usize) -> Vec<MatchedBlock> {
        let mut matched = Vec::new();
        let mut before = EntryId::EMPTY;
        for tokens in tokens.chunks_exact(block_size).take(limit) {
            let key = BlockKey {
                before,
                tokens: tokens.into(),
            };
            let Some(entry) = self.entries.get(&key) else {
                break;
            };
            matched.push(MatchedBlock {
                entry: entry.id,
                block: entry.block,
            });
            before = entry.id;
        }
        matched
    }

    /// Files `block`, which holds `tokens` after the prefix `before`, and gives the entry the
    /// prefix continues from: the block's own, or that of a block filed earlier with the same
    /// prefix and tokens (two sequences that computed the same prompt at once), which stays the
    /// one that matches. `None`, filing nothing, if `block` is filed already under another
    /// prefix or other tokens: a block's positions are written once, so one of the two claims
    /// is wrong, and the first stays.
    pub fn file(&mut self, before: EntryId, tokens: &[Token], block: usize) -> Option<EntryId> {
        let key = BlockKey {
            before,
            tokens: tokens.into(),
        };
        if let Some(entry) = self.entries.get(&key) {
            return Some(entry.id);
        }
        if self.keys.contains_key(&block) {
            return None;
        }
        self.last += 1;
        let id = EntryId(self.last);
        self.keys.insert(block, key.clone());
        self.entries.insert(key, Entry { id, block });
        Some(id)
    }

    /// Whether `block` is filed (its positions may still be matched while it is free).
    pub fn is_filed(&self, block: usize) -> bool {
        self.keys.contains_key(&block)
    }

    /// Forgets what `block` holds: the pool hands it out for other positions.
    pub fn forget(&mut self, block: usize) {
        if let Some(key) = self.keys.remove(&block) {
            self.entries.remove(&key);
        }
    }

    /// Blocks filed.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// The last entry id handed out.
    pub fn last_id(&self) -> u64 {
        self.last
    }

    /// Hands ids out again after `last`, once every entry filed after it is forgotten (a step
    /// taken back), so that the index is as it was before them.
    pub fn rewind_ids(&mut self, last: u64) {
        debug_assert!(self.entries.values().all(|entry| entry.id.0 <= last));
        self.last = last;
    }
}

/// The tokens a sequence's positions hold, as far as they were told
/// ([`PagedKvCache::add_sequence_with_prompt`](crate::PagedKvCache::add_sequence_with_prompt),
/// [`PagedKvCache::extend_tokens`](crate::PagedKvCache::extend_tokens)), and the entries of
/// its whole blocks filed so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct TokenRecord {
    /// Token `i` is the one at position `i`.
    pub tokens: Vec<Token>,
    /// The entry of each of the sequence's first whole blocks, in order.
    pub filed: Vec<EntryId>,
}

impl TokenRecord {
    /// The record of a sequence's first `len` positions (a fork of a prefix).
    pub fn prefix(&self, len: usize, block_size: usize) -> TokenRecord {
        TokenRecord {
            tokens: self.tokens[..len.min(self.tokens.len())].to_vec(),
            filed: self.filed[..(len / block_size).min(self.filed.len())].to_vec(),
        }
    }

    /// The entry the sequence's next whole block is filed after.
    pub fn last_entry(&self) -> EntryId {
        self.filed.last().copied().unwrap_or(EntryId::EMPTY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_matches_block_by_block_up_to_the_first_difference() {
        let mut index = PrefixIndex::default();
        let first = index.file(EntryId::EMPTY, &[1, 2], 7).unwrap();
        let second = index.file(first, &[3, 4], 3).unwrap();
        index.file(second, &[5, 6], 9).unwrap();
        let blocks = |matched: Vec<MatchedBlock>| -> Vec<usize> {
            matched.iter().map(|matched| matched.block).collect()
        };
        assert_eq!(blocks(index.matching(&[1, 2, 3, 4, 5, 6], 2, 9)), [7, 3, 9]);
        assert_eq!(blocks(index.matching(&[1, 2, 3, 4, 5, 6], 2, 2)), [7, 3]);
        assert_eq!(blocks(index.matching(&[1, 2, 3, 0, 5, 6], 2, 9)), [7]);
        // The partial block at the end is never matched.
        assert_eq!(blocks(index.matching(&[1, 2, 3], 2, 9)), [7]);
        // The same tokens after another prefix are another block.
        assert_eq!(blocks(index.matching(&[3, 4], 2, 9)), Vec::<usize>::new());
    }

    #[test]
    fn a_forgotten_block_cuts_the_prefixes_through_it_even_when_filed_again() {
        let mut index = PrefixIndex::default();
        let first = index.file(EntryId::EMPTY, &[1, 2], 0).unwrap();
        index.file(first, &[3, 4], 1).unwrap();
        index.forget(0);
        assert!(!index.is_filed(0) && index.is_filed(1));
        assert!(index.matching(&[1, 2, 3, 4], 2, 9).is_empty());
        // The same tokens filed again in another block: a new prefix, which block 1 (filed
        // after the old one) does not continue.
        let again = index.file(EntryId::EMPTY, &[1, 2], 5).unwrap();
        assert_ne!(again, first);
        let matched = index.matching(&[1, 2, 3, 4], 2, 9);
        assert_eq!(
            matched,
            [MatchedBlock {
                entry: again,
                block: 5
            }]
        );
    }

    #[test]
    fn the_same_prefix_filed_twice_keeps_the_first_block() {
        let mut index = PrefixIndex::default();
        let first = index.file(EntryId::EMPTY, &[1, 2], 4).unwrap();
        assert_eq!(index.file(EntryId::EMPTY, &[1, 2], 6), Some(first));
        assert!(!index.is_filed(6));
        assert_eq!(index.len(), 1);
        assert_eq!(index.matching(&[1, 2], 2, 1)[0].block, 4);
        // A filed block claimed for other tokens keeps what it was filed under.
        assert_eq!(index.file(EntryId::EMPTY, &[9, 9], 4), None);
        assert!(index.matching(&[9, 9], 2, 1).is_empty());
    }

    #[test]
    fn a_record_of_a_prefix_keeps_its_tokens_and_whole_blocks() {
        let record = TokenRecord {
            tokens: vec![1, 2, 3, 4, 5],
            filed: vec![EntryId(3), EntryId(8)],
        };
        let prefix = record.prefix(3, 2);
        assert_eq!(prefix.tokens, [1, 2, 3]);
        assert_eq!(prefix.filed, [EntryId(3)]);
        assert_eq!(prefix.last_entry(), EntryId(3));
        assert_eq!(TokenRecord::default().last_entry(), EntryId::EMPTY);
    }
}
