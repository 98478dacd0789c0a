//! The bookkeeping of [`PagedKvCache`]: blocks taken and freed, refusals, forks, copies on
//! write and prefixes found by their tokens (one key/value head of width 2, all ones).

use super::*;
use burn::module::ParamId;
use burn::tensor::Device;

use crate::cache::CacheStorage;

mod window;

fn owner() -> CacheOwner {
    CacheOwner {
        key_weight: ParamId::new(),
        n_kv_heads: 1,
        head_dim: 2,
    }
}

/// A step's rows for `runs` of (sequence, new positions), side by side, and their count.
fn sequence_rows(runs: &[(SequenceId, usize)]) -> (Vec<SequenceRows>, usize) {
    let mut start = 0;
    let sequences = runs
        .iter()
        .map(|&(id, count)| {
            start += count;
            SequenceRows {
                id,
                rows: start - count..start,
            }
        })
        .collect();
    (sequences, start)
}

/// One step of `rows[i]` new positions for sequence `ids[i]`, keys and values all ones.
fn step(
    cache: &mut PagedKvCache,
    owner: CacheOwner,
    ids: &[SequenceId],
    rows: &[usize],
) -> Result<(), PagedCacheError> {
    let device = Device::flex();
    let runs: Vec<_> = ids.iter().copied().zip(rows.iter().copied()).collect();
    let (sequences, rows) = sequence_rows(&runs);
    let needed = cache.blocks_needed(&row_ids(&runs))?;
    let free = cache.free_blocks();
    let step = match cache.begin(owner, cache.window, &sequences, &device) {
        Ok(step) => {
            assert!(
                needed <= free,
                "the step ran though it needs {needed} of {free} blocks"
            );
            step
        }
        Err(error) => {
            if let PagedCacheError::PoolFull {
                needed: refused, ..
            } = error
            {
                assert!(
                    refused == needed && needed > free,
                    "{error}: {needed} needed"
                );
            }
            return Err(error);
        }
    };
    let keys = Tensor::<4>::ones([1, 1, rows, 2], &device);
    cache.store(&step, &keys, &keys);
    Ok(())
}

/// A step's ids, one per row, for `runs` of (sequence, new positions).
fn row_ids(runs: &[(SequenceId, usize)]) -> Vec<SequenceId> {
    runs.iter()
        .flat_map(|&(id, count)| std::iter::repeat_n(id, count))
        .collect()
}

#[test]
fn blocks_needed_counts_new_blocks_and_copies_on_write_and_changes_nothing() {
    let owner = owner();
    let mut cache = PagedKvCacheConfig::new(8).with_block_size(4).init();
    let a = cache.add_sequence();
    // Five positions: two blocks; then three more fill the second.
    assert_eq!(cache.blocks_needed(&[a; 5]), Ok(2));
    step(&mut cache, owner, &[a], &[5]).unwrap();
    assert_eq!(cache.blocks_needed(&[a; 3]), Ok(0));
    // A fork shares the partial block: the first of the two to write copies it, the other
    // writes in place.
    let b = cache.fork(a).unwrap();
    assert_eq!(cache.blocks_needed(&[a]), Ok(1));
    assert_eq!(cache.blocks_needed(&[a, b]), Ok(1));
    assert_eq!(cache.blocks_needed(&[a, a, a, a, b]), Ok(2));
    let free = cache.free_blocks();
    assert_eq!(free, 6);
    assert_eq!(cache.blocks_in_use(), 2);
    let unknown = SequenceId(99);
    assert_eq!(
        cache.blocks_needed(&[a, unknown]),
        Err(PagedCacheError::UnknownSequence(unknown))
    );
}

#[test]
#[should_panic(expected = "PagedKvCache::blocks_needed: the rows of")]
fn blocks_needed_of_a_sequence_in_two_runs_of_rows_panics() {
    let mut cache = PagedKvCacheConfig::new(8).init();
    let (a, b) = (cache.add_sequence(), cache.add_sequence());
    let _ = cache.blocks_needed(&[a, b, a]);
}

