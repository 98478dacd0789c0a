//! The backward kernels (FlashAttention-2's backward, Dao 2023, Algorithm 2), each score tile
//! recomputed from the forward's statistics, in the register tiles of `tile.rs`:
//!
//! 1. `row_dot_kernel`: `D = rowsum(dO ∘ O)`, one unit per query.
//! 2. `query_grad_kernel`: a cube per query block, as the forward: per key tile `S = q kᵀ`,
//!    `dP = dO vᵀ`, then `dQ += dS k`.
//! 3. `key_value_grad_kernel`: a cube per key block, each unit owning [`Tiling::rows`] keys,
//!    looping over query tiles (queries, output gradients, statistics and `D` staged): `Sᵀ = k
//!    qᵀ`, `dPᵀ = v dOᵀ`, then `dV += Pᵀ dO` and `dK += dSᵀ q`; every query head of the key's
//!    group in turn, GQA's sum over the group without copying key heads, and no atomics (each
//!    unit owns its keys' gradients).
//!
//! with `P = exp(S - m) / Σ` and `dS = P ∘ (dP - D)` times the soft cap's slope.

// `#[cube]` expands a subset of Rust into kernel IR: the integer `div_ceil` is kept in the form
// it expands.
#![allow(clippy::manual_div_ceil)]

use burn_cubecl::cubecl;
use cubecl::prelude::*;

use super::score::{Flags, Problem, TilePlace, key_end, query_start, score_tile, tile_unmasked};
use super::tile::{
    Tiling, accumulate_products, load_unit_rows, row_products, softmax_weight, stage_rows,
    store_unit_rows, unit_row, zeros,
};

/// `D[row] = Σ_d dO[row, d] · O[row, d]` in f32.
#[cube(launch, address_type = "dynamic")]
pub(super) fn row_dot_kernel<E: Float>(
    output: &Tensor<E>,
    output_grad: &Tensor<E>,
    row_dots: &mut Tensor<f32>,
    #[comptime] value_dim: usize,
    #[define(E)] _dtype: ElemType,
) {
    let row = ABSOLUTE_POS;
    if row < row_dots.len() {
        let mut dot = 0.0f32;
        #[unroll]
        for d in 0..value_dim {
            let index = row * value_dim + d;
            dot += f32::cast_from(output[index]) * f32::cast_from(output_grad[index]);
        }
        row_dots[row] = dot;
    }
}

/// `CUBE_POS_X` the query block, `CUBE_POS_Y` the `batch · head`; `tiling.units` units.
// Over 80 lines: one kernel is one GPU program, its setup, tile loop and write-back together
// (the products are `tile.rs`'s, the per-score work `score.rs`'s).
#[cube(launch, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub(super) fn query_grad_kernel<E: Float, N: Size>(
    query: &Tensor<Vector<E, N>>,
    key: &Tensor<Vector<E, N>>,
    value: &Tensor<Vector<E, N>>,
    bias: &Tensor<E>,
    forbid: &Tensor<E>,
    slopes: &Tensor<f32>,
    stats: &Tensor<f32>,
    row_dots: &Tensor<f32>,
    output_grad: &Tensor<Vector<E, N>>,
    query_grad: &mut Tensor<Vector<E, N>>,
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
    let mut grad = Array::<f32>::new(comptime!(rows * value_dim));
    load_unit_rows(
        output_grad,
        &mut grad,
        q_base,
        first_query,
        seq_q,
        value_dim,
        tiling,
    );
    let mut maxima = zeros(rows);
    let mut inverses = zeros(rows);
    let mut dots = zeros(rows);
    #[unroll]
    for slot in 0..rows {
        let row = unit_row(first_query, slot, tiling);
        if row < seq_q {
            let index = q_base + row as usize;
            maxima[slot] = stats[index * 2];
            inverses[slot] = stats[index * 2 + 1];
            dots[slot] = row_dots[index];
        }
    }
    let mut accumulated = zeros(comptime!(rows * head_dim));
    let mut scores = Array::<f32>::new(comptime!(rows * block));
    let mut grad_products = Array::<f32>::new(comptime!(rows * block));
    let mut cap_slopes = Array::<f32>::new(comptime!(slopes_length(flags, rows * block)));

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
            &mut cap_slopes,
            place,
            unmasked,
            flags,
            tiling,
            true,
            flags.capped,
        );
        row_products(&grad, &value_tile, &mut grad_products, tiling, value_dim);
        #[unroll]
        for slot in 0..rows {
            #[unroll]
            for c in 0..block {
                let index = slot * block + c;
                let score = scores[index];
                let probability = softmax_weight(score, maxima[slot], inverses[slot]);
                let mut score_grad = probability * (grad_products[index] - dots[slot]);
                if flags.capped {
                    score_grad *= cap_slopes[index];
                }
                scores[index] = score_grad;
            }
        }
        accumulate_products(&mut accumulated, &scores, &key_tile, tiling, head_dim);
    }

    let mut factors = Array::<f32>::new(rows);
    #[unroll]
    for slot in 0..rows {
        factors[slot] = problem.scale;
    }
    store_unit_rows(
        query_grad,
        &accumulated,
        &factors,
        q_base,
        first_query,
        seq_q,
        head_dim,
        tiling,
    );
}

