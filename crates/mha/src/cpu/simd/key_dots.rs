//! The scores of a few query rows against keys stored position by position (a decoding step's
//! queries against a `KvCache`'s keys, read where they lie), sixteen keys at a time on
//! AVX-512 and eight on AVX2.
//!
//! Why not `gemm`: for one query row it computes each score as a dot product with its own
//! horizontal sum, about twenty instructions a key for four FMAs at head width 64; a decoding
//! step of an f32 `KvCache` at 1024 positions (d_model 512, 8 query / 2 key-value heads) spent
//! half its time there. Here each key's sum stays in its own register and sixteen of them are
//! added across lanes together, in about three instructions a key (the tree of [`lane_sums`]).
//!
//! A block's keys are read side by side, sixteen rows (eight on AVX2) a line at a time each,
//! which the hardware prefetcher did not follow from memory (AMD Zen 4: a step of 8 key/value
//! heads at 16384 positions took 1.2-1.6x `gemm`'s time, which reads one key after another), so
//! each block asks for the keys [`PREFETCH_BYTES`] after it, a cache line at a time
//! ([`ask_ahead`]).
//!
//! Each score is computed the same way whatever the other rows and keys of the call (its
//! features in order, FMA by FMA, then the same tree of lane sums): a backward that recomputes
//! a head's scores alone gets the forward's, computed with the other heads of its group, to
//! the bit.

#[cfg(target_arch = "x86_64")]
use std::ops::Range;

#[cfg(any(target_arch = "x86_64", test))]
use super::CACHE_LINE;

/// Whether [`key_dots`] takes keys `dim` features wide on this CPU: AVX-512 for a whole number
/// of 16-lane vectors, AVX2 + FMA of 8-lane ones; elsewhere the caller's matrix product.
pub(crate) fn takes(dim: usize) -> bool {
    use crate::cpu::CpuCapability;
    dim > 0
        && match crate::cpu::cpu_capability() {
            CpuCapability::Avx512 => dim.is_multiple_of(16),
            CpuCapability::Avx2 => dim.is_multiple_of(8),
            CpuCapability::Default => false,
        }
}

/// `outputs[r][j] ← scale · queries[r] · keys[j · key_stride..][..dim]` for every query row
/// `r` and key `j < count`, with `dim` the query rows' length.
///
/// # Panics
///
/// If [`takes`] does not take `dim` (the rows' length), the rows differ in length, `outputs`
/// is not a row of `count` scores per query row, or `keys` holds fewer than `count` keys of
/// `dim` features `key_stride` apart.
pub(crate) fn key_dots(
    outputs: &mut [&mut [f32]],
    queries: &[&[f32]],
    keys: &[f32],
    key_stride: usize,
    count: usize,
    scale: f32,
) {
    let dim = queries.first().map_or(0, |row| row.len());
    assert!(
        takes(dim) && queries.iter().all(|row| row.len() == dim),
        "key_dots: query rows of {dim} features, which this CPU's copy does not take"
    );
    assert!(
        outputs.len() == queries.len() && outputs.iter().all(|row| row.len() == count),
        "key_dots: {} output rows for {} query rows of {count} keys",
        outputs.len(),
        queries.len()
    );
    assert!(
        // Any stride, even one that overlaps the keys (a tensor's axis of length 1 has stride 1,
        // a broadcast one 0): every key's `dim` features are read from its start.
        count == 0 || (count - 1) * key_stride + dim <= keys.len(),
        "key_dots: {count} keys of {dim} features (stride {key_stride}) in {} values",
        keys.len()
    );
    if count == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        use crate::cpu::CpuCapability;
        match crate::cpu::cpu_capability() {
            // SAFETY: the CPU has AVX-512F (`cpu_capability`); `dim` is a whole number of
            // 16-lane vectors (`takes`); the checks above keep every key row read and every
            // output written inside its slice.
            CpuCapability::Avx512 => unsafe {
                avx512::key_dots(outputs, queries, keys, key_stride, count, scale)
            },
            // SAFETY: as above, with AVX2 and FMA, and 8-lane vectors.
            CpuCapability::Avx2 => unsafe {
                avx2::key_dots(outputs, queries, keys, key_stride, count, scale)
            },
            CpuCapability::Default => unreachable!("`takes` declines the baseline copy"),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = scale;
        unreachable!("`takes` declines every CPU but x86's");
    }
}