#[test]
fn blocks_are_taken_per_block_of_positions_and_returned_on_removal() {
    let owner = owner();
    let mut cache = PagedKvCacheConfig::new(8).with_block_size(4).init();
    let (a, b) = (cache.add_sequence(), cache.add_sequence());
    step(&mut cache, owner, &[a, b], &[5, 1]).unwrap();
    assert_eq!(cache.blocks_in_use(), 3);
    assert_eq!(cache.table(a).unwrap().blocks.len(), 2);
    step(&mut cache, owner, &[a, b], &[3, 3]).unwrap();
    assert_eq!((cache.len(a), cache.len(b)), (Some(8), Some(4)));
    assert_eq!(cache.blocks_in_use(), 3);
    cache.remove_sequence(a).unwrap();
    assert_eq!(cache.blocks_in_use(), 1);
    assert_eq!(cache.free_blocks(), 7);
    assert_eq!(
        cache.remove_sequence(a),
        Err(PagedCacheError::UnknownSequence(a))
    );
}

#[test]
fn a_full_pool_refuses_the_whole_step_and_changes_nothing() {
    let owner = owner();
    let mut cache = PagedKvCacheConfig::new(3).with_block_size(2).init();
    let (a, b) = (cache.add_sequence(), cache.add_sequence());
    step(&mut cache, owner, &[a], &[3]).unwrap();
    let error = step(&mut cache, owner, &[a, b], &[1, 3]).unwrap_err();
    assert_eq!(
        error,
        PagedCacheError::PoolFull {
            sequence: b,
            needed: 2,
            free: 1
        }
    );
    assert!(error.to_string().contains("sequence 1"), "{error}");
    assert_eq!((cache.len(a), cache.len(b)), (Some(3), Some(0)));
    assert_eq!(cache.blocks_in_use(), 2);
    step(&mut cache, owner, &[a, b], &[1, 1]).unwrap();
    assert_eq!(cache.free_blocks(), 0);
}

#[test]
fn a_refused_copy_on_write_counts_the_last_sharer_as_writing_in_place() {
    let owner = owner();
    let mut cache = PagedKvCacheConfig::new(2).with_block_size(4).init();
    let parent = cache.add_sequence();
    step(&mut cache, owner, &[parent], &[6]).unwrap();
    let child = cache.fork(parent).unwrap();
    // The parent's copy of the shared block finds no free block; the child, the block's
    // last sharer, would then have written in place: one block short, not two.
    assert_eq!(
        step(&mut cache, owner, &[parent, child], &[1, 1]),
        Err(PagedCacheError::PoolFull {
            sequence: parent,
            needed: 1,
            free: 0
        })
    );
}

#[test]
fn a_prompt_shares_the_filed_whole_blocks_of_its_longest_held_prefix() {
    let owner = owner();
    let mut cache = PagedKvCacheConfig::new(8).with_block_size(2).init();
    let a = cache.add_sequence_with_prompt(&[1, 2, 3, 4, 5]);
    assert_eq!(a.cached, 0);
    step(&mut cache, owner, &[a.id], &[5]).unwrap();
    assert_eq!(cache.filed_blocks(), 2);
    let b = cache.add_sequence_with_prompt(&[1, 2, 3, 4, 9, 9]);
    assert_eq!(b.cached, 4);
    assert_eq!(
        cache.table(b.id).unwrap().blocks,
        cache.table(a.id).unwrap().blocks[..2]
    );
    assert_eq!(cache.blocks_in_use(), 3, "shared, not copied");
    // Whole blocks only, never the prompt's last token, and nothing past a difference.
    for (prompt, cached) in [
        (&[1, 2, 3, 4][..], 2),
        (&[1, 2, 3], 2),
        (&[1, 7, 3, 4, 5], 0),
        (&[2, 1, 3, 4, 5], 0),
    ] {
        let matched = cache.add_sequence_with_prompt(prompt);
        assert_eq!(matched.cached, cached, "{prompt:?}");
        assert_eq!(cache.len(matched.id), Some(cached));
        cache.remove_sequence(matched.id).unwrap();
    }
    // `b`'s own block is filed once `b` holds it and its tokens are known.
    step(&mut cache, owner, &[b.id], &[2]).unwrap();
    assert_eq!(cache.filed_blocks(), 3);
    // A fork keeps its parent's tokens: told the next ones, it files its own block.
    let fork = cache.fork_prefix(a.id, 4).unwrap();
    step(&mut cache, owner, &[fork], &[2]).unwrap();
    assert_eq!(
        cache.filed_blocks(),
        3,
        "tokens of the fork's new block not told"
    );
    cache.extend_tokens(fork, &[6, 6]).unwrap();
    assert_eq!(cache.filed_blocks(), 4);
    assert_eq!(
        cache
            .add_sequence_with_prompt(&[1, 2, 3, 4, 6, 6, 0])
            .cached,
        6
    );
    assert_eq!(
        cache.extend_tokens(SequenceId(99), &[1]),
        Err(PagedCacheError::UnknownSequence(SequenceId(99)))
    );
}

