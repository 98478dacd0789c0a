//! Output buffers recycled between calls: the buffers that the CPU kernels (the flash op, the
//! projections) hand to flex tensors go back to a small bounded pool when the tensor drops,
//! and the next call of the same sizes writes into pages that are already mapped.
//!
//! Why: a buffer of a few hundred kilobytes or more comes from pages that the operating system
//! maps on first touch, a fault and a page clear per 4 KiB; and glibc's allocator hands freed
//! memory back to the system as soon as more than twice its mmap threshold lies free at the top
//! of its heap, which a loop of calls (serving, a training loop) reaches on every call. Those
//! faults were 15% of a forward at (8, 128, 256, 8) under `perf record`. PyTorch's outputs come
//! back from the heap instead, because the interpreter's own small objects keep its top in use.
//!
//! The pool keeps at most [`POOL_BYTES`] idle, buffers of [`MIN_BYTES`] to a quarter of that,
//! and gives the oldest back to the allocator first; it matches buffers by exact length, which
//! is what repeated calls of one shape ask for. ndarray's tensors own plain vectors, so on
//! ndarray the kernels take buffers from the pool but do not give them back.

use std::sync::Mutex;

/// The most bytes the pool keeps idle.
pub const POOL_BYTES: usize = 64 << 20;
/// Smaller buffers are left to the allocator, whose bins reuse them without faults.
pub(crate) const MIN_BYTES: usize = 128 << 10;

struct Pool {
    /// Oldest first.
    idle: Vec<Vec<f32>>,
    bytes: usize,
}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    idle: Vec::new(),
    bytes: 0,
});

fn bytes_of(buffer: &Vec<f32>) -> usize {
    buffer.capacity() * size_of::<f32>()
}

/// A buffer of `length` elements whose values are unspecified (a recycled buffer's old ones,
/// or zeros): for an output every element of which the caller writes.
pub(crate) fn buffer(length: usize) -> Vec<f32> {
    #[cfg(test)]
    if poison::on() {
        return vec![f32::NAN; length];
    }
    take(length).unwrap_or_else(|| fresh(length))
}

/// A buffer of `length` elements, each `value`.
pub(crate) fn filled(length: usize, value: f32) -> Vec<f32> {
    match take(length) {
        Some(mut buffer) => {
            buffer.fill(value);
            buffer
        }
        None => {
            let mut buffer = fresh(length);
            // A fresh buffer's untouched pages are zeros already.
            if value != 0.0 {
                buffer.fill(value);
            }
            buffer
        }
    }
}

/// A new buffer of zeros, from the allocator; a large one asks for huge pages first.
fn fresh(length: usize) -> Vec<f32> {
    // Zeroed memory of this size comes from `mmap` untouched (`calloc`), so the hint reaches
    // the pages before their first fault.
    let buffer = vec![0.0; length];
    if length * size_of::<f32>() >= HUGE_PAGE_BYTES {
        advise_huge_pages(&buffer);
    }
    buffer
}

/// Transparent huge pages: the size of one, and the smallest buffer advised to use them.
const HUGE_PAGE_BYTES: usize = 2 << 20;

