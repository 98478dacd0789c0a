//! The register tiles every kernel is built from. A cube owns a block of rows (queries in the
//! forward and `dQ` kernels, keys in the `dK`/`dV` kernel) and walks the other side in tiles
//! staged through shared memory; each unit owns [`Tiling::rows`] rows of the block and every
//! column of a staged tile, so a score tile is a `rows × block` array in the unit's registers.
//! Its two products are small GEMMs written out at compile time:
//!
//! - [`row_products`]: `scores = rows · stagedᵀ` (`q kᵀ`, `dO vᵀ`, and their transposes);
//! - [`accumulate_products`]: `accumulator += weights · staged` (`P V`, `dS K`, `Pᵀ dO`, `dSᵀ Q`);
//!
//! both in register sub-tiles of `rows × columns`, so that each value read from shared memory
//! (the same address for every unit: a broadcast) feeds `rows` FMAs. A unit owning whole rows
//! keeps each row's running maximum and sum to itself: the softmax statistics need no
//! exchange between units, and the online rescale happens once per tile.
//!
//! Global memory is read in vectors of the launch's width (`N` elements: 4 where the head
//! widths allow, f32 in registers and shared memory whatever the inputs' type).

// `#[cube]` expands a subset of Rust into kernel IR: the integer `div_ceil` is kept in the form
// it expands.
#![allow(clippy::manual_div_ceil)]

use burn_cubecl::cubecl;
use cubecl::prelude::*;

/// How a kernel splits its work, fixed at compile time.
#[derive_cube_comptime]
pub struct Tiling {
    /// Units per cube.
    pub units: usize,
    /// Rows each unit owns: the cube's block is `units · rows` rows, unit `u` owning rows
    /// `u, u + units, u + 2 · units, …` of it.
    pub rows: usize,
    /// Rows of a staged tile (keys in the forward and `dQ` kernels, queries in the `dK`/`dV`
    /// kernel): the columns of the unit's score tile.
    pub block: usize,
    /// Columns of a register sub-tile of [`row_products`]; divides `block`.
    pub columns: usize,
}

/// The lowest finite f32: the running maximum of a row that has seen no key, and the logit of a
/// hidden score (a `-inf` bias gives less and is hidden too).
pub const HIDDEN: f32 = -3.4028235e38;

/// `exp(score - max) · scale`, or 0 where the score is hidden (at most [`HIDDEN`]). Written as
/// "not hidden" rather than "visible" so that a NaN score (NaN in the input) gives NaN, which
/// the row's sums and output carry: a NaN row must never pass for a fully masked one.
#[cube]
pub fn softmax_weight(score: f32, max: f32, scale: f32) -> f32 {
    select(score <= HIDDEN, 0.0f32, (score - max).exp() * scale)
}

/// Elements per sub-tile column group of a row of `width`: 4 where it divides, else 2 or 1.
pub fn width_chunk(width: usize) -> usize {
    if width.is_multiple_of(4) {
        4
    } else if width.is_multiple_of(2) {
        2
    } else {
        1
    }
}

/// The row of slot `slot` of the calling unit, in a block starting at row `first`.
#[cube]
pub fn unit_row(first: u32, #[comptime] slot: usize, #[comptime] tiling: Tiling) -> u32 {
    first + (slot * tiling.units) as u32 + UNIT_POS_X
}

/// `out[r · block + c] = Σ_w rows[r · width + w] · staged[c · width + w]` for the unit's
/// `tiling.rows` rows and a staged tile's `tiling.block` rows (`staged` in vectors of `N`).
#[cube]
pub fn row_products<N: Size>(
    rows: &Array<f32>,
    staged: &Shared<[Vector<f32, N>]>,
    out: &mut Array<f32>,
    #[comptime] tiling: Tiling,
    #[comptime] width: usize,
) {
    let row_count = tiling.rows;
    let block = tiling.block;
    let columns = tiling.columns;
    let vector_size = N::value();
    let per_row = comptime!(width / vector_size);
    let chunks = comptime!(block / columns);
    // A runtime loop: unrolled over the whole tile, the code outgrows instruction caches
    // (llvmpipe measured 4-10x slower); the sub-tile inside is unrolled.
    for chunk in 0..chunks {
        let mut sums = Array::<f32>::new(comptime!(row_count * columns));
        #[unroll]
        for index in 0..row_count * columns {
            sums[index] = 0.0f32;
        }
        #[unroll]
        for part in 0..per_row {
            #[unroll]
            for j in 0..columns {
                let other = staged[(chunk * columns + j) * per_row + part];
                #[unroll]
                for e in 0..vector_size {
                    let value = other.extract(e);
                    #[unroll]
                    for r in 0..row_count {
                        sums[r * columns + j] += rows[r * width + part * vector_size + e] * value;
                    }
                }
            }
        }
        #[unroll]
        for r in 0..row_count {
            #[unroll]
            for j in 0..columns {
                out[r * block + chunk * columns + j] = sums[r * columns + j];
            }
        }
    }
}

