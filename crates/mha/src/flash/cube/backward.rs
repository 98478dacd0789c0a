//! The backward kernels (FlashAttention-2's backward, Dao 2023, Algorithm 2), each score tile
//! recomputed from the forward's statistics:
//!
//! 1. `row_dot_kernel`: `D = rowsum(dO ∘ O)`, one unit per query.
//! 2. `query_grad_kernel`: `dQ = scale · Σ_k dS K`, one unit per query, key/value tiles in
//!    shared memory (as the forward).
//! 3. `key_value_grad_kernel`: `dV = Σ_q P dO`, `dK = scale · Σ_q dS Q`, one unit per key,
//!    query tiles (queries, output gradients, statistics, `D`) in shared memory, every query
//!    head of the key's group in turn: GQA's sum over the group without copying key heads,
//!    and no atomics (each unit owns its key's gradients).
//!
//! with `P = exp(S - m) / Σ` and `dS = P ∘ (dO Vᵀ - D)` times the soft cap's slope.

// `#[cube]` expands a subset of Rust into kernel IR: the integer `div_ceil` and `if`
// conditions mixing a comptime flag with a runtime test are kept in the forms it expands.
#![allow(clippy::manual_div_ceil, clippy::collapsible_if)]

use burn_cubecl::cubecl;
use cubecl::prelude::*;

use super::forward::load_tile;
use super::score::{Flags, Problem, key_end, logit, query_start};

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

/// One cube per `(query tile, batch · head)`, as the forward.
// Over 80 lines: one kernel is one GPU program, its setup, tile loop and write-back
// together (the per-score work is `logit`, the loads `load_tile`).
#[cube(launch, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub(super) fn query_grad_kernel<E: Float>(
    query: &Tensor<E>,
    key: &Tensor<E>,
    value: &Tensor<E>,
    bias: &Tensor<E>,
    forbid: &Tensor<E>,
    slopes: &Tensor<f32>,
    stats: &Tensor<f32>,
    row_dots: &Tensor<f32>,
    output_grad: &Tensor<E>,
    query_grad: &mut Tensor<E>,
    problem: Problem,
    #[comptime] flags: Flags,
    #[comptime] block_q: usize,
    #[comptime] block_k: usize,
    #[define(E)] _dtype: ElemType,
) {
    let head_dim = flags.head_dim;
    let value_dim = flags.value_dim;
    let seq_q = problem.seq_q;
    let seq_k = problem.seq_k;
    let head_index = CUBE_POS_Y;
    let batch = head_index / problem.n_heads;
    let head = head_index % problem.n_heads;
    let kv_head = head / (problem.n_heads / problem.n_kv_heads);
    let first_query = CUBE_POS_X * block_q as u32;
    let row = first_query + UNIT_POS_X;
    let active = row < seq_q;

    let row_index = head_index as usize * seq_q as usize + row as usize;
    let mut q_row = Array::<f32>::new(head_dim);
    let mut grad_row = Array::<f32>::new(value_dim);
    let mut accumulated = Array::<f32>::new(head_dim);
    let mut max = 0.0f32;
    let mut inverse = 0.0f32;
    let mut row_dot = 0.0f32;
    #[unroll]
    for d in 0..head_dim {
        q_row[d] = 0.0f32;
        accumulated[d] = 0.0f32;
        if active {
            q_row[d] = f32::cast_from(query[row_index * head_dim + d]);
        }
    }
    #[unroll]
    for d in 0..value_dim {
        grad_row[d] = 0.0f32;
        if active {
            grad_row[d] = f32::cast_from(output_grad[row_index * value_dim + d]);
        }
    }
    if active {
        max = stats[row_index * 2];
        inverse = stats[row_index * 2 + 1];
        row_dot = row_dots[row_index];
    }

    let mut last_query = first_query + block_q as u32 - 1;
    if last_query >= seq_q {
        last_query = seq_q - 1;
    }
    let key_stop = key_end(&problem, last_query, flags);
    let kv_base = (batch * problem.n_kv_heads + kv_head) as usize * seq_k as usize;
    let mut key_tile = Shared::<[f32]>::new_slice(block_k * head_dim);
    let mut value_tile = Shared::<[f32]>::new_slice(block_k * value_dim);
    let tiles = (key_stop + block_k as u32 - 1) / block_k as u32;

    for tile in 0..tiles {
        let tile_start = tile * block_k as u32;
        sync_cube();
        load_tile(
            key,
            &mut key_tile,
            kv_base,
            tile_start,
            seq_k,
            head_dim,
            block_q,
            block_k,
        );
        load_tile(
            value,
            &mut value_tile,
            kv_base,
            tile_start,
            seq_k,
            value_dim,
            block_q,
            block_k,
        );
        sync_cube();
        if active {
            for offset in 0..block_k {
                let key_index = tile_start + offset as u32;
                if key_index < key_stop {
                    let mut dot = 0.0f32;
                    #[unroll]
                    for d in 0..head_dim {
                        dot += q_row[d] * key_tile[offset * head_dim + d];
                    }
                    let score = logit::<E>(
                        &problem, bias, forbid, slopes, dot, batch, head, row, key_index, flags,
                    );
                    if score.visible {
                        let probability = (score.value - max).exp() * inverse;
                        let mut grad_dot = 0.0f32;
                        #[unroll]
                        for d in 0..value_dim {
                            grad_dot += grad_row[d] * value_tile[offset * value_dim + d];
                        }
                        let score_grad = probability * (grad_dot - row_dot) * score.slope;
                        #[unroll]
                        for d in 0..head_dim {
                            accumulated[d] += score_grad * key_tile[offset * head_dim + d];
                        }
                    }
                }
            }
        }
    }

    if active {
        #[unroll]
        for d in 0..head_dim {
            query_grad[row_index * head_dim + d] = E::cast_from(accumulated[d] * problem.scale);
        }
    }
}

