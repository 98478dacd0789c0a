//! A paged cache beside, per sequence, the `KvCache` that decodes it alone: the paged tests'
//! reference (`paged.rs`, `prefix_caching.rs`).

use std::collections::BTreeMap;

use burn::tensor::{Device, Tensor};
use mha::{
    AttentionPath, CacheStorage, KvCache, MhaInput, MultiHeadAttention, PagedCacheError,
    PagedKvCache, PagedKvCacheConfig, SequenceId, Token,
};

use super::paged_schedule::Served;
use super::{assert_close, randn, row_ids};

/// A paged cache and, per sequence, the `KvCache` that decodes it alone: each step is checked
/// against the reference, row by row.
pub struct Harness<'a> {
    pub module: &'a MultiHeadAttention,
    device: &'a Device,
    pub paged: PagedKvCache,
    alone: BTreeMap<SequenceId, KvCache>,
    /// Each sequence's tokens so far, `[len, d_model]` pieces.
    tokens: BTreeMap<SequenceId, Vec<Tensor<2>>>,
    storage: CacheStorage,
    /// The path the references decode with: `Auto` (a compressed `KvCache` read in place by
    /// the paged kernel too on flex and ndarray) or `Flash` (the cache widened, another kernel).
    reference_path: AttentionPath,
    label: String,
    tolerance: f32,
}

/// What a refused step must leave as it was: every sequence's length and the pool's blocks.
#[derive(Debug, PartialEq, Eq)]
struct PoolState {
    lens: Vec<(SequenceId, Option<usize>)>,
    blocks_in_use: usize,
    free_blocks: usize,
    filed_blocks: usize,
}

impl<'a> Harness<'a> {
    pub fn new(
        module: &'a MultiHeadAttention,
        device: &'a Device,
        config: PagedKvCacheConfig,
        label: String,
        tolerance: f32,
    ) -> Self {
        Self {
            module,
            device,
            paged: config.init(),
            alone: BTreeMap::new(),
            tokens: BTreeMap::new(),
            storage: config.storage,
            reference_path: AttentionPath::Auto,
            label,
            tolerance,
        }
    }

    /// The references decode with `path`.
    pub fn with_reference_path(mut self, path: AttentionPath) -> Self {
        self.reference_path = path;
        self
    }

    pub fn add(&mut self) -> SequenceId {
        let id = self.paged.add_sequence();
        self.add_reference(id, None);
        id
    }

    /// A sequence added with its `prompt` (`rows`, `[prompt.len(), d_model]`, what its tokens
    /// give): the paged cache shares the blocks of its longest held prefix, and the reference
    /// decodes those positions alone in one step (their outputs are not checked: the paged
    /// cache computes none). Gives the sequence and the positions the paged cache holds; the
    /// next step feeds the prompt's rows from there on.
    pub fn add_with_prompt(&mut self, prompt: &[Token], rows: Tensor<2>) -> (SequenceId, usize) {
        let matched = self.paged.add_sequence_with_prompt(prompt);
        let cached = (matched.cached > 0).then(|| rows.narrow(0, 0, matched.cached));
        self.add_reference(matched.id, cached);
        (matched.id, matched.cached)
    }

    /// A reference for `id`, which holds `cached` (`[len, d_model]`) already.
    fn add_reference(&mut self, id: SequenceId, cached: Option<Tensor<2>>) {
        let mut alone = KvCache::new().with_storage(self.storage);
        if let Some(cached) = &cached {
            let [len, d_model] = cached.dims();
            self.module
                .forward_cached(
                    MhaInput::self_attn(cached.clone().reshape([1, len, d_model]))
                        .causal()
                        .path(self.reference_path),
                    &mut alone,
                )
                .unwrap();
        }
        self.alone.insert(id, alone);
        self.tokens.insert(id, cached.into_iter().collect());
    }

    pub fn fork(&mut self, parent: SequenceId) -> SequenceId {
        let id = self.paged.fork(parent).unwrap();
        let cache = self.alone[&parent].clone();
        self.alone.insert(id, cache);
        let tokens = self.tokens[&parent].clone();
        self.tokens.insert(id, tokens);
        id
    }

    /// A fork of `parent`'s first `prefix` positions, whose reference decodes them again;
    /// `None` where `parent` gave back positions the fork's next query would see (checked to
    /// be so: they lie in its window, and before the first `parent` holds).
    pub fn fork_prefix(&mut self, parent: SequenceId, prefix: usize) -> Option<SequenceId> {
        let id = match self.paged.fork_prefix(parent, prefix) {
            Ok(id) => id,
            Err(PagedCacheError::PrefixReleased { first_held, .. }) => {
                let window = self.module.window();
                assert!(
                    Some(first_held) == self.paged.first_held(parent)
                        && reads_before(prefix, first_held, window, self.paged.block_size()),
                    "{}: a fork of {prefix} refused, {first_held} first held under a window \
                     of {window:?}",
                    self.label
                );
                return None;
            }
            Err(error) => panic!("{}: fork_prefix: {error}", self.label),
        };
        let tokens = Tensor::cat(self.tokens[&parent].clone(), 0).narrow(0, 0, prefix);
        self.add_reference(id, Some(tokens));
        Some(id)
    }

