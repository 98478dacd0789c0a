//! Output buffers recycled between calls: the buffers that the CPU kernels (the flash op, the
//! projections) hand to flex tensors go back to a bounded pool when the tensor drops, and the
//! next call of the same sizes writes into pages that are already mapped.
//!
//! Why: a buffer of a few hundred kilobytes or more comes from pages that the operating system
//! maps on first touch, a fault and a page clear per 4 KiB; and glibc's allocator hands freed
//! memory back to the system as soon as more than twice its mmap threshold lies free at the top
//! of its heap, which a loop of calls (serving, a training loop) reaches on every call. Those
//! faults were 15% of a forward at (8, 128, 256, 8) under `perf record`. PyTorch's outputs come
//! back from the heap instead, because the interpreter's own small objects keep its top in use.
//!
//! Two tiers, both matching buffers by exact length (what repeated calls of one shape ask for)
//! and giving the oldest back to the allocator first:
//! - buffers of [`MIN_BYTES`] to a quarter of [`POOL_BYTES`] stay resident, at most
//!   [`POOL_BYTES`] of them;
//! - larger ones (the attention weights at long sequences, the projections' results there) are
//!   kept *lazily freed* (Linux's `MADV_FREE`): their pages stay mapped, but the kernel may take
//!   them back without writing anything out whenever it needs memory, and a page it took reads
//!   as zeros and faults in a fresh one on its next write. At most a quarter of the machine's
//!   memory is kept so. Elsewhere (another OS, a kernel without `MADV_FREE`) they are freed.
//!
//! Why the second tier: on a virtual machine whose balloon reports free pages to the host
//! (virtio's free page reporting, the EPYC of the README), a fresh page faults twice, in the
//! guest and in the host. Mapping, writing and unmapping 2 GiB (the per-head weights of
//! (1, 8192, 512, 8)) took 0.26-1.84 s per round there, one second apart; writing a lazily
//! freed 2 GiB again took 0.085-0.094 s. Those page clears were 45% of `fwd+weights` at that
//! shape under `perf record`.
//!
//! ndarray's tensors own plain vectors, so on ndarray the kernels take buffers from the pool
//! but do not give them back ([`Fate::Freed`]).
//!
//! A fresh buffer of 2 MiB or more asks for transparent huge pages before its first touch if it
//! will be recycled; if it will be freed, only where that pays for one touch
//! ([`huge_pages_pay`]): always on bare metal; under free page reporting, not when the last
//! output as large that was freed left the kernels two seconds ago or more, since its memory
//! may have gone back to the host by then. On the EPYC, ndarray's `fwd+weights` at
//! (1, 8192, 512, 8) alternated with Burn's MHA went from 2.88-3.31 s (huge pages on reported
//! memory) to 1.65-1.91 s.

use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The most bytes the pool keeps idle and resident.
pub const POOL_BYTES: usize = 64 << 20;
/// Smaller buffers are left to the allocator, whose bins reuse them without faults.
pub(crate) const MIN_BYTES: usize = 128 << 10;
/// Larger buffers are kept lazily freed.
const RESIDENT_MAX_BYTES: usize = POOL_BYTES / 4;

/// Idle buffers of one tier, oldest first.
struct Tier {
    idle: Vec<Vec<f32>>,
    bytes: usize,
}

impl Tier {
    const fn new() -> Self {
        Self {
            idle: Vec::new(),
            bytes: 0,
        }
    }

    /// The newest idle buffer of `length` elements: the likeliest to be in the caches still.
    fn take(&mut self, length: usize) -> Option<Vec<f32>> {
        let index = self
            .idle
            .iter()
            .rposition(|buffer| buffer.len() == length)?;
        let buffer = self.idle.remove(index);
        self.bytes -= bytes_of(&buffer);
        Some(buffer)
    }

    /// Keeps `buffer`; returns the oldest buffers, which the tier no longer holds, so that it
    /// holds at most `bound` bytes.
    fn keep(&mut self, buffer: Vec<f32>, bound: usize) -> Vec<Vec<f32>> {
        self.bytes += bytes_of(&buffer);
        self.idle.push(buffer);
        let mut evicted = 0;
        while self.bytes > bound {
            self.bytes -= bytes_of(&self.idle[evicted]);
            evicted += 1;
        }
        self.idle.drain(..evicted).collect()
    }