#[test]
fn freed_filed_blocks_are_overwritten_last_and_forgotten_when_they_are() {
    let owner = owner();
    let mut cache = PagedKvCacheConfig::new(4).with_block_size(2).init();
    let a = cache.add_sequence_with_prompt(&[1, 2, 3, 4]);
    step(&mut cache, owner, &[a.id], &[4]).unwrap();
    let other = cache.add_sequence();
    step(&mut cache, owner, &[other], &[2]).unwrap();
    cache.remove_sequence(a.id).unwrap();
    cache.remove_sequence(other).unwrap();
    assert_eq!((cache.blocks_in_use(), cache.free_blocks()), (0, 4));
    assert_eq!(cache.filed_blocks(), 2, "freed, still filed");
    // Two blocks needed, two free blocks that nothing can share: the filed ones stay.
    let c = cache.add_sequence();
    step(&mut cache, owner, &[c], &[4]).unwrap();
    let again = cache.add_sequence_with_prompt(&[1, 2, 3, 4, 5]);
    assert_eq!(again.cached, 4);
    assert_eq!((cache.blocks_in_use(), cache.free_blocks()), (4, 0));
    cache.remove_sequence(again.id).unwrap();
    // Now the pool is full but for the filed blocks: the least recently freed is taken,
    // and the prefix through it is gone.
    step(&mut cache, owner, &[c], &[2]).unwrap();
    assert_eq!(cache.add_sequence_with_prompt(&[1, 2, 3, 4, 5]).cached, 0);
}

#[test]
fn forks_share_blocks_until_a_write_copies_the_partial_one() {
    let owner = owner();
    let mut cache = PagedKvCacheConfig::new(16).with_block_size(4).init();
    let parent = cache.add_sequence();
    step(&mut cache, owner, &[parent], &[6]).unwrap();
    let child = cache.fork(parent).unwrap();
    let prefix = cache.fork_prefix(parent, 4).unwrap();
    assert_eq!(cache.blocks_in_use(), 2);
    assert_eq!(cache.len(prefix), Some(4));
    // The child writes into the shared, partly filled second block: copied first.
    step(&mut cache, owner, &[child], &[1]).unwrap();
    assert_eq!(cache.blocks_in_use(), 3);
    let (parent_blocks, child_blocks) = (
        cache.table(parent).unwrap().blocks.clone(),
        cache.table(child).unwrap().blocks.clone(),
    );
    assert_eq!(parent_blocks[0], child_blocks[0]);
    assert_ne!(parent_blocks[1], child_blocks[1]);
    // The parent's second block is its own again: written in place.
    step(&mut cache, owner, &[parent], &[1]).unwrap();
    assert_eq!(cache.table(parent).unwrap().blocks, parent_blocks);
    // The prefix ends on a block boundary: its next position takes a fresh block.
    step(&mut cache, owner, &[prefix], &[1]).unwrap();
    assert_eq!(cache.blocks_in_use(), 4);
    cache.remove_sequence(parent).unwrap();
    cache.remove_sequence(child).unwrap();
    assert_eq!(cache.blocks_in_use(), 2);
    let error = cache.fork_prefix(prefix, 9).unwrap_err();
    assert_eq!(
        error,
        PagedCacheError::PrefixTooLong {
            sequence: prefix,
            prefix: 9,
            len: 5
        }
    );
    // The message names the call, its argument and the sequence's length.
    let message = error.to_string();
    assert!(
        message.contains("fork_prefix: `prefix` is 9 positions") && message.contains("only 5"),
        "{message}"
    );
}