/// How far ahead of the block it computes [`blocks`] asks for keys: the paged kernel's distance
/// (`PREFETCH_BYTES` in `paged/cpu/sequence.rs`), under a microsecond of reading at these
/// machines' bandwidth and more than memory's latency, so that the lines arrive before the
/// block that needs them.
#[cfg(target_arch = "x86_64")]
const PREFETCH_BYTES: usize = 16 << 10;

/// Asks the CPU for keys `ahead` (of `row_bytes` each, `key_stride` floats apart) a cache line
/// at a time: a prefetch reads nothing and never faults, and every key asked for lies in
/// `keys` (the caller's range).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn ask_ahead(keys: &[f32], key_stride: usize, row_bytes: usize, ahead: Range<usize>) {
    for key in ahead {
        let row: *const u8 = keys.as_ptr().wrapping_add(key * key_stride).cast();
        for offset in line_offsets(row as usize, row_bytes) {
            super::prefetch_line(row.wrapping_add(offset));
        }
    }
}

/// The offsets into a row of `row_bytes` at address `address` of one byte in each cache line
/// it touches, each line once: its first byte, then each later line's first byte (a row that
/// does not start a line touches one line more than its length in lines).
#[cfg(any(target_arch = "x86_64", test))]
fn line_offsets(address: usize, row_bytes: usize) -> impl Iterator<Item = usize> {
    let into_line = address % CACHE_LINE;
    let first = (row_bytes > 0).then_some(0);
    first
        .into_iter()
        .chain((CACHE_LINE - into_line..row_bytes).step_by(CACHE_LINE))
}

/// A vector of f32 lanes as wide as a block of `KEYS` keys: lane `j` of a block's scores is
/// key `j`'s.
#[cfg(target_arch = "x86_64")]
trait Lanes<const KEYS: usize>: Copy {
    /// # Safety
    ///
    /// The CPU has the vector's instructions (for every method).
    unsafe fn zero() -> Self;
    unsafe fn splat(value: f32) -> Self;
    /// # Safety
    ///
    /// As [`Lanes::zero`], and `KEYS` floats from `from` lie in one slice.
    unsafe fn load(from: *const f32) -> Self;
    unsafe fn mul_add(a: Self, b: Self, c: Self) -> Self;
    unsafe fn mul(a: Self, b: Self) -> Self;
    /// The sum of each vector's lanes, vector `v`'s in lane `v`, every vector's lanes added
    /// in one order.
    unsafe fn lane_sums(vectors: &[Self; KEYS]) -> Self;
    /// Writes the first `to.len()` lanes (at most `KEYS`).
    unsafe fn store(self, to: &mut [f32]);
}