/// `accumulator[r · width + w] += Σ_c weights[r · block + c] · staged[c · width + w]` for the
/// unit's rows over a staged tile's `tiling.block` rows (`staged` in vectors of `N`).
#[cube]
pub fn accumulate_products<N: Size>(
    accumulator: &mut Array<f32>,
    weights: &Array<f32>,
    staged: &Shared<[Vector<f32, N>]>,
    #[comptime] tiling: Tiling,
    #[comptime] width: usize,
) {
    let row_count = tiling.rows;
    let block = tiling.block;
    let vector_size = N::value();
    let per_row = comptime!(width / vector_size);
    let columns = tiling.columns;
    let chunks = comptime!(block / columns);
    // A runtime loop over groups of `columns` staged rows, as in `row_products` (and for
    // llvmpipe's loop limiter, which stops a shader after 65535 loop iterations in all).
    for chunk in 0..chunks {
        let mut chunk_weights = Array::<f32>::new(comptime!(row_count * columns));
        #[unroll]
        for r in 0..row_count {
            #[unroll]
            for j in 0..columns {
                chunk_weights[r * columns + j] = weights[r * block + chunk * columns + j];
            }
        }
        #[unroll]
        for j in 0..columns {
            #[unroll]
            for part in 0..per_row {
                let other = staged[(chunk * columns + j) * per_row + part];
                #[unroll]
                for e in 0..vector_size {
                    let value = other.extract(e);
                    #[unroll]
                    for r in 0..row_count {
                        accumulator[r * width + part * vector_size + e] +=
                            chunk_weights[r * columns + j] * value;
                    }
                }
            }
        }
    }
}

/// Copies rows `first..first + tiling.block` of one head of `source` (`[.., seq, width]` in
/// vectors, the head's rows from `base`) into `tile` as f32 vectors, zeros past `seq`; every
/// unit of the cube takes part.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn stage_rows<E: Float, N: Size>(
    source: &Tensor<Vector<E, N>>,
    tile: &mut Shared<[Vector<f32, N>]>,
    base: usize,
    first: u32,
    seq: u32,
    #[comptime] width: usize,
    #[comptime] tiling: Tiling,
) {
    let vector_size = source.vector_size();
    let per_row = comptime!(width / vector_size);
    let total = comptime!(tiling.block * per_row);
    let rounds = comptime!(total.div_ceil(tiling.units));
    #[unroll]
    for round in 0..rounds {
        let index = round * tiling.units + UNIT_POS_X as usize;
        if index < total {
            let row = index / per_row;
            let mut values = Vector::<f32, N>::new(0.0f32);
            if first + (row as u32) < seq {
                values = Vector::<f32, N>::cast_from(
                    source[(base + first as usize + row) * per_row + index % per_row],
                );
            }
            tile[index] = values;
        }
    }
}

/// The unit's `tiling.rows` rows of one head of `source` (rows from `base`, the block from
/// `first`) into `out` as f32, zeros past `seq`.
#[cube]
pub fn load_unit_rows<E: Float, N: Size>(
    source: &Tensor<Vector<E, N>>,
    out: &mut Array<f32>,
    base: usize,
    first: u32,
    seq: u32,
    #[comptime] width: usize,
    #[comptime] tiling: Tiling,
) {
    let vector_size = source.vector_size();
    let per_row = comptime!(width / vector_size);
    #[unroll]
    for slot in 0..tiling.rows {
        let row = unit_row(first, slot, tiling);
        #[unroll]
        for column in 0..per_row {
            let mut values = Vector::<f32, N>::new(0.0f32);
            if row < seq {
                values =
                    Vector::<f32, N>::cast_from(source[(base + row as usize) * per_row + column]);
            }
            #[unroll]
            for e in 0..vector_size {
                out[slot * width + column * vector_size + e] = values.extract(e);
            }
        }
    }
}

/// Writes the unit's rows of `values` times `factors[slot]` into one head of `dest` (rows from
/// `base`, the block from `first`), in its type; rows past `seq` are not written.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn store_unit_rows<E: Float, N: Size>(
    dest: &mut Tensor<Vector<E, N>>,
    values: &Array<f32>,
    factors: &Array<f32>,
    base: usize,
    first: u32,
    seq: u32,
    #[comptime] width: usize,
    #[comptime] tiling: Tiling,
) {
    let vector_size = dest.vector_size();
    let per_row = comptime!(width / vector_size);
    #[unroll]
    for slot in 0..tiling.rows {
        let row = unit_row(first, slot, tiling);
        if row < seq {
            #[unroll]
            for column in 0..per_row {
                let mut out = Vector::<f32, N>::new(0.0f32);
                #[unroll]
                for e in 0..vector_size {
                    out.insert(
                        e,
                        values[slot * width + column * vector_size + e] * factors[slot],
                    );
                }
                dest[(base + row as usize) * per_row + column] = Vector::<E, N>::cast_from(out);
            }
        }
    }
}

/// An array of `length` zeros.
#[cube]
pub fn zeros(#[comptime] length: usize) -> Array<f32> {
    let mut array = Array::<f32>::new(length);
    #[unroll]
    for index in 0..length {
        array[index] = 0.0f32;
    }
    array
}