/// A pool bounded only by `usize::MAX` counts its free blocks without overflowing once it has
/// allocated some (it added `max_blocks` to the idle blocks first, which a debug build's
/// overflow check refused; a release build wraps to the same count).
#[test]
fn free_blocks_of_an_unbounded_pool_do_not_overflow() {
    let owner = owner();
    let mut cache = PagedKvCacheConfig::new(usize::MAX)
        .with_block_size(4)
        .init();
    let a = cache.add_sequence();
    step(&mut cache, owner, &[a], &[5]).unwrap();
    assert_eq!(cache.free_blocks(), usize::MAX - 2);
    cache.remove_sequence(a).unwrap();
    assert_eq!(cache.free_blocks(), usize::MAX);
}

/// The only holder of a filed, partly filled block, in a pool with no block to copy it into,
/// writes into it in place and forgets its filing: it loses the cached prefix, not its step
/// (it was refused at every step before).
#[test]
fn a_fork_alone_in_a_full_pool_writes_its_filed_block_in_place() {
    let owner = owner();
    let mut cache = PagedKvCacheConfig::new(2).with_block_size(4).init();
    let prompt = [1, 2, 3, 4, 5, 6, 7, 8];
    let a = cache.add_sequence_with_prompt(&prompt);
    step(&mut cache, owner, &[a.id], &[8]).unwrap();
    let fork = cache.fork_prefix(a.id, 6).unwrap();
    cache.remove_sequence(a.id).unwrap();
    assert_eq!(cache.free_blocks(), 0);
    let filed = cache.table(fork).unwrap().blocks[1];
    step(&mut cache, owner, &[fork], &[1]).expect("written in place");
    assert_eq!(cache.table(fork).unwrap().blocks[1], filed, "in place");
    assert_eq!(cache.table(fork).unwrap().len, 7);
    // Only the first block is still filed: the second now holds the fork's positions.
    assert_eq!(cache.add_sequence_with_prompt(&prompt).cached, 4);
}

#[test]
fn a_fork_writing_into_a_filed_block_copies_it_even_as_its_only_holder() {
    let owner = owner();
    let mut cache = PagedKvCacheConfig::new(8).with_block_size(4).init();
    let prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9];
    let a = cache.add_sequence_with_prompt(&prompt);
    step(&mut cache, owner, &[a.id], &[9]).unwrap();
    // The fork's second block is partial for it, whole and filed for `a`.
    let fork = cache.fork_prefix(a.id, 5).unwrap();
    cache.remove_sequence(a.id).unwrap();
    let filed = cache.table(fork).unwrap().blocks[1];
    step(&mut cache, owner, &[fork], &[1]).unwrap();
    assert_ne!(
        cache.table(fork).unwrap().blocks[1],
        filed,
        "written in place"
    );
    // The filed block still holds `a`'s positions, and a prompt still shares it.
    assert_eq!(cache.add_sequence_with_prompt(&prompt).cached, 8);
}

/// A step whose keys and values are distinct numbers (`base`, `base + 1`, …), so that a
/// position written over shows, by a module without a window or with the one the cache was
/// filled under.
fn numbered_step(
    cache: &mut PagedKvCache,
    owner: CacheOwner,
    runs: &[(SequenceId, usize)],
    base: f32,
) {
    numbered_step_in_window(cache, (owner, cache.window), runs, base);
}

/// [`numbered_step`] by a module with a sliding `window`.
fn numbered_step_in_window(
    cache: &mut PagedKvCache,
    (owner, window): (CacheOwner, Option<usize>),
    runs: &[(SequenceId, usize)],
    base: f32,
) {
    let device = Device::flex();
    let (sequences, rows) = sequence_rows(runs);
    let step = cache.begin(owner, window, &sequences, &device).unwrap();
    let keys = (Tensor::<1, burn::tensor::Int>::arange(0..2 * rows as i64, &device).float() + base)
        .reshape([1, 1, rows, 2]);
    cache.store(&step, &keys, &(keys.clone() * -1.0));
}