/// [`key_dots`] in vectors `V` of `KEYS` lanes, block of `KEYS` keys by block, every query row
/// against a block while its keys are in the L1 cache (a key/value head's keys read from
/// memory once for all the query heads of its group).
///
/// # Safety
///
/// The CPU has `V`'s instructions; every row of `queries` is `dim` long, a multiple of
/// `KEYS`; `outputs` holds a row of `count` scores per query row; `keys` holds `count` keys of
/// `dim` features `key_stride` apart; `count > 0`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn blocks<V: Lanes<KEYS>, const KEYS: usize>(
    outputs: &mut [&mut [f32]],
    queries: &[&[f32]],
    keys: &[f32],
    key_stride: usize,
    count: usize,
    scale: f32,
) {
    let dim = queries[0].len();
    // SAFETY: the caller's (for this and every vector operation below).
    let scale = unsafe { V::splat(scale) };
    let row_bytes = std::mem::size_of_val(queries[0]);
    // Whole blocks ahead, at least one.
    let ahead = KEYS * (PREFETCH_BYTES / (KEYS * row_bytes)).max(1);
    for start in (0..count).step_by(KEYS) {
        let width = KEYS.min(count - start);
        ask_ahead(
            keys,
            key_stride,
            row_bytes,
            (start + ahead).min(count)..(start + ahead + KEYS).min(count),
        );
        // A block past the last key repeats it (its lanes are not stored), so that every score
        // takes the one path, whatever its place in a block.
        let rows: [*const f32; KEYS] = std::array::from_fn(|lane| {
            let key = (start + lane).min(count - 1);
            // SAFETY: key `key < count` starts inside `keys` (the caller's).
            unsafe { keys.as_ptr().add(key * key_stride) }
        });
        for (output, query) in outputs.iter_mut().zip(queries) {
            // SAFETY: features `feature..feature + KEYS` lie inside the query row and each key
            // row (`dim` a multiple of `KEYS`, each key `dim` long); the scores
            // `start..start + width` inside the output row of `count`.
            unsafe {
                let mut sums = [V::zero(); KEYS];
                for feature in (0..dim).step_by(KEYS) {
                    let query = V::load(query.as_ptr().add(feature));
                    for (sum, key) in sums.iter_mut().zip(&rows) {
                        *sum = V::mul_add(query, V::load(key.add(feature)), *sum);
                    }
                }
                V::mul(V::lane_sums(&sums), scale).store(&mut output[start..start + width]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::Lanes;

    /// [`super::key_dots`] on AVX-512: blocks of 16 keys.
    ///
    /// # Safety
    ///
    /// As [`super::blocks`], with AVX-512F and 16 lanes.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn key_dots(
        outputs: &mut [&mut [f32]],
        queries: &[&[f32]],
        keys: &[f32],
        key_stride: usize,
        count: usize,
        scale: f32,
    ) {
        // SAFETY: the caller's.
        unsafe { super::blocks::<__m512, 16>(outputs, queries, keys, key_stride, count, scale) }
    }

    impl Lanes<16> for __m512 {
        #[inline(always)]
        unsafe fn zero() -> Self {
            // SAFETY: the CPU has AVX-512F (the contract).
            unsafe { _mm512_setzero_ps() }
        }

        #[inline(always)]
        unsafe fn splat(value: f32) -> Self {
            // SAFETY: the CPU has AVX-512F (the contract).
            unsafe { _mm512_set1_ps(value) }
        }

        #[inline(always)]
        unsafe fn load(from: *const f32) -> Self {
            // SAFETY: the CPU has AVX-512F, and `from` starts the lanes read (the contract).
            unsafe { _mm512_loadu_ps(from) }
        }

        #[inline(always)]
        unsafe fn mul_add(a: Self, b: Self, c: Self) -> Self {
            // SAFETY: the CPU has AVX-512F (the contract).
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }

        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            // SAFETY: the CPU has AVX-512F (the contract).
            unsafe { _mm512_mul_ps(a, b) }
        }

        /// Pairs of vectors interleaved and added, then pairs of pairs, then the 128-bit lanes
        /// across: 30 shuffles and 15 adds for 16 vectors, where a horizontal sum takes 8
        /// instructions per vector; each
        /// vector's lanes added as `(l₀ + l₂) + (l₁ + l₃)` in each 128-bit lane, then
        /// `(L₀ + L₁) + (L₂ + L₃)`.
        #[inline(always)]
        unsafe fn lane_sums(vectors: &[Self; 16]) -> Self {
            // SAFETY: the CPU has AVX-512F (the contract).
            unsafe {
                let pairs: [__m512; 8] = std::array::from_fn(|i| {
                    let (a, b) = (vectors[2 * i], vectors[2 * i + 1]);
                    _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b))
                });
                let quads: [__m512; 4] = std::array::from_fn(|i| {
                    let (a, b) = (
                        _mm512_castps_pd(pairs[2 * i]),
                        _mm512_castps_pd(pairs[2 * i + 1]),
                    );
                    _mm512_add_ps(
                        _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                        _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
                    )
                });
                let across = |a: __m512, b: __m512| {
                    _mm512_add_ps(
                        _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
                        _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
                    )
                };
                across(across(quads[0], quads[1]), across(quads[2], quads[3]))
            }
        }

        #[inline(always)]
        unsafe fn store(self, to: &mut [f32]) {
            let lanes: __mmask16 = if to.len() >= 16 {
                u16::MAX
            } else {
                (1u16 << to.len()) - 1
            };
            // SAFETY: the CPU has AVX-512F (the contract); the mask writes the lanes below
            // `to.len()` only, inside `to`.
            unsafe { _mm512_mask_storeu_ps(to.as_mut_ptr(), lanes, self) }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::Lanes;

    /// [`super::key_dots`] on AVX2 + FMA: blocks of 8 keys.
    ///
    /// # Safety
    ///
    /// As [`super::blocks`], with AVX2 and FMA and 8 lanes.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn key_dots(
        outputs: &mut [&mut [f32]],
        queries: &[&[f32]],
        keys: &[f32],
        key_stride: usize,
        count: usize,
        scale: f32,
    ) {
        // SAFETY: the caller's.
        unsafe { super::blocks::<__m256, 8>(outputs, queries, keys, key_stride, count, scale) }
    }

    impl Lanes<8> for __m256 {
        #[inline(always)]
        unsafe fn zero() -> Self {
            // SAFETY: the CPU has AVX2 and FMA (the contract).
            unsafe { _mm256_setzero_ps() }
        }

        #[inline(always)]
        unsafe fn splat(value: f32) -> Self {
            // SAFETY: the CPU has AVX2 and FMA (the contract).
            unsafe { _mm256_set1_ps(value) }
        }

        #[inline(always)]
        unsafe fn load(from: *const f32) -> Self {
            // SAFETY: the CPU has AVX2 and FMA, and `from` starts the lanes read (the contract).
            unsafe { _mm256_loadu_ps(from) }
        }

        #[inline(always)]
        unsafe fn mul_add(a: Self, b: Self, c: Self) -> Self {
            // SAFETY: the CPU has AVX2 and FMA (the contract).
            unsafe { _mm256_fmadd_ps(a, b, c) }
        }

        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            // SAFETY: the CPU has AVX2 and FMA (the contract).
            unsafe { _mm256_mul_ps(a, b) }
        }

        /// Two rounds of horizontal adds, then the 128-bit halves added.
        #[inline(always)]
        unsafe fn lane_sums(vectors: &[Self; 8]) -> Self {
            // SAFETY: the CPU has AVX2 and FMA (the contract).
            unsafe {
                let pairs: [__m256; 4] =
                    std::array::from_fn(|i| _mm256_hadd_ps(vectors[2 * i], vectors[2 * i + 1]));
                let quads: [__m256; 2] =
                    std::array::from_fn(|i| _mm256_hadd_ps(pairs[2 * i], pairs[2 * i + 1]));
                _mm256_add_ps(
                    _mm256_permute2f128_ps::<0x20>(quads[0], quads[1]),
                    _mm256_permute2f128_ps::<0x31>(quads[0], quads[1]),
                )
            }
        }

        #[inline(always)]
        unsafe fn store(self, to: &mut [f32]) {
            let mut lanes = [0.0f32; 8];
            // SAFETY: `lanes` is 8 floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), self) };
            let count = to.len().min(8);
            to[..count].copy_from_slice(&lanes[..count]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::{CpuCapability, cpu_capability};

    /// Every line a row touches is asked for once, by an offset inside the row: rows that start
    /// a line and rows that start inside one (the buffers are aligned to an f32 only), longer
    /// and shorter than a line.
    #[test]
    fn a_row_asks_for_every_line_it_touches_once() {
        for address in [0, 4, 60, 64, 160] {
            for row_bytes in [0, 4, 64, 256, 260, 512] {
                let offsets: Vec<usize> = line_offsets(address, row_bytes).collect();
                let lines: Vec<usize> = offsets
                    .iter()
                    .map(|offset| (address + offset) / CACHE_LINE)
                    .collect();
                let touched: Vec<usize> = if row_bytes == 0 {
                    Vec::new()
                } else {
                    (address / CACHE_LINE..=(address + row_bytes - 1) / CACHE_LINE).collect()
                };
                assert_eq!(lines, touched, "a row of {row_bytes} bytes at {address}");
                assert!(offsets.iter().all(|&offset| offset < row_bytes));
            }
        }
    }

    /// A deterministic spread of values, some large, some tiny, of both signs.
    fn values(count: usize, seed: u32) -> Vec<f32> {
        (0..count as u32)
            .map(|i| {
                let x = (i
                    .wrapping_mul(2654435761)
                    .wrapping_add(seed.wrapping_mul(97))) as f32;
                (x / u32::MAX as f32 - 0.5) * if i % 7 == 0 { 8.0 } else { 1.0 }
            })
            .collect()
    }

    /// Scores in f64, the reference.
    fn reference(
        queries: &[&[f32]],
        keys: &[f32],
        stride: usize,
        count: usize,
        scale: f32,
    ) -> Vec<f64> {
        queries
            .iter()
            .flat_map(|query| {
                (0..count).map(move |key| {
                    let row = &keys[key * stride..][..query.len()];
                    scale as f64
                        * query
                            .iter()
                            .zip(row)
                            .map(|(&q, &k)| q as f64 * k as f64)
                            .sum::<f64>()
                })
            })
            .collect()
    }

    #[test]
    fn every_row_against_every_key_as_the_f64_sums_give() {
        if cpu_capability() == CpuCapability::Default {
            return;
        }
        // Keys of 64 features in rows of 80 (a buffer with room), counts that end a block and
        // that stop inside one; one to four query rows.
        for (dim, stride) in [(64, 80), (16, 16), (128, 128)] {
            for count in [1, 7, 16, 17, 40, 64] {
                for rows in 1..=4 {
                    let keys = values((count - 1) * stride + dim, 3);
                    let query_values = values(rows * dim, 5);
                    let queries: Vec<&[f32]> = query_values.chunks_exact(dim).collect();
                    let mut outputs = vec![f32::NAN; rows * count];
                    let mut output_rows: Vec<&mut [f32]> = outputs.chunks_mut(count).collect();
                    key_dots(&mut output_rows, &queries, &keys, stride, count, 0.125);
                    let expected = reference(&queries, &keys, stride, count, 0.125);
                    for (index, (&got, &want)) in outputs.iter().zip(&expected).enumerate() {
                        assert!(
                            (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "dim {dim}, {count} keys, {rows} rows: score {index} is {got}, \
                             not {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_score_does_not_depend_on_the_other_rows_and_keys_of_the_call() {
        if cpu_capability() == CpuCapability::Default {
            return;
        }
        let (dim, count) = (64, 37);
        let keys = values(count * dim, 11);
        let query_values = values(4 * dim, 13);
        let queries: Vec<&[f32]> = query_values.chunks_exact(dim).collect();
        let mut together = vec![0.0; 4 * count];
        let mut together_rows: Vec<&mut [f32]> = together.chunks_mut(count).collect();
        key_dots(&mut together_rows, &queries, &keys, dim, count, 0.3);
        for (row, query) in queries.iter().enumerate() {
            // The row alone, over the keys from `first` on: other blocks, other lanes.
            for first in [0, 5, 16, 30] {
                let mut alone = vec![0.0; count - first];
                let keys = &keys[first * dim..];
                key_dots(&mut [&mut alone], &[query], keys, dim, count - first, 0.3);
                for (key, &score) in alone.iter().enumerate() {
                    assert_eq!(
                        score.to_bits(),
                        together[row * count + first + key].to_bits(),
                        "row {row}, key {}",
                        first + key
                    );
                }
            }
        }
    }

    #[test]
    fn one_key_at_a_stride_of_one_or_none_is_read_whole() {
        // A tensor's axis of length 1 gets stride 1 (flex), a broadcast one 0: the key's
        // features still lie from its start.
        if cpu_capability() == CpuCapability::Default {
            return;
        }
        let key = values(64, 17);
        let query_values = values(2 * 64, 19);
        let queries: Vec<&[f32]> = query_values.chunks_exact(64).collect();
        let expected = reference(&queries, &key, 64, 1, 0.5);
        for stride in [1, 0] {
            let mut outputs = [0.0f32; 2];
            let mut output_rows: Vec<&mut [f32]> = outputs.chunks_mut(1).collect();
            key_dots(&mut output_rows, &queries, &key, stride, 1, 0.5);
            for (&got, &want) in outputs.iter().zip(&expected) {
                assert!(
                    (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "stride {stride}"
                );
            }
        }
        // Three keys at stride 0: the one key three times.
        let mut outputs = [0.0f32; 3];
        key_dots(&mut [&mut outputs], &queries[..1], &key, 0, 3, 0.5);
        assert!(outputs.iter().all(|&score| score == outputs[0]));
    }

    #[test]
    fn too_few_keys_are_refused() {
        if cpu_capability() == CpuCapability::Default {
            return;
        }
        let query = [0.0f32; 16];
        let refused = std::panic::catch_unwind(|| {
            key_dots(&mut [&mut [0.0; 3]], &[&query], &[0.0; 40], 16, 3, 1.0);
        })
        .expect_err("three keys of 16 need 48 values");
        let message = refused
            .downcast_ref::<String>()
            .expect("a formatted message");
        assert_eq!(
            message,
            "key_dots: 3 keys of 16 features (stride 16) in 40 values"
        );
    }
}