/// `CUBE_POS_X` the key block, `CUBE_POS_Y` the `batch · key/value head`; `tiling.units`
/// units, each owning `tiling.rows` keys; staged tiles of `tiling.block` queries.
// Over 80 lines: one kernel is one GPU program, its setup, tile loop and write-back together
// (the products are `tile.rs`'s, the per-score work `score.rs`'s).
#[cube(launch, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub(super) fn key_value_grad_kernel<E: Float, N: Size>(
    query: &Tensor<Vector<E, N>>,
    key: &Tensor<Vector<E, N>>,
    value: &Tensor<Vector<E, N>>,
    bias: &Tensor<E>,
    forbid: &Tensor<E>,
    slopes: &Tensor<f32>,
    stats: &Tensor<f32>,
    row_dots: &Tensor<f32>,
    output_grad: &Tensor<Vector<E, N>>,
    key_grad: &mut Tensor<Vector<E, N>>,
    value_grad: &mut Tensor<Vector<E, N>>,
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
    let kv_index = CUBE_POS_Y;
    let batch = kv_index / problem.n_kv_heads;
    let kv_head = kv_index % problem.n_kv_heads;
    let group = problem.n_heads / problem.n_kv_heads;
    let first_key = CUBE_POS_X * comptime!(tiling.units * tiling.rows) as u32;
    let mut last_key = first_key + comptime!(tiling.units * tiling.rows - 1) as u32;
    if last_key >= seq_k {
        last_key = seq_k - 1;
    }
    let kv_base = kv_index as usize * seq_k as usize;

    let mut k = Array::<f32>::new(comptime!(rows * head_dim));
    load_unit_rows(key, &mut k, kv_base, first_key, seq_k, head_dim, tiling);
    let mut v = Array::<f32>::new(comptime!(rows * value_dim));
    load_unit_rows(value, &mut v, kv_base, first_key, seq_k, value_dim, tiling);
    let mut key_acc = zeros(comptime!(rows * head_dim));
    let mut value_acc = zeros(comptime!(rows * value_dim));
    let mut scores = Array::<f32>::new(comptime!(rows * block));
    let mut grad_products = Array::<f32>::new(comptime!(rows * block));
    let mut cap_slopes = Array::<f32>::new(comptime!(slopes_length(flags, rows * block)));

    let first_tile = query_start(&problem, first_key, flags) / block as u32;
    let tiles = (seq_q + block as u32 - 1) / block as u32;
    let mut query_tile =
        Shared::<[Vector<f32, N>]>::new_slice(comptime!(block * head_dim / vector_size));
    let mut grad_tile =
        Shared::<[Vector<f32, N>]>::new_slice(comptime!(block * value_dim / vector_size));
    let mut stats_tile = Shared::<[Vector<f32, Const<4>>]>::new_slice(block);

    for member in 0..group {
        let head = kv_head * group + member;
        let q_base = (batch * problem.n_heads + head) as usize * seq_q as usize;
        for tile in first_tile..tiles {
            let tile_start = tile * block as u32;
            sync_cube();
            stage_rows(
                query,
                &mut query_tile,
                q_base,
                tile_start,
                seq_q,
                head_dim,
                tiling,
            );
            stage_rows(
                output_grad,
                &mut grad_tile,
                q_base,
                tile_start,
                seq_q,
                value_dim,
                tiling,
            );
            stage_row_stats(
                stats,
                row_dots,
                &mut stats_tile,
                q_base,
                tile_start,
                seq_q,
                tiling,
            );
            sync_cube();

            row_products(&k, &query_tile, &mut scores, tiling, head_dim);
            let mut last_query = tile_start + block as u32 - 1;
            let mut unmasked = true;
            if last_query >= seq_q {
                last_query = seq_q - 1;
                unmasked = false;
            }
            if unmasked {
                unmasked =
                    tile_unmasked(&problem, tile_start, last_query, first_key, last_key, flags);
            }
            let place = TilePlace {
                batch,
                head,
                first_row: first_key,
                first_column: tile_start,
                key_stop: seq_k,
            };
            score_tile::<E>(
                &problem,
                bias,
                forbid,
                slopes,
                &mut scores,
                &mut cap_slopes,
                place,
                unmasked,
                flags,
                tiling,
                false,
                flags.capped,
            );
            row_products(&v, &grad_tile, &mut grad_products, tiling, value_dim);
            #[unroll]
            for c in 0..block {
                let row_stats = stats_tile[c];
                let max = row_stats.extract(0usize);
                let inverse = row_stats.extract(1usize);
                let row_dot = row_stats.extract(2usize);
                #[unroll]
                for slot in 0..rows {
                    let index = slot * block + c;
                    let score = scores[index];
                    let probability = softmax_weight(score, max, inverse);
                    let mut score_grad = probability * (grad_products[index] - row_dot);
                    if flags.capped {
                        score_grad *= cap_slopes[index];
                    }
                    scores[index] = probability;
                    grad_products[index] = score_grad;
                }
            }
            accumulate_products(&mut value_acc, &scores, &grad_tile, tiling, value_dim);
            accumulate_products(&mut key_acc, &grad_products, &query_tile, tiling, head_dim);
        }
    }

    let mut scales = Array::<f32>::new(rows);
    let mut ones = Array::<f32>::new(rows);
    #[unroll]
    for slot in 0..rows {
        scales[slot] = problem.scale;
        ones[slot] = 1.0f32;
    }
    store_unit_rows(
        key_grad, &key_acc, &scales, kv_base, first_key, seq_k, head_dim, tiling,
    );
    store_unit_rows(
        value_grad, &value_acc, &ones, kv_base, first_key, seq_k, value_dim, tiling,
    );
}