    /// `id` cut back to its first `len` positions, its reference decoding them again; false
    /// where it gave back positions that a sequence of `len` positions reads next (checked to
    /// be so), and nothing changed.
    pub fn truncate(&mut self, id: SequenceId, len: usize) -> bool {
        let before = self.pool_state();
        match self.paged.truncate(id, len) {
            Ok(()) => {}
            Err(PagedCacheError::PrefixReleased { first_held, .. }) => {
                let window = self.module.window();
                assert!(
                    Some(first_held) == self.paged.first_held(id)
                        && reads_before(len, first_held, window, self.paged.block_size()),
                    "{}: a cut to {len} refused, {first_held} first held",
                    self.label
                );
                assert_eq!(self.pool_state(), before, "{}: a cut refused", self.label);
                return false;
            }
            Err(error) => panic!("{}: truncate: {error}", self.label),
        }
        let tokens = Tensor::cat(self.tokens[&id].clone(), 0);
        self.add_reference(id, (len > 0).then(|| tokens.narrow(0, 0, len)));
        assert_eq!(self.paged.len(id), Some(len), "{}", self.label);
        self.check_pool();
        true
    }

    /// The first position a sequence of `len` positions holds once a step left it so: the
    /// first of the block where its next query's window starts.
    fn first_held_after_a_step(&self, len: usize) -> usize {
        let block_size = self.paged.block_size();
        let window = self.module.window();
        window.map_or(0, |window| {
            (len + 1).saturating_sub(window) / block_size * block_size
        })
    }

    pub fn remove(&mut self, id: SequenceId) {
        self.paged.remove_sequence(id).unwrap();
        self.alone.remove(&id);
        self.tokens.remove(&id);
    }

    /// One paged step of `rows` new tokens for each sequence, checked against each sequence
    /// decoded alone.
    pub fn step(&mut self, rows: &[(SequenceId, usize)]) {
        let total = rows.iter().map(|(_, n)| n).sum();
        let x = randn([total, self.module.d_model()], self.device);
        self.try_step(rows, x).unwrap();
    }

    /// [`step`](Self::step) with the rows `x` (`[rows, d_model]`), which the pool may refuse:
    /// a refused step is checked to have left every sequence and the pool's blocks as they
    /// were, and the references take no step.
    pub fn try_step(
        &mut self,
        rows: &[(SequenceId, usize)],
        x: Tensor<2>,
    ) -> Result<(), PagedCacheError> {
        let ids = row_ids(rows);
        let before = self.pool_state();
        let needed = self.paged.blocks_needed(&ids).unwrap();
        let fits = needed <= self.paged.free_blocks();
        let result = self.module.forward_paged(x.clone(), &mut self.paged, &ids);
        check_blocks_needed(&self.label, (needed, fits), &result);
        let output = match result {
            Ok(output) => output,
            Err(error) => {
                assert_eq!(
                    self.pool_state(),
                    before,
                    "{}: refused: {error}",
                    self.label
                );
                return Err(error);
            }
        };
        let mut start = 0;
        for &(id, n) in rows {
            let alone = self.alone.get_mut(&id).unwrap();
            let own = x.clone().narrow(0, start, n);
            self.tokens.get_mut(&id).unwrap().push(own.clone());
            let tokens = own.reshape([1, n, self.module.d_model()]);
            let expected = self
                .module
                .forward_cached(
                    MhaInput::self_attn(tokens)
                        .causal()
                        .path(self.reference_path),
                    alone,
                )
                .unwrap()
                .context
                .reshape([n, self.module.d_model()]);
            assert_close(
                &format!("{}: {id} rows {start}..{}", self.label, start + n),
                output.clone().narrow(0, start, n),
                expected,
                self.tolerance,
            );
            let len = alone.len();
            assert_eq!(self.paged.len(id), Some(len), "{}", self.label);
            assert_eq!(
                self.paged.first_held(id),
                Some(self.first_held_after_a_step(len)),
                "{}: {id} gives back its blocks behind the window",
                self.label
            );
            start += n;
        }
        self.check_pool();
        Ok(())
    }

