//! Output buffers for the CPU kernels (the flash op's outputs and gradients, the projections'
//! results), reused between calls where the backend gives them back.
//!
//! Why: an output of a few hundred kilobytes or more comes from pages that the operating system
//! maps on first touch, a fault and a page clear per 4 KiB, and glibc's allocator hands memory
//! of that size back to the system as soon as it is freed, so a loop of calls of one shape (a
//! training loop, serving) faults every output in again on every call: those faults were 15%
//! of a forward at (8, 128, 256, 8) on flex under `perf record`. Flex's tensors give their
//! buffer back here when they drop ([`into_bytes`]), and the next call of the same size class
//! writes into pages that are mapped already. ndarray's tensors own plain vectors, which they
//! free: on ndarray the kernels allocate plainly ([`BufferSource::Allocator`]).
//!
//! The pool is one per process and bounded: it keeps at most [`limit`] bytes idle
//! ([`DEFAULT_LIMIT`] unless [`set_limit`] changes it; 0 turns it off), in size classes (four
//! per doubling, so that a buffer is at most a quarter larger than asked for), and frees the
//! oldest idle buffer first when a newer one would pass the bound. Buffers under [`MIN_BYTES`]
//! are left to the allocator, whose bins reuse them without faults. [`release`] frees every idle
//! buffer, as `torch.cuda.empty_cache()` does for PyTorch's GPU pool.
//!
//! Transparent huge pages (a fault per 2 MiB instead of per 4 KiB, and fewer TLB misses) are
//! opt-in, as PyTorch's `THP_MEM_ALLOC_ENABLE` makes them: with `MHA_HUGE_PAGES=1` in the
//! environment (read once) or [`set_huge_pages`], a fresh buffer of 2 MiB or more asks Linux
//! for them before its first touch. Whether they pay depends on the machine (on a virtual
//! machine whose host takes freed memory back, faulting huge pages in again can cost more than
//! it saves), which a library cannot know.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::execution::FreshOutputs;

/// The most bytes the pool keeps idle unless [`set_limit`] says otherwise: room for the
/// outputs of one call at a few thousand tokens (the per-head weights of one 2048-token
/// sequence with 8 heads are 128 MiB).
pub const DEFAULT_LIMIT: usize = 256 << 20;

/// Buffers smaller than this are never pooled: the allocator's bins reuse them without faults.
pub const MIN_BYTES: usize = 128 << 10;

/// The size of a transparent huge page, and the smallest buffer that asks for them.
const HUGE_PAGE_BYTES: usize = 2 << 20;

static LIMIT: AtomicUsize = AtomicUsize::new(DEFAULT_LIMIT);

/// Sets the most bytes the pool keeps idle (0 turns it off) and frees the oldest idle buffers
/// beyond it. One setting for the whole process.
pub fn set_limit(bytes: usize) {
    LIMIT.store(bytes, Ordering::Relaxed);
    let evicted = pool().evict_to(bytes);
    // Freed outside the lock: unmapping a large buffer takes a while.
    drop(evicted);
}

/// The most bytes the pool keeps idle ([`DEFAULT_LIMIT`] unless [`set_limit`] changed it).
pub fn limit() -> usize {
    LIMIT.load(Ordering::Relaxed)
}

/// The bytes the pool holds idle now.
pub fn idle_bytes() -> usize {
    pool().bytes
}

/// Frees every idle buffer.
pub fn release() {
    let idle = pool().evict_to(0);
    drop(idle);
}

const HUGE_PAGES_UNSET: u8 = 0;
const HUGE_PAGES_OFF: u8 = 1;
const HUGE_PAGES_ON: u8 = 2;
static HUGE_PAGES: AtomicU8 = AtomicU8::new(HUGE_PAGES_UNSET);