/// One cube per `(key tile, batch · key/value head)`: `CUBE_POS_X` the tile, `CUBE_POS_Y` the
/// key/value head; `block_k` units, one per key of the tile.
// Over 80 lines: one kernel is one GPU program, its setup, tile loop and write-back
// together (the per-score work is `logit`, the loads `load_tile`).
#[cube(launch, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub(super) fn key_value_grad_kernel<E: Float>(
    query: &Tensor<E>,
    key: &Tensor<E>,
    value: &Tensor<E>,
    bias: &Tensor<E>,
    forbid: &Tensor<E>,
    slopes: &Tensor<f32>,
    stats: &Tensor<f32>,
    row_dots: &Tensor<f32>,
    output_grad: &Tensor<E>,
    key_grad: &mut Tensor<E>,
    value_grad: &mut Tensor<E>,
    problem: Problem,
    #[comptime] flags: Flags,
    #[comptime] block_q: usize,
    #[comptime] block_k: usize,
    #[define(E)] _dtype: ElemType,
) {
    let head_dim = flags.head_dim;
    let value_dim = flags.value_dim;
    let seq_q = problem.seq_q;
    let seq_k = problem.seq_k;
    let kv_index = CUBE_POS_Y;
    let batch = kv_index / problem.n_kv_heads;
    let kv_head = kv_index % problem.n_kv_heads;
    let group = problem.n_heads / problem.n_kv_heads;
    let first_key = CUBE_POS_X * block_k as u32;
    let key_index = first_key + UNIT_POS_X;
    let active = key_index < seq_k;

    let key_row = kv_index as usize * seq_k as usize + key_index as usize;
    let mut k_row = Array::<f32>::new(head_dim);
    let mut v_row = Array::<f32>::new(value_dim);
    let mut key_acc = Array::<f32>::new(head_dim);
    let mut value_acc = Array::<f32>::new(value_dim);
    #[unroll]
    for d in 0..head_dim {
        k_row[d] = 0.0f32;
        key_acc[d] = 0.0f32;
        if active {
            k_row[d] = f32::cast_from(key[key_row * head_dim + d]);
        }
    }
    #[unroll]
    for d in 0..value_dim {
        v_row[d] = 0.0f32;
        value_acc[d] = 0.0f32;
        if active {
            v_row[d] = f32::cast_from(value[key_row * value_dim + d]);
        }
    }

    let query_begin = query_start(&problem, first_key, flags);
    let first_tile = query_begin / block_q as u32;
    let tiles = (seq_q + block_q as u32 - 1) / block_q as u32;
    let mut query_tile = Shared::<[f32]>::new_slice(block_q * head_dim);
    let mut grad_tile = Shared::<[f32]>::new_slice(block_q * value_dim);
    let mut stats_tile = Shared::<[f32]>::new_slice(block_q * 3);

    for member in 0..group {
        let head = kv_head * group + member;
        let head_index = batch * problem.n_heads + head;
        let q_base = head_index as usize * seq_q as usize;
        for tile in first_tile..tiles {
            let tile_start = tile * block_q as u32;
            sync_cube();
            load_tile(
                query,
                &mut query_tile,
                q_base,
                tile_start,
                seq_q,
                head_dim,
                block_k,
                block_q,
            );
            load_tile(
                output_grad,
                &mut grad_tile,
                q_base,
                tile_start,
                seq_q,
                value_dim,
                block_k,
                block_q,
            );
            load_row_stats(
                stats,
                row_dots,
                &mut stats_tile,
                q_base,
                tile_start,
                seq_q,
                block_k,
                block_q,
            );
            sync_cube();
            if active {
                for offset in 0..block_q {
                    let row = tile_start + offset as u32;
                    if row < seq_q {
                        let mut dot = 0.0f32;
                        #[unroll]
                        for d in 0..head_dim {
                            dot += query_tile[offset * head_dim + d] * k_row[d];
                        }
                        let score = logit::<E>(
                            &problem, bias, forbid, slopes, dot, batch, head, row, key_index, flags,
                        );
                        if score.visible {
                            let probability = (score.value - stats_tile[offset * 3]).exp()
                                * stats_tile[offset * 3 + 1];
                            let mut grad_dot = 0.0f32;
                            #[unroll]
                            for d in 0..value_dim {
                                let grad = grad_tile[offset * value_dim + d];
                                value_acc[d] += probability * grad;
                                grad_dot += grad * v_row[d];
                            }
                            let score_grad =
                                probability * (grad_dot - stats_tile[offset * 3 + 2]) * score.slope;
                            #[unroll]
                            for d in 0..head_dim {
                                key_acc[d] += score_grad * query_tile[offset * head_dim + d];
                            }
                        }
                    }
                }
            }
        }
    }

    if active {
        #[unroll]
        for d in 0..head_dim {
            key_grad[key_row * head_dim + d] = E::cast_from(key_acc[d] * problem.scale);
        }
        #[unroll]
        for d in 0..value_dim {
            value_grad[key_row * value_dim + d] = E::cast_from(value_acc[d]);
        }
    }
}

/// `(m, 1 / Σ, D)` of queries `tile_start..tile_start + rows` into `tile`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_row_stats(
    stats: &Tensor<f32>,
    row_dots: &Tensor<f32>,
    tile: &mut Shared<[f32]>,
    base: usize,
    tile_start: u32,
    seq: u32,
    #[comptime] units: usize,
    #[comptime] rows: usize,
) {
    let rounds = comptime!(rows.div_ceil(units));
    #[unroll]
    for round in 0..rounds {
        let offset = round * units + UNIT_POS_X as usize;
        if offset < rows {
            let row = tile_start + offset as u32;
            let mut max = 0.0f32;
            let mut inverse = 0.0f32;
            let mut row_dot = 0.0f32;
            if row < seq {
                let index = base + row as usize;
                max = stats[index * 2];
                inverse = stats[index * 2 + 1];
                row_dot = row_dots[index];
            }
            tile[offset * 3] = max;
            tile[offset * 3 + 1] = inverse;
            tile[offset * 3 + 2] = row_dot;
        }
    }
}
