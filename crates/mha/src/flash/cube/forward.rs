//! The forward kernel: each unit owns one query row (its scaled query, running maximum, sum
//! and weighted values in registers); the cube's units load each key/value tile into shared
//! memory together, and tiles past the cube's causal horizon are never loaded.
//!
//! Writes the output and each query's softmax statistics `(m, 1 / Σ)`, f32, the pair the
//! generic body keeps (see `FlashForward::softmax_stats`).

// `#[cube]` expands a subset of Rust into kernel IR: the integer `div_ceil` and `if`
// conditions mixing a comptime flag with a runtime test are kept in the forms it expands.
#![allow(clippy::manual_div_ceil, clippy::collapsible_if)]

use burn_cubecl::cubecl;
use cubecl::prelude::*;

use super::score::{Flags, Problem, key_end, logit};

/// One cube per `(query tile, batch · head)`: `CUBE_POS_X` the tile, `CUBE_POS_Y` the head;
/// `block_q` units, one per query of the tile.
// Over 80 lines: one kernel is one GPU program, its setup, tile loop and write-back
// together (the per-score work is `logit`, the loads `load_tile`).
#[cube(launch, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub(super) fn forward_kernel<E: Float>(
    query: &Tensor<E>,
    key: &Tensor<E>,
    value: &Tensor<E>,
    bias: &Tensor<E>,
    forbid: &Tensor<E>,
    slopes: &Tensor<f32>,
    output: &mut Tensor<E>,
    stats: &mut Tensor<f32>,
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
    let mut accumulated = Array::<f32>::new(value_dim);
    #[unroll]
    for d in 0..head_dim {
        q_row[d] = 0.0f32;
        if active {
            q_row[d] = f32::cast_from(query[row_index * head_dim + d]);
        }
    }
    #[unroll]
    for d in 0..value_dim {
        accumulated[d] = 0.0f32;
    }
    // The lowest finite f32: the maximum of a row that has seen no key yet.
    let mut max = f32::new(-3.4028235e38);
    let mut sum = 0.0f32;

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
                        if score.value > max {
                            let correction = (max - score.value).exp();
                            sum *= correction;
                            #[unroll]
                            for d in 0..value_dim {
                                accumulated[d] *= correction;
                            }
                            max = score.value;
                        }
                        let probability = (score.value - max).exp();
                        sum += probability;
                        #[unroll]
                        for d in 0..value_dim {
                            accumulated[d] += probability * value_tile[offset * value_dim + d];
                        }
                    }
                }
            }
        }
    }

    if active {
        // At least 1 wherever a key was seen (the maximum contributes exp(0)); 0 where none
        // was, whose output is then 0.
        let mut normaliser = sum;
        if normaliser < 1.0f32 {
            normaliser = 1.0f32;
        }
        let inverse = 1.0f32 / normaliser;
        #[unroll]
        for d in 0..value_dim {
            output[row_index * value_dim + d] = E::cast_from(accumulated[d] * inverse);
        }
        stats[row_index * 2] = max;
        stats[row_index * 2 + 1] = inverse;
    }
}

/// Copies rows `tile_start..tile_start + block_k` of one head of `source` (`[.., seq, width]`,
/// rows from `base`) into `tile` as f32, zeros past `seq`; every unit of the cube takes part.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn load_tile<E: Float>(
    source: &Tensor<E>,
    tile: &mut Shared<[f32]>,
    base: usize,
    tile_start: u32,
    seq: u32,
    #[comptime] width: usize,
    #[comptime] units: usize,
    #[comptime] rows: usize,
) {
    let elements = rows * width;
    let rounds = comptime!(elements.div_ceil(units));
    #[unroll]
    for round in 0..rounds {
        let index = round * units + UNIT_POS_X as usize;
        if index < elements {
            let row = tile_start + (index / width) as u32;
            let mut element = 0.0f32;
            if row < seq {
                element = f32::cast_from(source[(base + row as usize) * width + index % width]);
            }
            tile[index] = element;
        }
    }
}
