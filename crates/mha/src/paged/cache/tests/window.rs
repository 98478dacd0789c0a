//! Sequences under a sliding window giving their blocks back, and sequences cut back
//! ([`PagedKvCache::truncate`]): the pool, the refusals, prefix filings and steps taken back.

use super::*;
use burn::tensor::DType;

/// A module with a sliding window of 6 positions over blocks of 4.
fn windowed() -> (CacheOwner, Option<usize>) {
    (owner(), Some(6))
}

#[test]
fn blocks_wholly_behind_the_window_go_back_to_the_pool_after_each_step() {
    let module = windowed();
    let mut cache = PagedKvCacheConfig::new(8).with_block_size(4).init();
    let a = cache.add_sequence();
    // Position 6 (the next query) sees 1..=6: block 0 (0..4) is still seen.
    numbered_step_in_window(&mut cache, module, &[(a, 6)], 0.0);
    assert_eq!((cache.first_held(a), cache.blocks_in_use()), (Some(0), 2));
    // Position 9 sees 4..=9: block 0 goes back.
    numbered_step_in_window(&mut cache, module, &[(a, 3)], 100.0);
    assert_eq!((cache.first_held(a), cache.blocks_in_use()), (Some(4), 2));
    assert_eq!(cache.table(a).unwrap().blocks[0], RELEASED);
    assert_eq!(cache.free_blocks(), 6);
    // A prompt of 20 in one step takes 5 blocks, then gives back all but the last two: the
    // step's first rows saw the blocks it gives back.
    numbered_step_in_window(&mut cache, module, &[(a, 20)], 200.0);
    assert_eq!((cache.len(a), cache.first_held(a)), (Some(29), Some(24)));
    assert_eq!(cache.blocks_in_use(), 2);
    let held = &cache.table(a).unwrap().held();
    assert_eq!(held.len(), 2);
    // What the blocks still hold is the step's last 5 positions, 24..29 (rows 15..20).
    let (keys, _) = cache.stores().unwrap();
    let stored = keys.gather(cache.table(a).unwrap(), 29, burn::tensor::DType::F32);
    let first_keys = stored.into_data().to_vec::<f32>().unwrap();
    assert_eq!(first_keys.len(), 5 * 2);
    assert_eq!(first_keys[..2], [230.0, 231.0]);
    cache.remove_sequence(a).unwrap();
    assert_eq!((cache.blocks_in_use(), cache.free_blocks()), (0, 8));

    // Without a window every block stays.
    let mut cache = PagedKvCacheConfig::new(8).with_block_size(4).init();
    let b = cache.add_sequence();
    numbered_step_in_window(&mut cache, (owner(), None), &[(b, 29)], 0.0);
    assert_eq!((cache.first_held(b), cache.blocks_in_use()), (Some(0), 8));
}

#[test]
fn a_fork_of_a_prefix_whose_window_was_given_back_is_refused() {
    let module = windowed();
    let mut cache = PagedKvCacheConfig::new(8).with_block_size(4).init();
    let a = cache.add_sequence();
    numbered_step_in_window(&mut cache, module, &[(a, 9)], 0.0);
    assert_eq!(cache.first_held(a), Some(4));
    // A fork of 8 positions would see 3..=8; of 9, 4..=9.
    assert_eq!(
        cache.fork_prefix(a, 8),
        Err(PagedCacheError::PrefixReleased {
            sequence: a,
            prefix: 8,
            first_held: 4
        })
    );
    let before = cache.blocks_in_use();
    let fork = cache.fork_prefix(a, 9).unwrap();
    assert_eq!(
        (cache.first_held(fork), cache.len(fork)),
        (Some(4), Some(9))
    );
    // An empty fork sees nothing; a whole fork what `a` sees.
    let empty = cache.fork_prefix(a, 0).unwrap();
    let whole = cache.fork(a).unwrap();
    assert_eq!(cache.blocks_in_use(), before, "shared, not copied");
    for id in [a, fork, empty, whole] {
        cache.remove_sequence(id).unwrap();
    }
    assert_eq!((cache.blocks_in_use(), cache.free_blocks()), (0, 8));
}

#[test]
fn blocks_given_back_keep_their_filing_and_a_later_prompt_shares_them() {
    let module = windowed();
    let mut cache = PagedKvCacheConfig::new(8).with_block_size(4).init();
    let prompt: Vec<Token> = (1..=10).collect();
    let a = cache.add_sequence_with_prompt(&prompt).id;
    numbered_step_in_window(&mut cache, module, &[(a, 10)], 0.0);
    // Blocks 0 and 1 (filed) lie behind position 10's window (5..=10): free, still filed.
    assert_eq!((cache.first_held(a), cache.blocks_in_use()), (Some(4), 2));
    assert_eq!(cache.filed_blocks(), 2);
    let b = cache.add_sequence_with_prompt(&prompt[..9]);
    assert_eq!(b.cached, 8);
    assert_eq!(
        cache.blocks_in_use(),
        3,
        "block 0 taken back from the free ones"
    );
}