/// Every sequence's stored keys and values, gathered from its blocks.
fn contents(cache: &PagedKvCache) -> Vec<(SequenceId, Vec<f32>)> {
    let (key, value) = cache.stores().unwrap();
    cache
        .sequences()
        .filter(|&id| cache.len(id) != Some(0))
        .map(|id| {
            let (table, len) = (cache.table(id).unwrap(), cache.len(id).unwrap());
            let gathered = |store: &BlockStore| {
                let tensor = store.gather(table, len, burn::tensor::DType::F32);
                tensor.into_data().to_vec::<f32>().unwrap()
            };
            (id, [gathered(key), gathered(value)].concat())
        })
        .collect()
}

#[test]
fn a_step_taken_back_leaves_the_cache_as_it_was_but_for_the_filings_it_overwrote() {
    let owner = owner();
    let mut cache = PagedKvCacheConfig::new(5).with_block_size(4).init();
    cache.keep_undo();
    // `a`: a filed whole block and a partial one, which `c` shares holding one position fewer.
    let a = cache.add_sequence_with_prompt(&[1, 2, 3, 4, 5, 6]).id;
    numbered_step(&mut cache, owner, &[(a, 6)], 0.0);
    let c = cache.fork_prefix(a, 5).unwrap();
    // A freed filed block (the pool's last resort) and a freed unfiled one.
    let x = cache.add_sequence_with_prompt(&[9, 9, 9, 9, 9]).id;
    numbered_step(&mut cache, owner, &[(x, 5)], 100.0);
    cache.remove_sequence(x).unwrap();
    let d = cache.add_sequence_with_prompt(&[5, 5, 5, 5, 5, 5]).id;
    let before = cache.clone();
    let stored_before = contents(&cache);

    // `a` copies the shared block into the unfiled free block; `c`, its last sharer, writes
    // over `a`'s position 5 in place; `d` takes the pool's growth, then the filed free block,
    // and files its first block.
    numbered_step(&mut cache, owner, &[(a, 1), (c, 2), (d, 6)], 1000.0);
    assert_eq!(cache.free_blocks(), 0);
    let shared_block = |cache: &PagedKvCache| {
        let table = &before.table(c).unwrap().blocks;
        let store = cache.stores().unwrap().0;
        let block = BlockTable {
            blocks: table.clone(),
            len: 6,
            released: 0,
        };
        let positions = store.gather(&block, 6, burn::tensor::DType::F32);
        positions.into_data().to_vec::<f32>().unwrap()
    };
    assert_ne!(shared_block(&cache), shared_block(&before), "written over");

    let overwritten = PagedKvCache::take_back(std::slice::from_mut(&mut cache), &mut []);
    assert_eq!(overwritten.len(), 1, "x's filed block");
    let mut expected = before;
    expected.forget_overwritten(&overwritten);
    assert!(
        cache.same_bookkeeping(&expected),
        "{cache:#?}\n{expected:#?}"
    );
    assert_eq!(contents(&cache), stored_before);
    assert_eq!(cache.add_sequence_with_prompt(&[9, 9, 9, 9, 9]).cached, 0);
    assert_eq!(cache.add_sequence_with_prompt(&[1, 2, 3, 4, 5]).cached, 4);
}

/// Stores a step of `runs` into `cache` (which keeps its steps), takes it back, and checks
/// that the cache is as it was but for the filings the step overwrote; gives those.
fn taken_back(cache: &mut PagedKvCache, runs: &[(SequenceId, usize)]) -> Vec<usize> {
    let before = cache.clone();
    numbered_step(cache, owner_of(cache), runs, 500.0);
    let overwritten = PagedKvCache::take_back(std::slice::from_mut(cache), &mut []);
    let mut expected = before.clone();
    expected.forget_overwritten(&overwritten);
    assert!(
        cache.same_bookkeeping(&expected),
        "{cache:#?}\n{expected:#?}"
    );
    if before.stores().is_some() {
        assert_eq!(contents(cache), contents(&before));
    } else {
        assert!(cache.stores().is_none() && cache.block_bytes() == 0);
    }
    overwritten
}