    fn pool_state(&self) -> PoolState {
        PoolState {
            lens: self
                .alone
                .keys()
                .map(|&id| (id, self.paged.len(id)))
                .collect(),
            blocks_in_use: self.paged.blocks_in_use(),
            free_blocks: self.paged.free_blocks(),
            filed_blocks: self.paged.filed_blocks(),
        }
    }

    /// The pool's blocks add up: those in use and those free make its bound, the pool once
    /// allocated holds its initial blocks, no sequence gave back a block its next query sees,
    /// and the blocks in use are at most one per started block of each sequence from its first
    /// held (fewer where they share).
    pub fn check_pool(&self) {
        let config = self.paged.config();
        assert_eq!(
            self.paged.blocks_in_use() + self.paged.free_blocks(),
            config.max_blocks,
            "{}: blocks in use and free",
            self.label
        );
        let reserved = self.paged.reserved_blocks();
        assert!(
            reserved == 0 || reserved >= config.initial_blocks,
            "{}: {reserved} blocks allocated, fewer than the {} initial ones",
            self.label,
            config.initial_blocks
        );
        let block_size = self.paged.block_size();
        let mut started = 0;
        for &id in self.alone.keys() {
            let (len, first_held) = (self.paged.len(id).unwrap(), self.paged.first_held(id));
            let first_held = first_held.unwrap();
            assert!(
                first_held.is_multiple_of(block_size)
                    && first_held <= self.first_held_after_a_step(len),
                "{}: {id} of {len} positions holds from {first_held}",
                self.label
            );
            started += len.div_ceil(block_size) - first_held / block_size;
        }
        assert!(
            self.paged.blocks_in_use() <= started,
            "{}: {} blocks in use for {started} started blocks",
            self.label,
            self.paged.blocks_in_use()
        );
        assert!(self.paged.filed_blocks() <= self.paged.reserved_blocks());
    }
}

impl Served for Harness<'_> {
    fn add(&mut self) -> SequenceId {
        Harness::add(self)
    }

    fn add_with_prompt(&mut self, prompt: &[Token], rows: Tensor<2>) -> (SequenceId, usize) {
        Harness::add_with_prompt(self, prompt, rows)
    }

    fn fork(&mut self, parent: SequenceId) -> SequenceId {
        Harness::fork(self, parent)
    }

    fn fork_prefix(&mut self, parent: SequenceId, prefix: usize) -> Option<SequenceId> {
        Harness::fork_prefix(self, parent, prefix)
    }

    fn truncate(&mut self, id: SequenceId, len: usize) -> bool {
        Harness::truncate(self, id, len)
    }

    fn remove(&mut self, id: SequenceId) {
        Harness::remove(self, id)
    }

    fn try_step(
        &mut self,
        rows: &[(SequenceId, usize)],
        x: Tensor<2>,
    ) -> Result<(), PagedCacheError> {
        Harness::try_step(self, rows, x)
    }

    fn extend_tokens(&mut self, id: SequenceId, tokens: &[Token]) {
        self.paged.extend_tokens(id, tokens).unwrap();
    }

    fn tokens(&self, id: SequenceId) -> Vec<Token> {
        self.paged
            .tokens(id)
            .expect("a sequence of the cache")
            .to_vec()
    }

    fn check_all_blocks_free(&self) {
        assert_eq!(
            (self.paged.blocks_in_use(), self.paged.free_blocks()),
            (0, self.paged.config().max_blocks),
            "{}: every block back in the pool",
            self.label
        );
    }
}

/// Whether a sequence of the first `prefix` positions of one that holds from `first_held` on
/// (blocks of `block_size`, a module's `window`) reads a position it no longer holds next: one
/// its next query sees, or one of its partly filled last block, which its next step writes
/// into.
pub fn reads_before(
    prefix: usize,
    first_held: usize,
    window: Option<usize>,
    block_size: usize,
) -> bool {
    let seen = window.map_or(0, |window| (prefix + 1).saturating_sub(window));
    let partial_block = prefix / block_size * block_size;
    let needed = seen.min(partial_block)..prefix;
    !needed.is_empty() && needed.start < first_held
}

/// Panics unless a step's `result` agrees with what `blocks_needed` said before it: it fits if
/// and only if the blocks it needs are at most the free ones, and a full pool's refusal names
/// as many.
pub fn check_blocks_needed<T>(
    label: &str,
    (needed, fits): (usize, bool),
    result: &Result<T, PagedCacheError>,
) {
    match result {
        Err(PagedCacheError::PoolFull {
            needed: refused, ..
        }) => assert!(
            !fits && *refused == needed,
            "{label}: refused for {refused} blocks where blocks_needed said {needed} (fits: {fits})"
        ),
        _ => assert!(
            fits,
            "{label}: the step ran where blocks_needed said {needed} did not fit"
        ),
    }
}