    fn clear(&mut self) -> Vec<Vec<f32>> {
        self.bytes = 0;
        std::mem::take(&mut self.idle)
    }
}

struct Pool {
    resident: Tier,
    lazily_freed: Tier,
}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    resident: Tier::new(),
    lazily_freed: Tier::new(),
});

fn bytes_of(buffer: &Vec<f32>) -> usize {
    buffer.capacity() * size_of::<f32>()
}

/// What becomes of an output buffer once its tensor drops, which decides whether a fresh one
/// asks for huge pages ([`fresh`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Fate {
    /// It comes back to the pool (flex's storage): its pages serve the later calls of its size,
    /// so huge pages repay their first touch.
    Recycled,
    /// It is freed (ndarray's tensors own their vectors): every call touches fresh pages.
    Freed,
}

/// A buffer of `length` elements whose values are unspecified (a recycled buffer's old ones,
/// or zeros): for an output every element of which the caller writes.
pub(crate) fn buffer(length: usize, fate: Fate) -> Vec<f32> {
    #[cfg(test)]
    if poison::on() {
        return vec![f32::NAN; length];
    }
    take(length).unwrap_or_else(|| fresh(length, fate))
}

/// A buffer of `length` elements, each `value`.
pub(crate) fn filled(length: usize, value: f32, fate: Fate) -> Vec<f32> {
    match take(length) {
        Some(mut buffer) => {
            buffer.fill(value);
            buffer
        }
        None => {
            let mut buffer = fresh(length, fate);
            // A fresh buffer's untouched pages are zeros already.
            if value != 0.0 {
                buffer.fill(value);
            }
            buffer
        }
    }
}

/// A new buffer of zeros, from the allocator; a large one asks for huge pages first if it will
/// be recycled, or where they pay for one touch ([`huge_pages_pay`]) if it will be freed.
fn fresh(length: usize, fate: Fate) -> Vec<f32> {
    // Zeroed memory of this size comes from `mmap` untouched (`calloc`), so the hint reaches
    // the pages before their first fault.
    let buffer = vec![0.0; length];
    let bytes = length * size_of::<f32>();
    if bytes >= HUGE_PAGE_BYTES
        && (fate == Fate::Recycled
            || huge_pages_pay(
                free_pages_reported(),
                HANDED_OVER.since_one_as_large(bytes, Instant::now()),
            ))
    {
        advise_huge_pages(&buffer);
    }
    buffer
}

/// Whether a fresh buffer that will be freed with its tensor should ask for huge pages, given
/// whether the machine is a virtual machine that reports its free memory to its host
/// ([`free_pages_reported`]) and how long ago the newest output at least as large that was freed
/// with its tensor left this crate's kernels (`None`: none among the last [`RECENT_OUTPUTS`]).
///
/// Why: on bare metal a huge page costs one fault instead of 512, always a win. Under free page
/// reporting, Linux hands blocks of 2 MiB and up that have stayed free for about
/// [`PAGE_REPORTING_DELAY`] to the host, which drops their memory; touching them again costs the
/// host's faults on top of the guest's. A huge page is such a block; small pages come first
/// from the free fragments below 2 MiB, which are never reported. Writing 2 GiB on the EPYC of
/// the README (Linux `6.18.44-fc`) took 2.4-6.0 s with huge pages against 1.1-1.6 s with small
/// ones when the memory had been free for a second or more, but 0.26-0.32 s with huge pages
/// when a buffer of that size had just been freed. So small pages there when an output as large
/// left the kernels the delay ago or earlier: its memory, if freed since, may well be reported
/// (a call between other work, like the table bench's alternation with Burn's module). Huge
/// pages when it left less than the delay ago (a loop of calls: its tensor has dropped since,
/// and its memory, too recently freed to be reported, is what the allocator hands out), and
/// when none did (the first call of a size: small pages would make the next call's huge ones
/// land on the fragments they leave, which cost 1-2 s more at 2 GiB than starting with huge
/// pages).
///
/// A recycled buffer ([`Fate::Recycled`]) asks for them regardless: its first touch is paid
/// once, its huge pages serve every later call (on flex, `fwd+weights` at (1, 2048, 512, 8)
/// took 88-94 ms a call with the pool's buffer on small pages against 77-82 ms on huge ones).
fn huge_pages_pay(free_pages_reported: bool, since_one_as_large: Option<Duration>) -> bool {
    !free_pages_reported || since_one_as_large.is_none_or(|since| since < PAGE_REPORTING_DELAY)
}

