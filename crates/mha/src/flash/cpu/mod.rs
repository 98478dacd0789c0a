//! The flash op on the f32 storage of the CPU backends (flex, ndarray): the computation of
//! `generic.rs`, with the matmuls handed to the `gemm` crate (flex's own GEMM) on strided views
//! (no transposed or head-split copies), the scale folded into the score GEMM (a decoding
//! step's few query rows: `simd::key_dots` on the keys where they lie), a vectorised
//! `exp`, keys past a query block's causal horizon never computed, results written
//! sequence-major (the layout the head merge reads without a copy), and every intermediate in
//! one reused per-thread buffer instead of fresh tensors.
//!
//! Each query block takes all its visible keys in one pass (a `query block × keys` score
//! buffer per thread), so a row's softmax needs no running rescale.
//!
//! Parallel over `(batch, head)` in the forward and over `(batch, key/value head)` in the
//! backward, where each task owns its key/value gradients outright.
//!
//! - `mod.rs`: the call's inputs as views ([`Kernel`]), its blocks and which keys they see;
//! - `scores.rs`: a block's scores, biases and masks, shared by forward and backward;
//! - `forward.rs`, `backward.rs`: the two passes;
//! - `weights.rs`: the forward that writes the attention weights too (inference).
//!
//! Soundness rests on the CPU layer's checked views (`cpu/matrix.rs`); the entry points check
//! the inputs' shapes against each other ([`FlashInputs::geometry`]).

mod backward;
mod forward;
mod scores;
mod weights;

pub(super) use backward::backward;
pub(super) use forward::forward;
pub(super) use weights::forward_with_weights;

use std::ops::Range;

use burn::backend::tensor::FloatTensor;
use burn::backend::{DType, Shape, TensorMetadata};

use super::inputs::{FlashInputs, FlashParams};
use crate::cpu::matrix::{
    BroadcastView, HeadIndex, HeadsView, Matrix, StridedRow, Threads, dense_copy, transposed_copy,
};
use crate::cpu::storage::{CpuStorage, rank_4};
use crate::geometry::Geometry;

/// The inputs in layouts [`HeadsView`] reads: query, key, value, and the masks as f32 (the
/// forbidden pairs as 1.0 flags).
struct Readable<B: CpuStorage> {
    query: FloatTensor<B>,
    key: FloatTensor<B>,
    value: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    forbid: Option<FloatTensor<B>>,
    /// `[1, 1, 1, n_heads]`
    sinks: Option<FloatTensor<B>>,
}

impl<B: CpuStorage> Readable<B> {
    /// `None` for a dtype this kernel does not take.
    fn of(inputs: &FlashInputs<B>) -> Option<Self> {
        let bias = match &inputs.bias {
            Some(bias) => Some(B::readable(bias)?),
            None => None,
        };
        let forbid = match &inputs.forbid {
            Some(forbid) => Some(B::readable(&B::bool_into_float(
                forbid.clone(),
                DType::F32.into(),
            ))?),
            None => None,
        };
        let sinks = match &inputs.sinks {
            Some(sinks) => {
                let heads = sinks.shape()[0];
                let row = B::float_reshape(sinks.clone(), Shape::new([1, 1, 1, heads]));
                Some(B::readable(&row)?)
            }
            None => None,
        };
        Some(Self {
            query: B::readable(&inputs.query)?,
            key: B::readable(&inputs.key)?,
            value: B::readable(&inputs.value)?,
            bias,
            forbid,
            sinks,
        })
    }
}

/// One call's inputs as views, and what it computes with them.
struct Kernel<'a> {
    geometry: Geometry,
    params: &'a FlashParams,
    query: HeadsView<'a>,
    key: HeadsView<'a>,
    value: HeadsView<'a>,
    bias: Option<BroadcastView<'a>>,
    forbid: Option<BroadcastView<'a>>,
    /// One logit per query head.
    sinks: Option<&'a [f32]>,
    /// Per batch element, the keys between its first and last unpadded one (key padding).
    padding_spans: Option<Vec<Range<usize>>>,
}

/// A key/value head's keys and values as `[dim, seq_k]` matrices: the right-hand factors of
/// `Q Kᵀ` and `dO Vᵀ`.
#[derive(Clone, Copy)]
struct TransposedHead<'t> {
    key: Matrix<'t>,
    value: Matrix<'t>,
}

/// The fewest queries for which a head's keys and values are transposed once
/// ([`transposed_copy`]) rather than read in place.
const MIN_QUERIES_TO_TRANSPOSE: usize = 16;

/// The fewest multiply-adds (scores times the head widths) for which a call is spread over
/// rayon's threads: a decoding step is not worth waking them.
const PARALLEL_WORK: usize = 1 << 22;

