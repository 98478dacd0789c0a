//! What the three kernels agree on: the problem's sizes and rules as launch arguments, and a
//! unit's score tile turned into the logits the softmax sees (scale, soft cap, ALiBi, float
//! bias) or found hidden (causal, window, key padding, a `-inf` bias). A tile that nothing
//! hides ([`tile_unmasked`], decided once per tile for the whole cube) takes only the first
//! three, the same arithmetic the others start from, so forward and backward, which group
//! scores into tiles differently, recompute each probability to the forward's last bit.

// `#[cube]` expands a subset of Rust into kernel IR: the integer `div_ceil` and `if`
// conditions mixing a comptime flag with a runtime test are kept in the forms it expands.
#![allow(clippy::manual_div_ceil, clippy::collapsible_if)]

use burn_cubecl::cubecl;
use cubecl::prelude::*;

use super::tile::{HIDDEN, Tiling, unit_row};

/// Sizes, scalars and rules of one call, shared by every kernel of the op.
#[derive(CubeLaunch, CubeType)]
pub struct Problem {
    pub seq_q: u32,
    pub seq_k: u32,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    /// Multiplies `q·k`.
    pub scale: f32,
    /// The soft cap (unused without `capped`).
    pub softcap: f32,
    /// Absolute position of query 0.
    pub query_start: i32,
    /// Absolute position of the first unpinned key.
    pub key_start: i32,
    /// Keys `0..pinned` sit at positions `0..pinned` and no window hides them.
    pub pinned: u32,
    /// Keys at or after this index are appended: always visible, no ALiBi.
    pub positional: u32,
    /// Each query sees `window` positions up to itself (0: no window).
    pub window: u32,
    /// Where the float bias is read.
    pub bias: Strides,
    /// Where the forbidden-key flags are read.
    pub forbid: Strides,
}

/// What the kernels are compiled for: one kernel per combination.
#[derive_cube_comptime]
pub struct Flags {
    pub causal: bool,
    pub capped: bool,
    pub has_bias: bool,
    pub has_forbid: bool,
    pub has_alibi: bool,
    pub head_dim: usize,
    pub value_dim: usize,
}

/// Element strides over `[batch, head, query, key]`, 0 on broadcast axes.
#[derive(CubeLaunch, CubeType)]
pub struct Strides {
    pub batch: u32,
    pub head: u32,
    pub query: u32,
    pub key: u32,
}

#[cube]
fn offset(strides: &Strides, batch: u32, head: u32, query: u32, key: u32) -> usize {
    let offset =
        batch * strides.batch + head * strides.head + query * strides.query + key * strides.key;
    offset as usize
}

/// A logit before the masks, and `d logit / d(q·k·scale)` (the soft cap's slope).
#[derive(CubeType)]
pub struct Logit {
    pub value: f32,
    pub slope: f32,
}

/// A logit after the masks, and whether the softmax sees it.
#[derive(CubeType)]
pub struct Masked {
    pub value: f32,
    pub visible: bool,
}

/// The absolute position of key `key`.
#[cube]
fn key_position(problem: &Problem, key: u32) -> i32 {
    let mut position = i32::cast_from(key);
    if key >= problem.pinned {
        position = problem.key_start + i32::cast_from(key - problem.pinned);
    }
    position
}

/// Whether the causal and window rules let query `query` see key `key`.
#[cube]
pub fn rules_allow(problem: &Problem, query: u32, key: u32, #[comptime] flags: Flags) -> bool {
    let mut allowed = true;
    if key < problem.positional {
        let distance = problem.query_start + i32::cast_from(query) - key_position(problem, key);
        if flags.causal {
            allowed = distance >= 0;
        }
        if problem.window > 0 && key >= problem.pinned {
            let window = i32::cast_from(problem.window);
            if distance >= window {
                allowed = false;
            }
            if !flags.causal && -distance >= window {
                allowed = false;
            }
        }
    }
    allowed
}

/// The logit of `dot = q·k` for query `query` and key `key` of head `head`, before any rule,
/// mask or float bias: the scale, the soft cap and ALiBi. What a tile that nothing hides
/// computes per score ([`tile_unmasked`]); [`masked_logit`] adds the rest to the same value.
#[cube]
pub fn unmasked_logit(
    problem: &Problem,
    slopes: &Tensor<f32>,
    dot: f32,
    head: u32,
    query: u32,
    key: u32,
    #[comptime] flags: Flags,
) -> Logit {
    let mut value = dot * problem.scale;
    let mut slope = 1.0f32;
    if flags.capped {
        let capped = (value / problem.softcap).tanh();
        value = problem.softcap * capped;
        slope = 1.0f32 - capped * capped;
    }
    if flags.has_alibi && key < problem.positional {
        let distance = problem.query_start + i32::cast_from(query) - key_position(problem, key);
        value -= slopes[head as usize] * f32::cast_from(distance).abs();
    }
    Logit { value, slope }
}

/// What the masks make of `unmasked`, the [`unmasked_logit`] of query `query` and key `key` of
/// head `head` in batch element `batch`: the logit with the float bias added, and whether the
/// rules, the forbidden keys and a `-inf` bias leave it visible.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn masked_logit<E: Float>(
    problem: &Problem,
    bias: &Tensor<E>,
    forbid: &Tensor<E>,
    unmasked: f32,
    batch: u32,
    head: u32,
    query: u32,
    key: u32,
    #[comptime] flags: Flags,
) -> Masked {
    let mut value = unmasked;
    if flags.has_bias {
        value += f32::cast_from(bias[offset(&problem.bias, batch, head, query, key)]);
    }
    let mut visible = rules_allow(problem, query, key, flags);
    if flags.has_forbid {
        if f32::cast_from(forbid[offset(&problem.forbid, batch, head, query, key)]) > 0.5f32 {
            visible = false;
        }
    }
    // A `-inf` bias hides a key as a mask does (and keeps `exp(-inf - -inf)` out of the sums).
    if value < -3.4028235e38f32 {
        visible = false;
    }
    Masked { value, visible }
}