/// Elements of the soft cap's slopes array: a tile's worth where the kernel is capped, one
/// unused element otherwise.
fn slopes_length(flags: Flags, tile: usize) -> usize {
    if flags.capped { tile } else { 1 }
}

/// `(m, 1 / Σ, D, 0)` of queries `first..first + tiling.block` into `tile`, a vector per query
/// (zeros past `seq`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_row_stats(
    stats: &Tensor<f32>,
    row_dots: &Tensor<f32>,
    tile: &mut Shared<[Vector<f32, Const<4>>]>,
    base: usize,
    first: u32,
    seq: u32,
    #[comptime] tiling: Tiling,
) {
    let rounds = comptime!(tiling.block.div_ceil(tiling.units));
    #[unroll]
    for round in 0..rounds {
        let offset = round * tiling.units + UNIT_POS_X as usize;
        if offset < tiling.block {
            let row = first + offset as u32;
            let mut row_stats = Vector::<f32, Const<4>>::new(0.0f32);
            if row < seq {
                let index = base + row as usize;
                row_stats.insert(0usize, stats[index * 2]);
                row_stats.insert(1usize, stats[index * 2 + 1]);
                row_stats.insert(2usize, row_dots[index]);
            }
            tile[offset] = row_stats;
        }
    }
}
