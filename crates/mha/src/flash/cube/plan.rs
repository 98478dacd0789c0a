//! How the kernels split a call (the [`Tiling`] of each), and which calls a device cannot run
//! to the end. Two kinds of device differ in what a unit's rows cost:
//!
//! - a GPU keeps a unit's rows in its register file, at most 255 32-bit registers a unit, and
//!   reads one shared-memory address for a whole warp as a broadcast: a unit owns as many rows
//!   as fit in about half of its registers;
//! - a software rasterizer (Mesa's lavapipe/llvmpipe; a device with no physical card behind it)
//!   runs units as SIMD lanes of CPU threads, keeps their arrays in memory, and pays a loop over
//!   the lanes for every load inside a loop: a unit owns 8 rows, so that each value staged in
//!   shared memory feeds 8 FMAs per load. llvmpipe also stops a shader after 65535 loop
//!   iterations in all, silently: calls that would loop longer go to the generic body.
//!
//! Measured on lavapipe (`cargo bench --bench gpu`, `(2, 1024, 256, 4)` f32 `fwd+bwd`, each
//! row one run; `units, rows, block, columns`): `32, 4, 16, 4` 1332 ms; `32, 8, 16, 4` 929-955
//! ms; `32, 8, 16, 2` 963 ms; `32, 8, 16, 1` 778-808 ms; `32, 8, 32, 1` 891 ms; `32, 8, 8, 1`
//! 867 ms; `32, 16, 16, 2` 748 ms but four times the shader compilation (237 s).

use burn_cubecl::cubecl;

use crate::geometry::Geometry;

use super::tile::{Tiling, width_chunk};

/// Units per cube of the tiled kernels.
const UNITS: usize = 32;

/// Shared memory the kernels plan for (the least a Vulkan device must offer is 16 KiB).
const SHARED_BYTES: usize = 16 * 1024;

/// The staged tiles' rows at most.
const MAX_BLOCK: usize = 16;

/// The 32-bit registers a GPU unit may give to its rows of queries (or keys) and their
/// accumulators: half of the 255 a unit can address, the rest for scores and addresses.
const ROW_REGISTERS: usize = 128;

/// llvmpipe's loop limiter: a shader's loops iterate this many times in all, then stop.
pub(super) const SOFTWARE_LOOP_LIMIT: usize = 65535;

/// Iterations kept in reserve under [`SOFTWARE_LOOP_LIMIT`]: each loop's exit test may count
/// once more than its iterations.
const SOFTWARE_LOOP_MARGIN: usize = 256;

/// What runs a kernel's units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Executor {
    /// A GPU.
    Hardware,
    /// A software rasterizer (a device with no physical card behind it, such as lavapipe).
    Software,
}

impl Executor {
    /// A device with no physical card behind it is a software rasterizer.
    pub fn of(properties: &cubecl::ir::DeviceProperties) -> Self {
        match properties.identity.physical {
            Some(_) => Executor::Hardware,
            None => Executor::Software,
        }
    }
}

/// The kernels' tilings for one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Plan {
    /// The forward and `dQ` kernels: rows are queries, staged rows keys and values.
    pub query_side: Tiling,
    /// The `dK`/`dV` kernel: rows are keys, staged rows queries, output gradients and their
    /// statistics.
    pub key_side: Tiling,
}

impl Plan {
    pub fn new(geometry: &Geometry, executor: Executor) -> Self {
        Self {
            query_side: tiling(geometry, executor, 0),
            // A staged query row carries `(m, 1 / Σ, D, 0)` too.
            key_side: tiling(geometry, executor, 4),
        }
    }

    /// Loop iterations of the longest-looping kernel's unit: the tile loops and, per tile, the
    /// runtime loops of the scores (one per staged row) and of the products (one per sub-tile
    /// of staged rows); the rest is unrolled.
    pub fn loop_iterations(&self, geometry: &Geometry) -> usize {
        let per_tile = |tiling: &Tiling, products: usize| {
            1 + tiling.block + products * tiling.block.div_ceil(tiling.columns)
        };
        let key_tiles = geometry.seq_k.div_ceil(self.query_side.block);
        let query_tiles = geometry.seq_q.div_ceil(self.key_side.block);
        let group = geometry.n_heads / geometry.n_kv_heads.max(1);
        let forward = key_tiles * per_tile(&self.query_side, 2);
        let query_grad = key_tiles * per_tile(&self.query_side, 3);
        let key_value_grad = group * (1 + query_tiles * per_tile(&self.key_side, 4));
        forward.max(query_grad).max(key_value_grad)
    }

    /// Whether `executor` runs every loop of the call to the end (on a software rasterizer with
    /// [`SOFTWARE_LOOP_MARGIN`] to spare).
    pub fn runs_to_the_end(&self, geometry: &Geometry, executor: Executor) -> bool {
        executor == Executor::Hardware
            || self.loop_iterations(geometry) + SOFTWARE_LOOP_MARGIN <= SOFTWARE_LOOP_LIMIT
    }
}