/// How long Linux lets freed memory lie before it reports it to the host (`PAGE_REPORTING_DELAY`
/// in `mm/page_reporting.c`).
const PAGE_REPORTING_DELAY: Duration = Duration::from_secs(2);

/// The sizes of the last [`RECENT_OUTPUTS`] outputs of [`HUGE_PAGE_BYTES`] or more that left the
/// kernels to be freed with their tensors ([`Fate::Freed`]), and when.
struct RecentOutputs {
    handed_over: Mutex<Vec<(usize, Instant)>>,
}

/// How many recent outputs are remembered (the newest).
const RECENT_OUTPUTS: usize = 64;

static HANDED_OVER: RecentOutputs = RecentOutputs {
    handed_over: Mutex::new(Vec::new()),
};

impl RecentOutputs {
    /// Notes that an output of `bytes` left the kernels at `at`.
    fn record(&self, bytes: usize, at: Instant) {
        let Ok(mut handed_over) = self.handed_over.lock() else {
            return;
        };
        if handed_over.len() == RECENT_OUTPUTS {
            handed_over.remove(0);
        }
        handed_over.push((bytes, at));
    }

    /// How long before `now` the newest remembered output of at least `bytes` left the kernels.
    fn since_one_as_large(&self, bytes: usize, now: Instant) -> Option<Duration> {
        let handed_over = self.handed_over.lock().ok()?;
        handed_over
            .iter()
            .filter(|&&(size, _)| size >= bytes)
            .map(|&(_, at)| now.saturating_duration_since(at))
            .min()
    }
}

/// Notes that `values`, a kernel's output, leaves this crate now for a tensor the caller owns,
/// whose drop gives it to `fate`.
pub(crate) fn handed_over(values: &[f32], fate: Fate) {
    let bytes = size_of_val(values);
    if fate == Fate::Freed && bytes >= HUGE_PAGE_BYTES {
        HANDED_OVER.record(bytes, Instant::now());
    }
}

/// Whether this machine is a virtual machine whose balloon device reports free memory to the
/// host (Linux: a virtio device of type 5, the balloon, with feature bit 5,
/// `VIRTIO_BALLOON_F_REPORTING`, negotiated). Read once.
fn free_pages_reported() -> bool {
    static REPORTED: OnceLock<bool> = OnceLock::new();
    *REPORTED.get_or_init(|| {
        let Ok(devices) = std::fs::read_dir("/sys/bus/virtio/devices") else {
            return false;
        };
        devices.flatten().any(|device| {
            let read = |name| std::fs::read_to_string(device.path().join(name));
            matches!(
                (read("device"), read("features")),
                (Ok(id), Ok(features)) if balloon_reports_free_pages(&id, &features)
            )
        })
    })
}

/// Whether a virtio device with sysfs `device` file `id` and `features` file `features` (one
/// `0`/`1` character per feature bit, bit 0 first) is a balloon that reports free pages.
fn balloon_reports_free_pages(id: &str, features: &str) -> bool {
    const BALLOON: &str = "0x0005";
    const REPORTING_BIT: usize = 5;
    id.trim() == BALLOON && features.trim().as_bytes().get(REPORTING_BIT) == Some(&b'1')
}

/// Transparent huge pages: the size of one, and the smallest buffer advised to use them.
const HUGE_PAGE_BYTES: usize = 2 << 20;