/// Asks Linux to back the 2 MiB-aligned part of `buffer` with transparent huge pages, so that
/// its first touch costs a fault per 2 MiB instead of per 4 KiB. Where the system does not
/// take the hint (huge pages off, another OS) nothing changes.
///
/// Why: a buffer larger than the pool keeps (the attention weights at (1, 2048, 512, 8) are
/// 128 MiB) is fresh pages on every call; their faults, page clears and memory-cgroup
/// accounting were 20% of `fwd+weights` there under `perf record`. Linux here gives huge
/// pages only to memory that asks for them (`transparent_hugepage/enabled` = `madvise`).
fn advise_huge_pages(buffer: &[f32]) {
    #[cfg(target_os = "linux")]
    {
        let start = buffer.as_ptr() as usize;
        let end = start + std::mem::size_of_val(buffer);
        let first = start.next_multiple_of(HUGE_PAGE_BYTES);
        let last = end / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES;
        if last > first {
            // SAFETY: `first..last` is page-aligned and lies inside `buffer`'s allocation,
            // which this call borrows; MADV_HUGEPAGE changes how the kernel backs those pages,
            // never their contents. A failure (EINVAL where THP is not built in) is harmless.
            unsafe {
                libc::madvise(
                    first as *mut libc::c_void,
                    last - first,
                    libc::MADV_HUGEPAGE,
                );
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buffer;
}

fn take(length: usize) -> Option<Vec<f32>> {
    if length * size_of::<f32>() < MIN_BYTES {
        return None;
    }
    let mut pool = POOL.lock().ok()?;
    // The newest of that length: the likeliest to be in the caches still.
    let index = pool
        .idle
        .iter()
        .rposition(|buffer| buffer.len() == length)?;
    let buffer = pool.idle.remove(index);
    pool.bytes -= bytes_of(&buffer);
    Some(buffer)
}

/// Keeps `buffer` for a later call, if it is of a size the pool keeps; the oldest buffers go
/// back to the allocator when the pool would hold more than [`POOL_BYTES`].
pub(crate) fn give_back(buffer: Vec<f32>) {
    let bytes = bytes_of(&buffer);
    if !(MIN_BYTES..=POOL_BYTES / 4).contains(&bytes) {
        return;
    }
    let evicted = {
        let Ok(mut pool) = POOL.lock() else {
            return;
        };
        pool.idle.push(buffer);
        pool.bytes += bytes;
        let mut evicted = 0;
        let mut kept_bytes = pool.bytes;
        while kept_bytes > POOL_BYTES {
            kept_bytes -= bytes_of(&pool.idle[evicted]);
            evicted += 1;
        }
        pool.bytes = kept_bytes;
        pool.idle.drain(..evicted).collect::<Vec<_>>()
    };
    // Freed outside the lock: unmapping a large buffer takes a while.
    drop(evicted);
}

/// Bytes the pool holds idle.
pub fn idle_bytes() -> usize {
    POOL.lock().map_or(0, |pool| pool.bytes)
}

/// Hands every idle buffer back to the allocator (as `torch.cuda.empty_cache()` does for
/// PyTorch's GPU pool).
pub fn release() {
    let idle = match POOL.lock() {
        Ok(mut pool) => {
            pool.bytes = 0;
            std::mem::take(&mut pool.idle)
        }
        Err(_) => return,
    };
    drop(idle);
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

/// Tests' switch: while on, on this thread, [`buffer`] returns NaN-filled buffers, so that an
/// output element a kernel forgets to write shows.
#[cfg(test)]
pub(crate) mod poison {
    use std::cell::Cell;

    thread_local! {
        static ON: Cell<bool> = const { Cell::new(false) };
    }

    pub(crate) fn on() -> bool {
        ON.with(Cell::get)
    }

    /// Runs `body` with the switch on.
    pub(crate) fn with<R>(body: impl FnOnce() -> R) -> R {
        ON.with(|on| on.set(true));
        let result = body();
        ON.with(|on| on.set(false));
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pool is shared by every test thread: these tests use lengths no other test asks
    /// for, and look only for their own buffers.
    const LENGTH: usize = (MIN_BYTES / 4) + 12_345;

    /// The bound's test evicts: the tests that look for their buffer wait for it.
    static SERIAL: Mutex<()> = Mutex::new(());

    fn serial() -> std::sync::MutexGuard<'static, ()> {
        SERIAL
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn floats(bytes: &[u8]) -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    /// The flags (`VmFlags`) of the mapping of this process that holds `address`.
    #[cfg(target_os = "linux")]
    fn mapping_flags(address: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("/proc/self/smaps");
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().and_then(|field| {
                let (start, end) = field.split_once('-')?;
                Some((
                    usize::from_str_radix(start, 16).ok()?,
                    usize::from_str_radix(end, 16).ok()?,
                ))
            });
            if let Some((start, end)) = range {
                inside = (start..end).contains(&address);
            } else if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.to_string();
            }
        }
        panic!("no mapping holds {address:#x}");
    }

    /// A fresh buffer of 2 MiB or more asks for huge pages (the `hg` flag on its 2 MiB-aligned
    /// part), is zeros and keeps its values; a fill value is written. Skipped where the kernel
    /// has no transparent huge pages at all.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_large_fresh_buffer_asks_for_huge_pages() {
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
            return;
        }
        // Lengths no other test asks for, so that the pool has none.
        let length = (3 * HUGE_PAGE_BYTES) / 4 + 7;
        for value in [None, Some(2.5)] {
            let mut buffer = match value {
                None => buffer(length),
                Some(value) => filled(length + 1, value),
            };
            let first = (buffer.as_ptr() as usize).next_multiple_of(HUGE_PAGE_BYTES);
            let flags = mapping_flags(first);
            assert!(
                flags.split_whitespace().any(|flag| flag == "hg"),
                "{value:?}: flags {flags}"
            );
            assert!(buffer.iter().all(|&x| x == value.unwrap_or(0.0)));
            buffer
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = i as f32);
            assert!(buffer.iter().enumerate().all(|(i, &x)| x == i as f32));
        }
    }

    #[test]
    fn a_dropped_buffer_comes_back_for_the_same_length_only() {
        let _serial = serial();
        let first = filled(LENGTH, 1.5);
        assert!(first.iter().all(|&x| x == 1.5));
        let pointer = first.as_ptr();
        give_back(first);
        let other_length = buffer(LENGTH + 1);
        assert_ne!(other_length.as_ptr(), pointer, "another length");
        let again = buffer(LENGTH);
        assert_eq!(again.as_ptr(), pointer, "the same allocation");
        assert_eq!(again.len(), LENGTH);
        give_back(again);
        let refilled = filled(LENGTH, -0.0);
        assert_eq!(refilled.as_ptr(), pointer);
        assert!(refilled.iter().all(|x| x.to_bits() == (-0.0f32).to_bits()));
    }

    #[test]
    fn small_and_oversized_buffers_are_not_kept() {
        let small = vec![0.0f32; MIN_BYTES / 4 - 1];
        let pointer = small.as_ptr();
        give_back(small);
        assert!(take(MIN_BYTES / 4 - 1).is_none_or(|b| b.as_ptr() != pointer));
        let huge_length = POOL_BYTES / 4 / 4 + 1;
        let before = idle_bytes();
        give_back(vec![0.0f32; huge_length]);
        assert!(
            take(huge_length).is_none(),
            "{huge_length} floats kept ({before} idle before)"
        );
    }

    #[test]
    fn the_pool_never_holds_more_than_its_bound() {
        let _serial = serial();
        let length = POOL_BYTES / 4 / 4 - 7;
        for _ in 0..6 {
            give_back(vec![2.0f32; length]);
            assert!(idle_bytes() <= POOL_BYTES, "{} idle", idle_bytes());
        }
    }

    #[test]
    fn poisoned_buffers_are_nan() {
        let values = poison::with(|| buffer(LENGTH + 99));
        assert!(values.iter().all(|x| x.is_nan()));
        assert!(!poison::on());
    }

    #[cfg(feature = "flex")]
    #[test]
    fn flex_storage_reads_writes_converts_and_recycles() {
        let _serial = serial();
        let values: Vec<f32> = (0..LENGTH + 7).map(|i| i as f32).collect();
        let pointer = values.as_ptr();
        let mut bytes = into_bytes(values);
        assert_eq!(bytes.len(), (LENGTH + 7) * 4);
        assert_eq!(floats(&bytes)[LENGTH + 6], (LENGTH + 6) as f32);
        bytes[12..16].copy_from_slice(&(-1.0f32).to_ne_bytes());
        let copy = bytes.clone();
        assert_eq!(floats(&copy)[3], -1.0);
        drop(copy);
        let vector = bytes
            .try_into_vec::<f32>()
            .expect("detached without a copy");
        assert_eq!(vector.as_ptr(), pointer);
        assert_eq!(vector[3], -1.0);
        let pointer_2 = vector.as_ptr();
        let recycled = into_bytes(vector);
        drop(recycled);
        let again = take(LENGTH + 7).expect("given back on drop");
        assert_eq!(again.as_ptr(), pointer_2);
    }
}