#[test]
fn a_step_that_gave_blocks_back_is_taken_back() {
    let module = windowed();
    let mut cache = PagedKvCacheConfig::new(16).with_block_size(4).init();
    cache.keep_undo();
    let prompt: Vec<Token> = (1..=7).collect();
    let a = cache.add_sequence_with_prompt(&prompt).id;
    numbered_step_in_window(&mut cache, module, &[(a, 7)], 0.0);
    let b = cache.add_sequence();
    let c = cache.fork(a).unwrap();
    numbered_step_in_window(&mut cache, module, &[(b, 2)], 50.0);
    let d = cache.add_sequence_with_prompt(&[7; 12]).id;
    // `a` copies the partial block it shares with `c` and gives back its filed block 0, which
    // `c` still holds; `b` gives back its block 0 and one that this very step took; `d` files
    // three blocks and gives back the first (free, and filed).
    let overwritten = taken_back(&mut cache, &[(a, 2), (b, 14), (c, 1), (d, 12)]);
    assert!(overwritten.is_empty());
    numbered_step_in_window(
        &mut cache,
        module,
        &[(a, 2), (b, 14), (c, 1), (d, 12)],
        500.0,
    );
    let first_held = [a, b, c, d].map(|id| cache.first_held(id).unwrap());
    assert_eq!(first_held, [4, 8, 0, 4]);
    assert_eq!(
        cache.blocks_in_use(),
        2 + 2 + 2 + 3 - 1,
        "`a`'s block 0 shared with `c`"
    );
}

#[test]
fn a_sequence_cut_back_gives_its_later_blocks_back_and_writes_into_a_copy_of_a_shared_one() {
    let owner = owner();
    let mut cache = PagedKvCacheConfig::new(8).with_block_size(4).init();
    let prompt: Vec<Token> = (1..=10).collect();
    let a = cache.add_sequence_with_prompt(&prompt).id;
    numbered_step(&mut cache, owner, &[(a, 10)], 0.0);
    let fork = cache.fork(a).unwrap();
    assert_eq!((cache.blocks_in_use(), cache.filed_blocks()), (3, 2));
    // Cut back into its second block, filed and shared with the fork: nothing goes back.
    cache.truncate(a, 6).unwrap();
    assert_eq!(
        (cache.len(a), cache.tokens(a)),
        (Some(6), Some(&prompt[..6]))
    );
    assert_eq!(cache.blocks_in_use(), 3);
    // Its next step copies the shared block before writing over positions 6 and 7.
    numbered_step(&mut cache, owner, &[(a, 3)], 100.0);
    assert_eq!(cache.blocks_in_use(), 5);
    let (keys, _) = cache.stores().unwrap();
    let gathered = |id| {
        let stored = keys.gather(cache.table(id).unwrap(), cache.len(id).unwrap(), DType::F32);
        stored.into_data().to_vec::<f32>().unwrap()
    };
    let (ours, forked) = (gathered(a), gathered(fork));
    assert_eq!(ours[..12], forked[..12], "positions 0..6 as they were");
    assert_eq!(ours[12..14], [100.0, 101.0]);
    assert_eq!(forked[12..14], [12.0, 13.0], "the fork's block unchanged");
    // Cut to nothing, then removed: every block of `a` goes back.
    cache.truncate(a, 0).unwrap();
    assert_eq!((cache.len(a), cache.blocks_in_use()), (Some(0), 3));
    cache.truncate(a, 5).unwrap();
    assert_eq!(cache.len(a), Some(0), "a longer length changes nothing");
    cache.remove_sequence(fork).unwrap();
    cache.remove_sequence(a).unwrap();
    assert_eq!(cache.blocks_in_use(), 0);
    assert_eq!(
        cache.truncate(a, 0),
        Err(PagedCacheError::UnknownSequence(a))
    );
}

#[test]
fn a_cut_into_a_given_back_window_is_refused_and_changes_nothing() {
    let module = windowed();
    let mut cache = PagedKvCacheConfig::new(8).with_block_size(4).init();
    let a = cache.add_sequence();
    numbered_step_in_window(&mut cache, module, &[(a, 13)], 0.0);
    assert_eq!(cache.first_held(a), Some(8));
    let before = cache.clone();
    // 12 positions: the next query sees 7..=12.
    assert_eq!(
        cache.truncate(a, 12),
        Err(PagedCacheError::PrefixReleased {
            sequence: a,
            prefix: 12,
            first_held: 8
        })
    );
    assert!(cache.same_bookkeeping(&before));
    // 13 keeps all. Under a window of 1 a query sees only itself, but a cut to 5 would write
    // into block 1, given back.
    cache.truncate(a, 13).unwrap();
    cache.window = Some(1);
    assert!(matches!(
        cache.check_prefix(a, 5),
        Err(PagedCacheError::PrefixReleased { .. })
    ));
    assert_eq!(cache.check_prefix(a, 8), Ok(()));
    cache.truncate(a, 8).unwrap();
    assert_eq!((cache.first_held(a), cache.blocks_in_use()), (Some(8), 0));
}