impl<'a> Kernel<'a> {
    /// `None` when a tensor is not in a layout the views read.
    fn new<B: CpuStorage>(
        readable: &'a Readable<B>,
        geometry: Geometry,
        params: &'a FlashParams,
    ) -> Option<Self> {
        let full = [
            geometry.batch,
            geometry.n_heads,
            geometry.seq_q,
            geometry.seq_k,
        ];
        let sinks = match &readable.sinks {
            Some(sinks) => Some(B::heads_view(sinks)?.row(HeadIndex { batch: 0, head: 0 }, 0)),
            None => None,
        };
        let broadcast = |mask: &'a FloatTensor<B>| -> Option<BroadcastView<'a>> {
            Some(BroadcastView::new(B::strided(mask)?, rank_4(mask), full))
        };
        let forbid = match &readable.forbid {
            Some(forbid) => Some(broadcast(forbid)?),
            None => None,
        };
        let padding_spans = forbid.as_ref().and_then(|forbid| {
            (0..geometry.batch)
                .map(|batch| {
                    let row = forbid.row_shared_by_heads_and_rows(batch)?;
                    Some(allowed_key_span(row, geometry.seq_k))
                })
                .collect::<Option<Vec<_>>>()
        });
        Some(Self {
            geometry,
            params,
            query: B::heads_view(&readable.query)?,
            key: B::heads_view(&readable.key)?,
            value: B::heads_view(&readable.value)?,
            bias: match &readable.bias {
                Some(bias) => Some(broadcast(bias)?),
                None => None,
            },
            forbid,
            sinks,
            padding_spans,
        })
    }

    /// Whether the call is worth rayon's threads: a decoding step (one query) is not.
    fn threads(&self) -> Threads {
        let g = &self.geometry;
        let work = g.score_elements() * (g.head_dim + g.value_dim);
        if g.batch * g.n_heads > 1 && work >= PARALLEL_WORK {
            Threads::Pool
        } else {
            Threads::One
        }
    }

    /// The query blocks, in order.
    fn query_blocks(&self) -> impl Iterator<Item = Range<usize>> + use<> {
        let (seq_q, block) = (self.geometry.seq_q, self.params.blocks.query);
        (0..seq_q)
            .step_by(block)
            .map(move |start| start..(start + block).min(seq_q))
    }

    /// Every key a query of block `queries` of batch element `batch` may see lies in the
    /// returned range.
    fn key_range(&self, batch: usize, queries: &Range<usize>) -> Range<usize> {
        let range = self
            .params
            .rules
            .key_range(batch, queries.clone(), self.geometry.seq_k);
        match &self.padding_spans {
            Some(spans) => {
                let span = &spans[batch];
                let (start, end) = (range.start.max(span.start), range.end.min(span.end));
                if start < end { start..end } else { 0..0 }
            }
            None => range,
        }
    }

    /// Key/value head `kv_head`'s keys and values as `[dim, seq_k]`: copied
    /// ([`transposed_copy`]) when the backward reads them for more than one score block (the
    /// query blocks of every query head of the group) of at least [`MIN_QUERIES_TO_TRANSPOSE`]
    /// queries, their strided views otherwise (a copy would cost what the one packing saves,
    /// and `gemm` reads a factor of a few rows in place, without packing it: a decoding step
    /// with one query per head took 5.7 ms at 16384 cached positions with the copy, against
    /// 1.7 ms without). `transposed_value` is `None` where only the keys are needed.
    ///
    /// The forward makes the same choice although it reads a copy for one query head only:
    /// `gemm` may round a score differently from the two layouts (another kernel, FMA or not),
    /// and the backward's recomputed probabilities must be the forward's to the last bit, or a
    /// saturated row's gradient stops being exactly zero.
    fn transposed_head<'t>(
        &'t self,
        transposed_key: &'t mut Vec<f32>,
        transposed_value: Option<&'t mut Vec<f32>>,
        kv_head: HeadIndex,
    ) -> TransposedHead<'t> {
        let [key, value] = [&self.key, &self.value].map(|view| view.head(kv_head));
        if !self.copies_heads() {
            return TransposedHead {
                key: key.transposed(),
                value: value.transposed(),
            };
        }
        TransposedHead {
            key: transposed_copy(transposed_key, key),
            value: match transposed_value {
                Some(buffer) => transposed_copy(buffer, value),
                None => value.transposed(),
            },
        }
    }

    /// Whether a key/value head is read for more than one score block (the query blocks of
    /// every query head of its group) of at least [`MIN_QUERIES_TO_TRANSPOSE`] queries, which
    /// pays for copying it once ([`Kernel::transposed_head`], [`Kernel::dense_rows`]).
    fn copies_heads(&self) -> bool {
        self.geometry.groups() * self.query_blocks().count() > 1
            && self.geometry.seq_q >= MIN_QUERIES_TO_TRANSPOSE
    }

    /// Whether the forward serves a key/value head's query heads together
    /// ([`Kernel::forward_group`]): under grouped-query attention when each head's keys and
    /// values are read in place ([`Kernel::copies_heads`] false: fewer than
    /// [`MIN_QUERIES_TO_TRANSPOSE`] queries, a decoding step).
    fn reads_values_once_per_group(&self) -> bool {
        self.geometry.groups() > 1 && !self.copies_heads()
    }

    /// `head` (a key or value head) as dense rows in `buffer` ([`dense_copy`]) when
    /// [`Kernel::copies_heads`], else as it is.
    fn dense_rows<'t>(&self, buffer: &'t mut Vec<f32>, head: Matrix<'t>) -> Matrix<'t> {
        if self.copies_heads() {
            dense_copy(buffer, head)
        } else {
            head
        }
    }
}

/// For a key padding row (1.0 for a hidden key), the keys between its first and last allowed
/// one (`0..0` when it allows none): every key outside is hidden from every query, so a kernel
/// may skip it.
fn allowed_key_span(row: StridedRow, seq_k: usize) -> Range<usize> {
    let allowed = |key: &usize| row.get(*key) == 0.0;
    let Some(first) = (0..seq_k).find(allowed) else {
        return 0..0;
    };
    let last = (0..seq_k).rev().find(allowed).unwrap_or(first);
    first..last + 1
}