/// The tiling of a kernel whose staged rows hold a row of each head width and `staged_extra`
/// more f32: as many staged rows as fit in [`SHARED_BYTES`], up to [`MAX_BLOCK`], and as many
/// rows per unit as the executor affords (see the module docs).
fn tiling(geometry: &Geometry, executor: Executor, staged_extra: usize) -> Tiling {
    let widths = geometry.head_dim + geometry.value_dim;
    let fits = SHARED_BYTES / ((widths + staged_extra) * size_of::<f32>());
    let (rows, columns) = match executor {
        Executor::Software => (8, 1),
        Executor::Hardware => ((ROW_REGISTERS / widths).clamp(1, 4), 4),
    };
    let block = (fits / columns * columns).clamp(columns, MAX_BLOCK);
    Tiling {
        units: UNITS,
        rows,
        block,
        columns,
    }
}

/// Elements per global read and shared-memory vector: 4 where both head widths allow it, else
/// 2 or 1.
pub(super) fn vector_size(geometry: &Geometry) -> usize {
    width_chunk(geometry.head_dim).min(width_chunk(geometry.value_dim))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry(seq_q: usize, seq_k: usize, head_dim: usize) -> Geometry {
        Geometry {
            batch: 1,
            n_heads: 4,
            n_kv_heads: 2,
            seq_q,
            seq_k,
            head_dim,
            value_dim: head_dim,
        }
    }

    /// `tests/gpu_kernels.rs`'s call at the loop limit: 8 queries, 16 000 keys, one head of
    /// width 4; the `dQ` kernel's count decides it (65 000 iterations).
    #[test]
    fn the_integration_tests_call_at_the_loop_limit_is_taken_and_one_tile_more_is_not() {
        let at_limit = Geometry {
            batch: 1,
            n_heads: 1,
            n_kv_heads: 1,
            seq_q: 8,
            seq_k: 16_000,
            head_dim: 4,
            value_dim: 4,
        };
        let plan = Plan::new(&at_limit, Executor::Software);
        assert_eq!(plan.loop_iterations(&at_limit), 65_000);
        assert!(plan.runs_to_the_end(&at_limit, Executor::Software));
        let past = Geometry {
            seq_k: 16_000 + 16 * 8,
            ..at_limit
        };
        assert!(!plan.runs_to_the_end(&past, Executor::Software));
    }

    /// Staged tiles fit in 16 KiB and divide into sub-tiles; a GPU unit's rows fit in its
    /// register budget.
    #[test]
    fn tilings_fit_shared_memory_and_registers() {
        for head_dim in [1, 5, 32, 64, 96, 128, 256] {
            let geometry = geometry(100, 100, head_dim);
            for executor in [Executor::Hardware, Executor::Software] {
                let plan = Plan::new(&geometry, executor);
                for (tiling, extra) in [(plan.query_side, 0), (plan.key_side, 4)] {
                    let staged = tiling.block * (2 * head_dim + extra) * size_of::<f32>();
                    assert!(staged <= SHARED_BYTES, "{head_dim} {executor:?}: {staged}");
                    assert_eq!(tiling.block % tiling.columns, 0, "{head_dim} {executor:?}");
                    if executor == Executor::Hardware {
                        assert!(
                            tiling.rows == 1 || tiling.rows * 2 * head_dim <= ROW_REGISTERS,
                            "{head_dim}: {} rows",
                            tiling.rows
                        );
                    }
                }
            }
        }
    }

    /// On a software rasterizer a call whose loops would pass llvmpipe's limit is refused, one
    /// within it is taken, and a GPU takes both; the count grows with the keys (forward, `dQ`)
    /// and with the queries times the group (`dK`/`dV`).
    #[test]
    fn calls_past_the_software_loop_limit_are_refused_there_only() {
        let short = geometry(1024, 1024, 64);
        let long = geometry(16384, 16384, 64);
        let software = Plan::new(&short, Executor::Software);
        assert!(software.runs_to_the_end(&short, Executor::Software));
        assert!(!Plan::new(&long, Executor::Software).runs_to_the_end(&long, Executor::Software));
        assert!(Plan::new(&long, Executor::Hardware).runs_to_the_end(&long, Executor::Hardware));
        let more_keys = geometry(1024, 4096, 64);
        let more_queries = geometry(4096, 1024, 64);
        assert!(software.loop_iterations(&more_keys) > software.loop_iterations(&short));
        assert!(software.loop_iterations(&more_queries) > software.loop_iterations(&short));
        // 16 staged queries a tile, one loop iteration per query for the scores and for each
        // of the `dK`/`dV` kernel's four products, over 1024 queries, for both heads of the
        // group.
        assert_eq!(
            software.loop_iterations(&short),
            2 * (1 + 64 * (1 + 16 + 4 * 16))
        );
    }
}