/// The module a cache holds the keys of, or a new one.
fn owner_of(cache: &PagedKvCache) -> CacheOwner {
    cache.owner.unwrap_or_else(owner)
}

#[test]
fn int8_steps_are_taken_back_the_first_a_filed_block_written_in_place_and_one_copied() {
    let int8 = |blocks| {
        let mut cache = PagedKvCacheConfig::new(blocks)
            .with_block_size(4)
            .with_storage(CacheStorage::Int8)
            .init();
        cache.keep_undo();
        cache
    };
    let prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9];
    // The first step: the cache is empty again, with no pool.
    let mut cache = int8(8);
    let a = cache.add_sequence_with_prompt(&prompt).id;
    assert!(taken_back(&mut cache, &[(a, 9)]).is_empty());
    assert_eq!((cache.len(a), cache.filed_blocks()), (Some(0), 0));

    // A fork alone in a full pool writes its filed partial block in place (its filing is
    // forgotten, in every layer of a stack).
    let mut cache = int8(2);
    let a = cache.add_sequence_with_prompt(&prompt[..8]).id;
    numbered_step(&mut cache, owner(), &[(a, 8)], 0.0);
    let fork = cache.fork_prefix(a, 6).unwrap();
    cache.remove_sequence(a).unwrap();
    let filed = cache.table(fork).unwrap().blocks[1];
    assert_eq!(taken_back(&mut cache, &[(fork, 1)]), [filed]);

    // A fork, the only holder of a filed partial block, copies it: the block goes back to
    // the filed free blocks, and returns to the fork when the step is taken back.
    let mut cache = int8(8);
    let a = cache.add_sequence_with_prompt(&prompt).id;
    numbered_step(&mut cache, owner(), &[(a, 9)], 0.0);
    let fork = cache.fork_prefix(a, 5).unwrap();
    cache.remove_sequence(a).unwrap();
    assert!(taken_back(&mut cache, &[(fork, 2)]).is_empty());
    assert_eq!(cache.add_sequence_with_prompt(&prompt).cached, 8);
}

#[test]
fn initial_blocks_are_allocated_on_the_first_step_and_the_pool_doubles_from_there() {
    let owner = owner();
    let mut cache = PagedKvCacheConfig::new(20)
        .with_block_size(4)
        .with_initial_blocks(6)
        .init();
    let a = cache.add_sequence();
    assert_eq!(cache.reserved_blocks(), 0, "allocated when a step needs it");
    step(&mut cache, owner, &[a], &[5]).unwrap();
    let counts = |cache: &PagedKvCache| {
        let allocated = cache.stores().map(|(keys, _)| keys.blocks());
        (cache.reserved_blocks(), allocated, cache.blocks_in_use())
    };
    assert_eq!(counts(&cache), (6, Some(6), 2));
    assert_eq!(cache.free_blocks(), 18);
    // 20 positions more take 5 blocks more, beyond the first 6: doubled to 12.
    step(&mut cache, owner, &[a], &[20]).unwrap();
    assert_eq!(counts(&cache), (12, Some(12), 7));
    assert_eq!(cache.table(a).unwrap().blocks, (0..7).collect::<Vec<_>>());
}

#[test]
fn a_pool_allocated_whole_never_grows_and_refuses_beyond_it() {
    let owner = owner();
    let mut cache = PagedKvCacheConfig::new(8)
        .with_block_size(4)
        .with_initial_blocks(8)
        .init();
    let (a, b) = (cache.add_sequence(), cache.add_sequence());
    step(&mut cache, owner, &[a], &[1]).unwrap();
    let bytes = cache.reserved_bytes();
    assert_eq!(
        (cache.reserved_blocks(), bytes),
        (8, 8 * cache.block_bytes())
    );
    step(&mut cache, owner, &[a, b], &[15, 16]).unwrap();
    assert_eq!((cache.blocks_in_use(), cache.free_blocks()), (8, 0));
    assert_eq!(cache.reserved_bytes(), bytes);
    assert_eq!(
        step(&mut cache, owner, &[b], &[1]),
        Err(PagedCacheError::PoolFull {
            sequence: b,
            needed: 1,
            free: 0
        })
    );
}

