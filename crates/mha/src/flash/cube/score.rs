//! What the three kernels agree on: the problem's sizes and rules as launch arguments, and one
//! score `q·k` turned into the logit the softmax sees (soft cap, float bias, ALiBi) or found
//! hidden (causal, window, key padding, a `-inf` bias). Forward and backward call the same
//! functions, so a recomputed probability is the forward's to the last bit.

// `#[cube]` expands a subset of Rust into kernel IR: the integer `div_ceil` and `if`
// conditions mixing a comptime flag with a runtime test are kept in the forms it expands.
#![allow(clippy::manual_div_ceil, clippy::collapsible_if)]

use burn_cubecl::cubecl;
use cubecl::prelude::*;

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

/// A logit, whether the softmax sees it, and `d logit / d(q·k·scale)` (the soft cap's slope).
#[derive(CubeType)]
pub struct Logit {
    pub value: f32,
    pub visible: bool,
    pub slope: f32,
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

/// The logit of `dot = q·k` for query `query` and key `key` of head `head` in batch element
/// `batch`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn logit<E: Float>(
    problem: &Problem,
    bias: &Tensor<E>,
    forbid: &Tensor<E>,
    slopes: &Tensor<f32>,
    dot: f32,
    batch: u32,
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
    if flags.has_bias {
        value += f32::cast_from(bias[offset(&problem.bias, batch, head, query, key)]);
    }
    if flags.has_alibi && key < problem.positional {
        let distance = problem.query_start + i32::cast_from(query) - key_position(problem, key);
        value -= slopes[head as usize] * f32::cast_from(distance).abs();
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
    Logit {
        value,
        visible,
        slope,
    }
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