/// Asks Linux to back the 2 MiB-aligned part of `buffer` with transparent huge pages, so that
/// its first touch costs a fault per 2 MiB instead of per 4 KiB. Where the system does not
/// take the hint (huge pages off, another OS) nothing changes.
///
/// Why: a fresh buffer larger than the resident tier keeps (the attention weights at
/// (1, 2048, 512, 8) are 128 MiB) faults all its pages in on first touch; their faults, page
/// clears and memory-cgroup accounting were 20% of `fwd+weights` there under `perf record`.
/// Linux here gives huge pages only to memory that asks for them
/// (`transparent_hugepage/enabled` = `madvise`).
fn advise_huge_pages(buffer: &[f32]) {
    #[cfg(target_os = "linux")]
    if let Some(pages) = aligned_part(buffer, HUGE_PAGE_BYTES) {
        // SAFETY: `pages` is page-aligned and lies inside `buffer`'s allocation, which this
        // call borrows; MADV_HUGEPAGE changes how the kernel backs those pages, never their
        // contents. A failure (EINVAL where THP is not built in) is harmless.
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

/// The addresses of the whole `alignment`-aligned blocks inside `buffer`, if there are any.
fn aligned_part(buffer: &[f32], alignment: usize) -> Option<std::ops::Range<usize>> {
    let start = buffer.as_ptr() as usize;
    let end = start + std::mem::size_of_val(buffer);
    let first = start.next_multiple_of(alignment);
    let last = end / alignment * alignment;
    (last > first).then_some(first..last)
}

/// The size of a memory page.
#[cfg(target_os = "linux")]
fn page_bytes() -> usize {
    static PAGE_BYTES: OnceLock<usize> = OnceLock::new();
    // SAFETY: `sysconf` reads a system constant; it has no preconditions.
    *PAGE_BYTES.get_or_init(|| match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        bytes if bytes > 0 => bytes as usize,
        _ => 4096,
    })
}

/// The most bytes the lazily freed tier keeps: a quarter of the machine's memory (none where
/// that is unknown).
fn lazily_freed_bound() -> usize {
    static BOUND: OnceLock<usize> = OnceLock::new();
    *BOUND.get_or_init(|| {
        #[cfg(target_os = "linux")]
        {
            // SAFETY: `sysconf` reads a system constant; it has no preconditions.
            let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
            usize::try_from(pages).map_or(0, |pages| pages.saturating_mul(page_bytes()) / 4)
        }
        #[cfg(not(target_os = "linux"))]
        0
    })
}

/// Lets the kernel take back `buffer`'s whole pages whenever it needs memory, keeping them
/// mapped until it does (`MADV_FREE`); false, with nothing changed, where it cannot.
///
/// Until each such page is written again its elements may turn to zeros at any time: the
/// buffer must not be read before [`pin`] has run.
fn free_lazily(buffer: &mut [f32]) -> bool {
    #[cfg(target_os = "linux")]
    if let Some(pages) = aligned_part(buffer, page_bytes()) {
        // SAFETY: `pages` is page-aligned and lies inside `buffer`'s allocation, which this
        // call borrows mutably; MADV_FREE leaves each page mapped with either its contents or
        // zeros, both valid `f32`s, and the caller reads none of them before `pin` writes each
        // page, which ends the page's lazy state.
        return unsafe {
            libc::madvise(
                pages.start as *mut libc::c_void,
                pages.len(),
                libc::MADV_FREE,
            )
        } == 0;
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buffer;
    false
}

/// Writes one element of each whole page of a buffer that [`free_lazily`] gave up, so that every
/// page holds fixed values again (a page the kernel took faults a fresh one in; one it left is
/// the caller's again): the values are then the old ones or zeros, and stay so.
fn pin(buffer: &mut [f32]) {
    #[cfg(target_os = "linux")]
    if let Some(pages) = aligned_part(buffer, page_bytes()) {
        let start = buffer.as_ptr() as usize;
        for page in pages.step_by(page_bytes()) {
            let element = &mut buffer[(page - start) / size_of::<f32>()];
            // SAFETY: `element` is a valid, aligned `&mut f32` into `buffer`. The write is
            // volatile so that it is not merged away with the caller's later writes: the page
            // must be written before any of its elements is read.
            unsafe { std::ptr::write_volatile(element, 0.0) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buffer;
}

fn take(length: usize) -> Option<Vec<f32>> {
    let bytes = length * size_of::<f32>();
    if bytes < MIN_BYTES {
        return None;
    }
    let mut pool = POOL.lock().ok()?;
    if bytes <= RESIDENT_MAX_BYTES {
        return pool.resident.take(length);
    }
    let mut buffer = pool.lazily_freed.take(length)?;
    drop(pool);
    pin(&mut buffer);
    Some(buffer)
}

/// Keeps `buffer` for a later call, if it is of a size the pool keeps; the oldest buffers of
/// its tier go back to the allocator when the tier would hold more than its bound.
pub(crate) fn give_back(mut buffer: Vec<f32>) {
    let bytes = bytes_of(&buffer);
    if bytes < MIN_BYTES {
        return;
    }
    let resident = bytes <= RESIDENT_MAX_BYTES;
    // Outside the lock: `madvise` over gigabytes takes a while.
    if !resident && (bytes > lazily_freed_bound() || !free_lazily(&mut buffer)) {
        return;
    }
    let evicted = {
        let Ok(mut pool) = POOL.lock() else {
            return;
        };
        if resident {
            pool.resident.keep(buffer, POOL_BYTES)
        } else {
            pool.lazily_freed.keep(buffer, lazily_freed_bound())
        }
    };
    // Freed outside the lock: unmapping a large buffer takes a while.
    drop(evicted);
}

/// Bytes the pool holds idle: resident, and lazily freed (which the kernel may have taken back
/// in part; see [`lazily_freed_bytes`]).
pub fn idle_bytes() -> usize {
    POOL.lock()
        .map_or(0, |pool| pool.resident.bytes + pool.lazily_freed.bytes)
}

/// Bytes the pool holds in buffers larger than a quarter of [`POOL_BYTES`], kept lazily freed
/// (Linux's `MADV_FREE`): still mapped and reused without faults while the kernel does not need
/// the memory, taken back by the kernel, without any write-out, when it does. Processes count
/// them in their resident size until then.
pub fn lazily_freed_bytes() -> usize {
    POOL.lock().map_or(0, |pool| pool.lazily_freed.bytes)
}

/// Hands every idle buffer back to the allocator (as `torch.cuda.empty_cache()` does for
/// PyTorch's GPU pool).
pub fn release() {
    let idle = match POOL.lock() {
        Ok(mut pool) => [pool.resident.clear(), pool.lazily_freed.clear()],
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

    /// The field `name` (`VmFlags`, `LazyFree`) of the mapping of this process that holds
    /// `address`, as `/proc/self/smaps` writes it.
    #[cfg(target_os = "linux")]
    fn mapping_field(address: usize, name: &str) -> String {
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
            } else if inside
                && let Some(value) = line
                    .strip_prefix(name)
                    .and_then(|rest| rest.strip_prefix(':'))
            {
                return value.trim().to_string();
            }
        }
        panic!("no mapping holds {address:#x}, or it has no {name}");
    }

    /// The kilobytes of the mapping that holds `address` that the kernel may take back.
    #[cfg(target_os = "linux")]
    fn lazily_freed_kib(address: usize) -> usize {
        let value = mapping_field(address, "LazyFree");
        value
            .strip_suffix(" kB")
            .and_then(|kib| kib.parse().ok())
            .unwrap_or_else(|| panic!("LazyFree: {value}"))
    }

    /// Writes each element's index into `buffer` and reads every one back.
    fn assert_holds_what_is_written(buffer: &mut [f32]) {
        buffer
            .iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = i as f32);
        assert!(buffer.iter().enumerate().all(|(i, &x)| x == i as f32));
    }

    /// Whether the 2 MiB-aligned part of `buffer` carries the huge-page advice (the `hg` flag).
    #[cfg(target_os = "linux")]
    fn asks_for_huge_pages(buffer: &[f32]) -> bool {
        let first = (buffer.as_ptr() as usize).next_multiple_of(HUGE_PAGE_BYTES);
        let flags = mapping_field(first, "VmFlags");
        flags.split_whitespace().any(|flag| flag == "hg")
    }

    /// A fresh buffer of 2 MiB or more asks for huge pages if it will be recycled, and, if it
    /// will be freed, where they pay: always on a machine that does not report its free memory
    /// to a host, and, on one that does, unless the last output as large that was freed left
    /// the kernels two seconds ago or more. It is zeros and keeps its values; a fill value is
    /// written. Skipped where the kernel has no transparent huge pages at all.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_large_fresh_buffer_asks_for_huge_pages_where_they_pay() {
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
            return;
        }
        let _serial = serial();
        // Lengths no other test asks for, so that the pool has none, and larger than any other
        // test's outputs, so that only this test's notes count.
        let length = (48 << 20) / 4 + 7;
        let long_ago = Instant::now()
            .checked_sub(2 * PAGE_REPORTING_DELAY)
            .expect("an instant seconds ago");
        HANDED_OVER.record(length * size_of::<f32>(), long_ago);
        let cases = [
            (Fate::Recycled, None, true),
            (Fate::Freed, None, !free_pages_reported()),
            (Fate::Freed, Some(2.5), true),
        ];
        for (index, (fate, value, huge)) in cases.into_iter().enumerate() {
            let length = length - index;
            let mut buffer = match value {
                None => buffer(length, fate),
                Some(value) => filled(length, value, fate),
            };
            assert_eq!(asks_for_huge_pages(&buffer), huge, "{fate:?}, {value:?}");
            assert!(buffer.iter().all(|&x| x == value.unwrap_or(0.0)));
            assert_holds_what_is_written(&mut buffer);
            handed_over(&buffer, fate);
        }
    }

    #[test]
    fn huge_pages_pay_off_the_host_or_unless_an_output_as_large_left_long_ago() {
        let just = Some(Duration::from_millis(300));
        let long_ago = Some(PAGE_REPORTING_DELAY);
        for since in [None, just, long_ago] {
            assert!(huge_pages_pay(false, since), "{since:?}");
        }
        assert!(huge_pages_pay(true, just));
        assert!(huge_pages_pay(true, None), "the first of its size");
        assert!(!huge_pages_pay(true, long_ago));
    }

    #[test]
    fn recent_outputs_give_the_newest_as_large() {
        let outputs = RecentOutputs {
            handed_over: Mutex::new(Vec::new()),
        };
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        let since = |bytes, ms| outputs.since_one_as_large(bytes, at(ms));
        let millis = |ms| Some(Duration::from_millis(ms));
        assert_eq!(since(100, 0), None, "none yet");
        outputs.record(100, at(0));
        assert_eq!(since(50, 500), millis(500), "a smaller one");
        assert_eq!(since(100, 700), millis(700), "as large");
        assert_eq!(since(101, 700), None, "only smaller ones");
        outputs.record(60, at(900));
        assert_eq!(since(60, 1000), millis(100), "the newest");
        assert_eq!(since(100, 5000), millis(5000), "however long ago");
        for ms in 6000..6000 + RECENT_OUTPUTS as u64 - 1 {
            outputs.record(1, at(ms));
        }
        assert_eq!(since(100, 7000), None, "forgotten: the oldest");
        assert_eq!(since(60, 7000), millis(6100), "the newer kept");
        assert_eq!(
            outputs.handed_over.lock().expect("notes").len(),
            RECENT_OUTPUTS
        );
    }

    /// The CPU kernels' outputs that their tensors will free (ndarray's), in both layouts, are
    /// noted as handed over when they become tensors, which the next fresh buffer of their size
    /// reads; those that go back to the pool (flex's) are not.
    #[cfg(all(feature = "flex", feature = "ndarray"))]
    #[test]
    fn freed_outputs_are_noted_as_handed_over() {
        use super::super::cpu::CpuStorage;
        use burn::backend::{Flex, NdArray};
        let _serial = serial();
        // Smaller than the huge-page test's outputs, which this test's must not precede.
        let lengths = (0..4).map(|index| (40 << 20) / 4 + 1000 * index);
        type Build = fn(Vec<f32>, [usize; 4]);
        let builds: [(Build, bool); 4] = [
            (
                |values, shape| drop(NdArray::contiguous(values, shape)),
                true,
            ),
            (
                |values, shape| drop(NdArray::sequence_major(values, shape)),
                true,
            ),
            (|values, shape| drop(Flex::contiguous(values, shape)), false),
            (
                |values, shape| drop(Flex::sequence_major(values, shape)),
                false,
            ),
        ];
        // Longest first, so that each build's only note at least as large is its own.
        for (index, ((build, noted), length)) in builds.into_iter().zip(lengths.rev()).enumerate() {
            let values = vec![0.0; length];
            let started = Instant::now();
            build(values, [1, 1, 1, length]);
            let since = HANDED_OVER.since_one_as_large(length * size_of::<f32>(), Instant::now());
            assert_eq!(
                since.is_some_and(|since| since <= started.elapsed()),
                noted,
                "{index}: {since:?}"
            );
        }
    }

    #[test]
    fn a_balloon_with_free_page_reporting_is_recognised_from_sysfs() {
        let reporting = "0110010100000000000000000000000010000000";
        let not_reporting = "0110000100000000000000000000000010000000";
        assert!(balloon_reports_free_pages(
            "0x0005\n",
            &format!("{reporting}\n")
        ));
        assert!(!balloon_reports_free_pages("0x0005", not_reporting));
        assert!(
            !balloon_reports_free_pages("0x0001", reporting),
            "a network device"
        );
        assert!(
            !balloon_reports_free_pages("0x0005", "01100"),
            "too few bits"
        );
        assert!(!balloon_reports_free_pages("0x0005", ""));
    }

    #[test]
    fn a_dropped_buffer_comes_back_for_the_same_length_only() {
        let _serial = serial();
        let first = filled(LENGTH, 1.5, Fate::Recycled);
        assert!(first.iter().all(|&x| x == 1.5));
        let pointer = first.as_ptr();
        give_back(first);
        let other_length = buffer(LENGTH + 1, Fate::Recycled);
        assert_ne!(other_length.as_ptr(), pointer, "another length");
        let again = buffer(LENGTH, Fate::Recycled);
        assert_eq!(again.as_ptr(), pointer, "the same allocation");
        assert_eq!(again.len(), LENGTH);
        give_back(again);
        let refilled = filled(LENGTH, -0.0, Fate::Recycled);
        assert_eq!(refilled.as_ptr(), pointer);
        assert!(refilled.iter().all(|x| x.to_bits() == (-0.0f32).to_bits()));
    }

    #[test]
    fn small_buffers_are_not_kept() {
        let small = vec![0.0f32; MIN_BYTES / 4 - 1];
        let pointer = small.as_ptr();
        give_back(small);
        assert!(take(MIN_BYTES / 4 - 1).is_none_or(|b| b.as_ptr() != pointer));
    }

    /// A buffer too large for the resident tier comes back lazily freed (the kernel counts its
    /// pages `LazyFree`), and taken again it is the same allocation with every page the
    /// process's own once more, holding what the caller writes.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_large_buffer_is_kept_lazily_freed_and_pinned_when_taken() {
        let _serial = serial();
        let length = RESIDENT_MAX_BYTES / 4 + 54_321;
        let first = filled(length, 3.0, Fate::Recycled);
        let pointer = first.as_ptr();
        let page = aligned_part(&first, page_bytes())
            .expect("whole pages")
            .start;
        assert_eq!(lazily_freed_kib(page), 0, "fresh");
        give_back(first);
        assert!(lazily_freed_bytes() >= length * 4);
        assert!(lazily_freed_kib(page) > 0, "given back");
        let mut again = buffer(length, Fate::Recycled);
        assert_eq!(again.as_ptr(), pointer, "the same allocation");
        assert_eq!(lazily_freed_kib(page), 0, "pinned");
        assert!(again.iter().all(|&x| x == 3.0 || x == 0.0));
        assert_holds_what_is_written(&mut again);
    }

    #[test]
    fn a_tier_gives_back_its_oldest_buffers_beyond_its_bound() {
        let mut tier = Tier::new();
        let [a, b, c] = [1.0f32, 2.0, 3.0].map(|value| vec![value; 1000]);
        let a_pointer = a.as_ptr();
        assert!(tier.keep(a, 8000).is_empty());
        assert!(tier.keep(b, 8000).is_empty());
        let evicted = tier.keep(c, 8000);
        assert_eq!(evicted.len(), 1);
        assert_eq!(evicted[0].as_ptr(), a_pointer, "the oldest");
        assert_eq!(tier.bytes, 8000);
        assert_eq!(tier.take(1000).map(|b| b[0]), Some(3.0), "the newest first");
        assert_eq!(tier.take(1000).map(|b| b[0]), Some(2.0));
        assert!(tier.take(1000).is_none());
        assert_eq!(tier.bytes, 0);
    }

    #[test]
    fn the_resident_tier_never_holds_more_than_its_bound() {
        let _serial = serial();
        let length = RESIDENT_MAX_BYTES / 4 - 7;
        for _ in 0..6 {
            give_back(vec![2.0f32; length]);
            let resident = POOL.lock().expect("pool").resident.bytes;
            assert!(resident <= POOL_BYTES, "{resident} idle");
        }
    }

    #[test]
    fn poisoned_buffers_are_nan() {
        let values = poison::with(|| buffer(LENGTH + 99, Fate::Recycled));
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