/// Whether fresh buffers of 2 MiB or more ask for transparent huge pages (Linux only; off
/// unless `MHA_HUGE_PAGES=1` was in the environment at the first call or [`set_huge_pages`]
/// turned them on).
pub fn huge_pages() -> bool {
    match HUGE_PAGES.load(Ordering::Relaxed) {
        HUGE_PAGES_UNSET => {
            let from_environment = std::env::var("MHA_HUGE_PAGES").is_ok_and(|value| value == "1");
            let setting = if from_environment {
                HUGE_PAGES_ON
            } else {
                HUGE_PAGES_OFF
            };
            // A concurrent `set_huge_pages` wins over the environment.
            let _ = HUGE_PAGES.compare_exchange(
                HUGE_PAGES_UNSET,
                setting,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
            HUGE_PAGES.load(Ordering::Relaxed) == HUGE_PAGES_ON
        }
        setting => setting == HUGE_PAGES_ON,
    }
}

/// Turns the huge-page request for fresh buffers of 2 MiB or more on or off, for the whole
/// process, whatever `MHA_HUGE_PAGES` says.
pub fn set_huge_pages(enabled: bool) {
    let setting = if enabled {
        HUGE_PAGES_ON
    } else {
        HUGE_PAGES_OFF
    };
    HUGE_PAGES.store(setting, Ordering::Relaxed);
}

/// Where a backend's output buffers come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BufferSource {
    /// The pool, to which the backend's tensors give their buffers back (flex).
    #[cfg_attr(not(feature = "flex"), allow(dead_code))]
    Pool,
    /// The allocator: the backend's tensors free their buffers (ndarray).
    #[cfg_attr(not(feature = "ndarray"), allow(dead_code))]
    Allocator,
}

/// A buffer of `length` elements for an output every element of which the caller writes: its
/// values are unspecified (a reused buffer's earlier ones, or zeros), or NaN if `fresh` asks
/// for that.
pub(crate) fn buffer(length: usize, source: BufferSource, fresh: FreshOutputs) -> Vec<f32> {
    if fresh == FreshOutputs::Nan {
        return vec![f32::NAN; length];
    }
    match source {
        BufferSource::Pool => take(length).unwrap_or_else(|| allocate(length, size_class(length))),
        BufferSource::Allocator => allocate(length, length),
    }
}

/// A buffer of `length` elements, each `value` (bit for bit: `-0.0` is written as such).
pub(crate) fn filled(length: usize, value: f32, source: BufferSource) -> Vec<f32> {
    let reused = match source {
        BufferSource::Pool => take(length),
        BufferSource::Allocator => None,
    };
    match reused {
        Some(mut buffer) => {
            buffer.fill(value);
            buffer
        }
        None => {
            let capacity = match source {
                BufferSource::Pool => size_class(length),
                BufferSource::Allocator => length,
            };
            let mut buffer = allocate(length, capacity);
            // A fresh buffer is zeros already.
            if value.to_bits() != 0 {
                buffer.fill(value);
            }
            buffer
        }
    }
}

/// The capacity the pool gives a buffer of `length` elements: `length` rounded up to one of
/// four classes per doubling (`2ᵏ`, `1.25 · 2ᵏ`, `1.5 · 2ᵏ`, `1.75 · 2ᵏ`), so that calls whose
/// sizes differ a little (another batch's padding, a cache a token longer) share buffers, for
/// at most a quarter more memory than asked for.
pub(crate) fn size_class(length: usize) -> usize {
    if length < 8 {
        return length;
    }
    // A quarter of the largest power of two not above `length`.
    let step = 1usize << (usize::BITS - 3 - length.leading_zeros());
    length.next_multiple_of(step)
}

/// Idle buffers, oldest first, each with a size class's capacity.
struct Pool {
    idle: Vec<Vec<f32>>,
    bytes: usize,
}

impl Pool {
    const fn new() -> Self {
        Self {
            idle: Vec::new(),
            bytes: 0,
        }
    }

    /// The newest idle buffer of `capacity` elements: the likeliest to be in the caches still.
    fn take(&mut self, capacity: usize) -> Option<Vec<f32>> {
        let index = self
            .idle
            .iter()
            .rposition(|buffer| buffer.capacity() == capacity)?;
        let buffer = self.idle.remove(index);
        self.bytes -= bytes_of(&buffer);
        Some(buffer)
    }

    /// Keeps `buffer`; returns the oldest buffers, which the pool no longer holds, so that it
    /// holds at most `limit` bytes.
    #[cfg_attr(not(feature = "flex"), allow(dead_code))]
    fn keep(&mut self, buffer: Vec<f32>, limit: usize) -> Vec<Vec<f32>> {
        self.bytes += bytes_of(&buffer);
        self.idle.push(buffer);
        self.evict_to(limit)
    }

    /// The oldest buffers, no longer held, so that the pool holds at most `limit` bytes.
    fn evict_to(&mut self, limit: usize) -> Vec<Vec<f32>> {
        let mut evicted = 0;
        while self.bytes > limit {
            self.bytes -= bytes_of(&self.idle[evicted]);
            evicted += 1;
        }
        self.idle.drain(..evicted).collect()
    }
}