#[test]
fn a_first_step_allocating_the_initial_blocks_is_taken_back() {
    let mut cache = PagedKvCacheConfig::new(8)
        .with_block_size(4)
        .with_initial_blocks(8)
        .init();
    cache.keep_undo();
    let a = cache.add_sequence();
    assert!(taken_back(&mut cache, &[(a, 5)]).is_empty());
    assert_eq!((cache.reserved_blocks(), cache.free_blocks()), (0, 8));
}

#[test]
#[should_panic(expected = "`initial_blocks` (9) must be at most `max_blocks` (8)")]
fn initial_blocks_beyond_max_blocks_panic() {
    let _ = PagedKvCacheConfig::new(8).with_initial_blocks(9).init();
}

#[test]
fn a_sequence_gives_the_tokens_it_was_told_and_a_fork_those_of_its_positions() {
    let owner = owner();
    let mut cache = PagedKvCacheConfig::new(8).with_block_size(2).init();
    let a = cache.add_sequence_with_prompt(&[1, 2, 3, 4, 5]).id;
    assert_eq!(
        cache.tokens(a),
        Some(&[1, 2, 3, 4, 5][..]),
        "ahead of its positions"
    );
    assert_eq!(cache.len(a), Some(0));
    step(&mut cache, owner, &[a], &[5]).unwrap();
    cache.extend_tokens(a, &[6]).unwrap();
    assert_eq!(cache.tokens(a), Some(&[1, 2, 3, 4, 5, 6][..]));
    let fork = cache.fork_prefix(a, 3).unwrap();
    assert_eq!(cache.tokens(fork), Some(&[1, 2, 3][..]));
    // Of `a`'s tokens the fork keeps those of the positions it holds, not 6, told ahead.
    let whole = cache.fork(a).unwrap();
    assert_eq!(cache.tokens(whole), Some(&[1, 2, 3, 4, 5][..]));
    let untold = cache.add_sequence();
    assert_eq!(cache.tokens(untold), Some(&[][..]));
    cache.remove_sequence(a).unwrap();
    assert_eq!(cache.tokens(a), None);
}

/// A step that takes filed free blocks out of their numbers' order (freed by two sequences,
/// the later-numbered first), stored by a stack's first layer and refused by its second: once
/// taken back, both layers forget those filings in the same order, so that their free lists
/// stay alike and later steps take the same blocks in both. (Forgotten in sorted order by the
/// later layer, the lists once parted, and a later step's take-back forgot filings of other
/// blocks in the second layer: found by `MHA_RANDOM_SCHEDULES=3` in `paged_stack.rs`.)
#[test]
fn a_step_taken_back_leaves_alike_layers_with_the_same_free_lists() {
    let owner = owner();
    let layer = || {
        let mut cache = PagedKvCacheConfig::new(4).with_block_size(2).init();
        cache.keep_undo();
        let x = cache.add_sequence_with_prompt(&[1, 2, 3, 4]).id;
        numbered_step(&mut cache, owner, &[(x, 4)], 0.0);
        let y = cache.add_sequence_with_prompt(&[5, 6, 7, 8]).id;
        numbered_step(&mut cache, owner, &[(y, 4)], 10.0);
        cache.remove_sequence(y).unwrap();
        cache.remove_sequence(x).unwrap();
        cache
    };
    let (mut first, mut second) = (layer(), layer());
    assert_eq!(
        first.free.filed,
        [2, 3, 0, 1],
        "the blocks freed, y's first"
    );
    assert!(first.same_bookkeeping(&second));
    let z = first.add_sequence();
    second.add_sequence();
    // The first layer stores a step that takes every filed block; the second refuses it.
    numbered_step(&mut first, owner, &[(z, 8)], 100.0);
    assert_eq!(first.free_blocks(), 0);
    PagedKvCache::take_back(
        std::slice::from_mut(&mut first),
        std::slice::from_mut(&mut second),
    );
    assert_eq!(first.filed_blocks(), 0);
    assert!(
        first.same_bookkeeping(&second),
        "{:?}\n{:?}",
        first.free,
        second.free
    );
}