/// Whether every query of `first_query..=last_query` sees every key of `first_key..=last_key`
/// with nothing read per score but the scores themselves: no forbidden keys or float bias (a
/// bias may be `-inf`), every key before `seq_k`, and no causal or window rule hiding any pair.
/// Such a tile takes [`unmasked_logit`] as it is, the value [`masked_logit`] keeps for visible
/// scores without a bias.
#[cube]
pub fn tile_unmasked(
    problem: &Problem,
    first_query: u32,
    last_query: u32,
    first_key: u32,
    last_key: u32,
    #[comptime] flags: Flags,
) -> bool {
    let mut unmasked = true;
    if flags.has_bias {
        unmasked = false;
    }
    if flags.has_forbid {
        unmasked = false;
    }
    if last_key >= problem.seq_k {
        unmasked = false;
    }
    if first_key < problem.positional {
        // Appended keys are always visible; the others follow the rules, one region at a time
        // (pinned keys or the rest), inside which positions grow with the key.
        if last_key >= problem.positional {
            unmasked = false;
        }
        if first_key < problem.pinned && last_key >= problem.pinned {
            unmasked = false;
        }
        let nearest =
            problem.query_start + i32::cast_from(first_query) - key_position(problem, last_key);
        let farthest =
            problem.query_start + i32::cast_from(last_query) - key_position(problem, first_key);
        if flags.causal && nearest < 0 {
            unmasked = false;
        }
        if problem.window > 0 && first_key >= problem.pinned {
            let window = i32::cast_from(problem.window);
            if farthest >= window {
                unmasked = false;
            }
            if !flags.causal && -nearest >= window {
                unmasked = false;
            }
        }
    }
    unmasked
}

/// One past the last key that queries `..=last_query` may see: keys after it are skipped
/// whole (bottom-right causal masking).
#[cube]
pub fn key_end(problem: &Problem, last_query: u32, #[comptime] flags: Flags) -> u32 {
    let mut end = problem.seq_k;
    if flags.causal && problem.positional == problem.seq_k {
        let past = problem.query_start + i32::cast_from(last_query) + 1 - problem.key_start
            + i32::cast_from(problem.pinned);
        end = problem.pinned;
        if past > i32::cast_from(problem.pinned) {
            end = u32::cast_from(past);
        }
        if end > problem.positional {
            end = problem.positional;
        }
    }
    end
}

/// The first query that may see any key from `first_key` on (causal masking); queries before
/// it are skipped whole.
#[cube]
pub fn query_start(problem: &Problem, first_key: u32, #[comptime] flags: Flags) -> u32 {
    let mut start = 0u32;
    if flags.causal && first_key < problem.positional {
        let first = key_position(problem, first_key) - problem.query_start;
        if first > 0 {
            start = u32::cast_from(first);
        }
        if start > problem.seq_q {
            start = problem.seq_q;
        }
    }
    start
}

/// Where a unit's score tile lies: which rows are queries, and the staged tile's first column.
#[derive(CubeType, Clone, Copy)]
pub struct TilePlace {
    pub batch: u32,
    pub head: u32,
    /// The first row of the cube's block.
    pub first_row: u32,
    /// The staged tile's first row (the score tile's first column).
    pub first_column: u32,
    /// Keys from here on are past the cube's causal horizon (hidden).
    pub key_stop: u32,
}

/// Turns the unit's `rows × block` dot products into logits in place, [`HIDDEN`] where the
/// softmax does not see them, and (with `keep_slopes`) the soft cap's slopes into
/// `cap_slopes`. Rows are queries and columns keys with `rows_are_queries`, the other way
/// round without. A tile that nothing hides (`unmasked`, from [`tile_unmasked`]) computes only
/// [`unmasked_logit`]; the others [`masked_logit`] with every rule, and hide the columns past the
/// staged side's end.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn score_tile<E: Float>(
    problem: &Problem,
    bias: &Tensor<E>,
    forbid: &Tensor<E>,
    slopes: &Tensor<f32>,
    scores: &mut Array<f32>,
    cap_slopes: &mut Array<f32>,
    place: TilePlace,
    unmasked: bool,
    #[comptime] flags: Flags,
    #[comptime] tiling: Tiling,
    #[comptime] rows_are_queries: bool,
    #[comptime] keep_slopes: bool,
) {
    // One runtime loop over the columns (llvmpipe counts every loop iteration against its
    // limit: one loop per row would count `rows` times as many, `plan.rs`).
    for c in 0..tiling.block {
        let column = place.first_column + c as u32;
        #[unroll]
        for slot in 0..tiling.rows {
            let row = unit_row(place.first_row, slot, tiling);
            let mut query = row;
            let mut key = column;
            if !rows_are_queries {
                query = column;
                key = row;
            }
            let index = slot * tiling.block + c;
            let logit = unmasked_logit(
                problem,
                slopes,
                scores[index],
                place.head,
                query,
                key,
                flags,
            );
            let mut value = logit.value;
            if !unmasked {
                let masked = masked_logit::<E>(
                    problem,
                    bias,
                    forbid,
                    logit.value,
                    place.batch,
                    place.head,
                    query,
                    key,
                    flags,
                );
                let mut visible = masked.visible;
                if key >= place.key_stop || query >= problem.seq_q {
                    visible = false;
                }
                value = select(visible, masked.value, HIDDEN);
            }
            scores[index] = value;
            if keep_slopes {
                cap_slopes[index] = logit.slope;
            }
        }
    }
}