static POOL: Mutex<Pool> = Mutex::new(Pool::new());

/// The pool, whatever a panicking holder left (its two fields are updated together, between
/// calls that do not panic).
fn pool() -> MutexGuard<'static, Pool> {
    POOL.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn bytes_of(buffer: &Vec<f32>) -> usize {
    buffer.capacity() * size_of::<f32>()
}

/// An idle buffer of `length`'s size class, resized to `length`, if the pool has one.
fn take(length: usize) -> Option<Vec<f32>> {
    if length * size_of::<f32>() < MIN_BYTES {
        return None;
    }
    let mut buffer = pool().take(size_class(length))?;
    // Within the capacity: no reallocation.
    buffer.resize(length, 0.0);
    Some(buffer)
}

/// Keeps `buffer` for a later call if it has a size class's capacity of [`MIN_BYTES`] or more
/// and fits the limit; the oldest idle buffers go back to the allocator when the pool would
/// hold more than the limit.
#[cfg_attr(not(feature = "flex"), allow(dead_code))]
pub(crate) fn give_back(buffer: Vec<f32>) {
    let (capacity, bytes, limit) = (buffer.capacity(), bytes_of(&buffer), limit());
    if bytes < MIN_BYTES || bytes > limit || capacity != size_class(capacity) {
        return;
    }
    let evicted = pool().keep(buffer, limit);
    // Freed outside the lock: unmapping a large buffer takes a while.
    drop(evicted);
}

/// `length` zeros in an allocation of `capacity` elements; a large one asks for huge pages
/// first when they are turned on ([`huge_pages`]).
fn allocate(length: usize, capacity: usize) -> Vec<f32> {
    // Zeroed memory of this size comes from `mmap` untouched (`calloc`), so the request reaches
    // the pages before their first fault.
    let mut buffer = vec![0.0f32; capacity];
    buffer.truncate(length);
    if capacity * size_of::<f32>() >= HUGE_PAGE_BYTES && huge_pages() {
        advise_huge_pages(&buffer);
    }
    buffer
}

