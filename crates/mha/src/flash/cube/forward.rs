//! The forward kernel (FlashAttention-2's forward, Dao 2023, Algorithm 1): a cube per
//! `(query block, batch · head)`, each unit owning [`Tiling::rows`] queries of the block; key
//! and value tiles staged in shared memory by the whole cube; per tile, the unit's score tile
//! `q kᵀ`, one rescale of its running sums by the tile's new maxima, and `P v` (see `tile.rs`).
//! Tiles past the block's causal horizon are never loaded.
//!
//! Writes the output and each query's softmax statistics `(m, 1 / Σ)`, f32, the pair the
//! generic body keeps (see `FlashForward::softmax_stats`).

// `#[cube]` expands a subset of Rust into kernel IR: the integer `div_ceil` is kept in the form
// it expands.
#![allow(clippy::manual_div_ceil)]

use burn_cubecl::cubecl;
use cubecl::prelude::*;

use super::score::{Flags, Problem, TilePlace, key_end, score_tile, tile_unmasked};
use super::tile::{
    HIDDEN, Tiling, accumulate_products, load_unit_rows, row_products, softmax_weight, stage_rows,
    store_unit_rows, unit_row, zeros,
};

/// `CUBE_POS_X` the query block, `CUBE_POS_Y` the `batch · head`; `tiling.units` units.
// Over 80 lines: one kernel is one GPU program, its setup, tile loop and write-back together
// (the products are `tile.rs`'s, the per-score work `score.rs`'s).
#[cube(launch, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub(super) fn forward_kernel<E: Float, N: Size>(
    query: &Tensor<Vector<E, N>>,
    key: &Tensor<Vector<E, N>>,
    value: &Tensor<Vector<E, N>>,
    bias: &Tensor<E>,
    forbid: &Tensor<E>,
    slopes: &Tensor<f32>,
    output: &mut Tensor<Vector<E, N>>,
    stats: &mut Tensor<f32>,
    problem: Problem,
    #[comptime] flags: Flags,
    #[comptime] tiling: Tiling,
    #[define(E)] _dtype: ElemType,
) {
    let head_dim = flags.head_dim;
    let value_dim = flags.value_dim;
    let rows = tiling.rows;
    let block = tiling.block;
    let vector_size = N::value();
    let seq_q = problem.seq_q;
    let seq_k = problem.seq_k;
    let head_index = CUBE_POS_Y;
    let batch = head_index / problem.n_heads;
    let head = head_index % problem.n_heads;
    let kv_head = head / (problem.n_heads / problem.n_kv_heads);
    let first_query = CUBE_POS_X * comptime!(tiling.units * tiling.rows) as u32;
    let mut last_query = first_query + comptime!(tiling.units * tiling.rows - 1) as u32;
    if last_query >= seq_q {
        last_query = seq_q - 1;
    }
    let q_base = head_index as usize * seq_q as usize;
    let kv_base = (batch * problem.n_kv_heads + kv_head) as usize * seq_k as usize;

    let mut q = Array::<f32>::new(comptime!(rows * head_dim));
    load_unit_rows(query, &mut q, q_base, first_query, seq_q, head_dim, tiling);
    let mut accumulated = zeros(comptime!(rows * value_dim));
    let mut maxima = Array::<f32>::new(rows);
    let mut sums = zeros(rows);
    #[unroll]
    for slot in 0..rows {
        maxima[slot] = HIDDEN;
    }
    let mut scores = Array::<f32>::new(comptime!(rows * block));
    let mut unused_slopes = Array::<f32>::new(1usize);

    let key_stop = key_end(&problem, last_query, flags);
    let mut key_tile =
        Shared::<[Vector<f32, N>]>::new_slice(comptime!(block * head_dim / vector_size));
    let mut value_tile =
        Shared::<[Vector<f32, N>]>::new_slice(comptime!(block * value_dim / vector_size));
    let tiles = (key_stop + block as u32 - 1) / block as u32;
    for tile in 0..tiles {
        let tile_start = tile * block as u32;
        sync_cube();
        stage_rows(
            key,
            &mut key_tile,
            kv_base,
            tile_start,
            seq_k,
            head_dim,
            tiling,
        );
        stage_rows(
            value,
            &mut value_tile,
            kv_base,
            tile_start,
            seq_k,
            value_dim,
            tiling,
        );
        sync_cube();

        row_products(&q, &key_tile, &mut scores, tiling, head_dim);
        let last_key = tile_start + block as u32 - 1;
        let mut unmasked = tile_unmasked(
            &problem,
            first_query,
            last_query,
            tile_start,
            last_key,
            flags,
        );
        if last_key >= key_stop {
            unmasked = false;
        }
        let place = TilePlace {
            batch,
            head,
            first_row: first_query,
            first_column: tile_start,
            key_stop,
        };
        score_tile::<E>(
            &problem,
            bias,
            forbid,
            slopes,
            &mut scores,
            &mut unused_slopes,
            place,
            unmasked,
            flags,
            tiling,
            true,
            false,
        );
        rescale_and_exponentiate(
            &mut scores,
            &mut maxima,
            &mut sums,
            &mut accumulated,
            tiling,
            value_dim,
        );
        accumulate_products(&mut accumulated, &scores, &value_tile, tiling, value_dim);
    }

    // At least 1 wherever a key was seen (the maximum contributes exp(0)); 0 where none was,
    // whose output is then 0.
    let mut inverses = Array::<f32>::new(rows);
    #[unroll]
    for slot in 0..rows {
        inverses[slot] = 1.0f32 / max(sums[slot], 1.0f32);
    }
    store_unit_rows(
        output,
        &accumulated,
        &inverses,
        q_base,
        first_query,
        seq_q,
        value_dim,
        tiling,
    );
    #[unroll]
    for slot in 0..rows {
        let row = unit_row(first_query, slot, tiling);
        if row < seq_q {
            let index = q_base + row as usize;
            stats[index * 2] = maxima[slot];
            stats[index * 2 + 1] = inverses[slot];
        }
    }
}

/// The online softmax's step for one tile: each row's new maximum, its running sum and
/// accumulated values rescaled once to it, and the tile's logits turned into `exp(s - m)` in
/// place (0 where hidden), added to the sums.
#[cube]
fn rescale_and_exponentiate(
    scores: &mut Array<f32>,
    maxima: &mut Array<f32>,
    sums: &mut Array<f32>,
    accumulated: &mut Array<f32>,
    #[comptime] tiling: Tiling,
    #[comptime] value_dim: usize,
) {
    let block = tiling.block;
    #[unroll]
    for slot in 0..tiling.rows {
        let mut tile_max = maxima[slot];
        #[unroll]
        for c in 0..block {
            tile_max = max(tile_max, scores[slot * block + c]);
        }
        let correction = (maxima[slot] - tile_max).exp();
        maxima[slot] = tile_max;
        #[unroll]
        for d in 0..value_dim {
            accumulated[slot * value_dim + d] *= correction;
        }
        let mut sum = sums[slot] * correction;
        #[unroll]
        for c in 0..block {
            let score = scores[slot * block + c];
            let probability = softmax_weight(score, tile_max, 1.0f32);
            scores[slot * block + c] = probability;
            sum += probability;
        }
        sums[slot] = sum;
    }
}