/// Asks Linux to back the 2 MiB-aligned part of `buffer`'s allocation with transparent huge
/// pages. Where the system does not take the hint (huge pages off, another OS) nothing
/// changes.
fn advise_huge_pages(buffer: &Vec<f32>) {
    #[cfg(target_os = "linux")]
    if let Some(pages) = aligned_part(buffer.as_ptr() as usize, bytes_of(buffer)) {
        // SAFETY: `pages` is page-aligned and lies inside the vector's allocation (its capacity),
        // which this call borrows; MADV_HUGEPAGE changes how the kernel backs those pages, never
        // their contents. A failure (EINVAL where THP is not built in) is harmless.
        unsafe {
            libc::madvise(
                pages.start as *mut libc::c_void,
                pages.len(),
                libc::MADV_HUGEPAGE,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buffer;
}

/// The addresses of the whole huge pages inside `bytes` bytes from `start`, if there are any.
fn aligned_part(start: usize, bytes: usize) -> Option<std::ops::Range<usize>> {
    let first = start.next_multiple_of(HUGE_PAGE_BYTES);
    let last = (start + bytes) / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES;
    (last > first).then_some(first..last)
}

/// `values` as flex tensor storage that gives its buffer back to the pool when it drops.
#[cfg(feature = "flex")]
pub(crate) fn into_bytes(values: Vec<f32>) -> burn::backend::Bytes {
    let length = values.len() * size_of::<f32>();
    // SAFETY: the first `length` bytes of the controller's memory are `values`' elements, all
    // initialised (a `Vec`'s first `len` elements are).
    unsafe { burn::backend::Bytes::from_controller(Box::new(Recycled { values }), length) }
}

/// The allocation behind [`into_bytes`]: a `Vec<f32>`, exposed as its bytes.
#[cfg(feature = "flex")]
struct Recycled {
    values: Vec<f32>,
}

#[cfg(feature = "flex")]
mod controller {
    use std::mem::{ManuallyDrop, MaybeUninit};
    use std::ptr::NonNull;

    use burn_std::{AccessError, AccessPolicy, AllocationController, AllocationProperty};

    use super::Recycled;

    impl AllocationController for Recycled {
        fn alloc_align(&self) -> usize {
            align_of::<f32>()
        }

        fn property(&self) -> AllocationProperty {
            AllocationProperty::Native
        }

        unsafe fn memory_mut(
            &mut self,
            _policy: AccessPolicy,
        ) -> Result<&mut [MaybeUninit<u8>], AccessError> {
            let bytes = self.capacity();
            // SAFETY: the vector's allocation spans `capacity · 4` bytes, which the returned
            // slice borrows mutably with `self`; any byte pattern is a valid `f32`, so whatever
            // the caller writes (initialised, as the trait requires) leaves valid elements.
            Ok(unsafe { std::slice::from_raw_parts_mut(self.values.as_mut_ptr().cast(), bytes) })
        }

        fn memory(&self, _policy: AccessPolicy) -> Result<&[MaybeUninit<u8>], AccessError> {
            // SAFETY: as in `memory_mut`, borrowed immutably; bytes past the vector's length are
            // read only as `MaybeUninit`.
            Ok(unsafe { std::slice::from_raw_parts(self.values.as_ptr().cast(), self.capacity()) })
        }

        fn capacity(&self) -> usize {
            self.values.capacity() * size_of::<f32>()
        }

        fn try_detach(&mut self) -> Option<NonNull<u8>> {
            // The caller rebuilds the vector from this pointer and `capacity()` (read before
            // this call) with `f32`'s alignment, which is how the global allocator allocated it;
            // the controller keeps an empty vector, so nothing is given back or freed twice.
            let mut values = ManuallyDrop::new(std::mem::take(&mut self.values));
            NonNull::new(values.as_mut_ptr().cast())
        }
    }

    impl Drop for Recycled {
        fn drop(&mut self) {
            super::give_back(std::mem::take(&mut self.values));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The global pool is shared by every test thread: these tests use size classes no other
    /// test's outputs fall in (a little over 3 MiB), look only for their own buffers, and take
    /// turns, since some change the limit.
    const LENGTH: usize = (3 << 20) / 4 + 12_345;

    static SERIAL: Mutex<()> = Mutex::new(());

    fn serial() -> MutexGuard<'static, ()> {
        SERIAL
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    #[test]
    fn size_classes_are_four_per_doubling_and_at_most_a_quarter_larger() {
        assert_eq!(size_class(5), 5, "tiny lengths are their own class");
        assert_eq!(size_class(1 << 20), 1 << 20, "powers of two are classes");
        assert_eq!(size_class((1 << 20) + 1), 5 << 18);
        assert_eq!(size_class(6 << 18), 6 << 18);
        assert_eq!(size_class((7 << 18) + 1), 1 << 21);
        let mut classes = std::collections::BTreeSet::new();
        for length in (1 << 16)..(1 << 17) {
            let class = size_class(length);
            assert!(
                class >= length && 4 * class <= 5 * length,
                "{length} → {class}"
            );
            assert_eq!(size_class(class), class, "a class is its own class");
            classes.insert(class);
        }
        let quarter = 1 << 14;
        let expected = (4..=8).map(|quarters| quarters * quarter).collect();
        assert_eq!(
            classes, expected,
            "the octave's four classes and the next power of two"
        );
    }

    #[test]
    fn a_given_back_buffer_serves_its_size_class_only() {
        let _serial = serial();
        let first = filled(LENGTH, 1.5, BufferSource::Pool);
        assert!(first.iter().all(|&x| x == 1.5));
        assert_eq!(first.capacity(), size_class(LENGTH));
        let pointer = first.as_ptr();
        give_back(first);
        let other_class = buffer(
            size_class(LENGTH) + 1,
            BufferSource::Pool,
            FreshOutputs::Unspecified,
        );
        assert_ne!(other_class.as_ptr(), pointer, "another class");
        let same_class = LENGTH + 1000;
        assert_eq!(size_class(same_class), size_class(LENGTH));
        let again = buffer(same_class, BufferSource::Pool, FreshOutputs::Unspecified);
        assert_eq!(again.as_ptr(), pointer, "the same allocation");
        assert_eq!(again.len(), same_class);
        give_back(again);
        let refilled = filled(LENGTH, -0.0, BufferSource::Pool);
        assert_eq!(refilled.as_ptr(), pointer);
        assert!(refilled.iter().all(|x| x.to_bits() == (-0.0f32).to_bits()));
    }

    #[test]
    fn the_allocator_source_never_reuses_and_fills_negative_zero_bit_for_bit() {
        let _serial = serial();
        let pooled = filled(LENGTH, 0.0, BufferSource::Pool);
        let pointer = pooled.as_ptr();
        give_back(pooled);
        let plain = filled(LENGTH, -0.0, BufferSource::Allocator);
        assert_ne!(plain.as_ptr(), pointer, "not from the pool");
        assert_eq!(plain.capacity(), LENGTH, "no size class");
        assert!(plain.iter().all(|x| x.to_bits() == (-0.0f32).to_bits()));
        let zeros = buffer(LENGTH, BufferSource::Allocator, FreshOutputs::Unspecified);
        assert!(zeros.iter().all(|&x| x == 0.0));
        release();
    }

    #[test]
    fn nan_fresh_outputs_are_nan_and_never_reused() {
        let _serial = serial();
        let pooled = filled(LENGTH, 2.0, BufferSource::Pool);
        let pointer = pooled.as_ptr();
        give_back(pooled);
        let poisoned = buffer(LENGTH, BufferSource::Pool, FreshOutputs::Nan);
        assert_ne!(poisoned.as_ptr(), pointer);
        assert!(poisoned.iter().all(|x| x.is_nan()));
        release();
    }

    #[test]
    fn small_buffers_are_not_kept() {
        // A class of half the smallest pooled size.
        let length = MIN_BYTES / 8;
        let small = vec![0.0f32; size_class(length)];
        let pointer = small.as_ptr();
        give_back(small);
        let kept = pool().take(size_class(length));
        assert!(kept.is_none_or(|buffer| buffer.as_ptr() != pointer));
    }

    #[test]
    fn the_pool_frees_its_oldest_buffers_beyond_its_limit() {
        let mut pool = Pool::new();
        let [a, b, c] = [1.0f32, 2.0, 3.0].map(|value| vec![value; 1000]);
        let a_pointer = a.as_ptr();
        assert!(pool.keep(a, 8000).is_empty());
        assert!(pool.keep(b, 8000).is_empty());
        let evicted = pool.keep(c, 8000);
        assert_eq!(evicted.len(), 1);
        assert_eq!(evicted[0].as_ptr(), a_pointer, "the oldest");
        assert_eq!(pool.bytes, 8000);
        assert_eq!(pool.take(1000).map(|b| b[0]), Some(3.0), "the newest first");
        assert_eq!(pool.take(1000).map(|b| b[0]), Some(2.0));
        assert!(pool.take(1000).is_none());
        assert_eq!(pool.bytes, 0);
    }

    #[test]
    fn the_limit_bounds_the_idle_bytes_and_zero_turns_the_pool_off() {
        let _serial = serial();
        let length = size_class(LENGTH);
        set_limit(3 * length * 4);
        for _ in 0..5 {
            give_back(vec![2.0f32; length]);
            assert!(idle_bytes() <= limit(), "{} idle", idle_bytes());
        }
        set_limit(length * 4 - 1);
        assert!(idle_bytes() < length * 4, "lowering the limit evicts");
        give_back(vec![2.0f32; length]);
        assert!(
            take(length).is_none(),
            "a buffer over the limit is not kept"
        );
        set_limit(0);
        give_back(vec![2.0f32; length]);
        assert_eq!(idle_bytes(), 0, "off");
        set_limit(DEFAULT_LIMIT);
        give_back(vec![2.0f32; length]);
        assert!(idle_bytes() >= length * 4);
        release();
        assert!(take(length).is_none(), "released");
    }

    #[cfg(feature = "flex")]
    #[test]
    fn flex_storage_reads_writes_converts_and_comes_back() {
        let _serial = serial();
        let floats = |bytes: &[u8]| -> Vec<f32> {
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        };
        let length = LENGTH + 7;
        let mut values = buffer(length, BufferSource::Pool, FreshOutputs::Unspecified);
        values
            .iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = i as f32);
        let pointer = values.as_ptr();
        let mut bytes = into_bytes(values);
        assert_eq!(bytes.len(), length * 4);
        assert_eq!(floats(&bytes)[length - 1], (length - 1) as f32);
        bytes[12..16].copy_from_slice(&(-1.0f32).to_ne_bytes());
        let copy = bytes.clone();
        assert_eq!(floats(&copy)[3], -1.0);
        drop(copy);
        let vector = bytes
            .try_into_vec::<f32>()
            .expect("detached without a copy");
        assert_eq!(vector.as_ptr(), pointer);
        assert_eq!(vector[3], -1.0);
        drop(into_bytes(vector));
        let again = take(length).expect("given back on drop");
        assert_eq!(again.as_ptr(), pointer);
    }
}
