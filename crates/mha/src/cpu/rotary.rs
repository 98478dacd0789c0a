//! RoPE's rotation of query and key heads as one op on the CPU backends' f32 storage, with an
//! autodiff node whose backward is the inverse rotation.
//!
//! Why: through tensor ops a rotation is about ten of them (the pairs narrowed, four products, a
//! difference, a sum, their concatenation), each a fresh output, with strided copies of the
//! sequence-major heads the projections give: a module with RoPE spent more time rotating than
//! attending (flex, (4, 512, 512, 8): forward 38 against 16 ms with this op), and a decoding step
//! of a few rows paid ten ops of fixed cost. Here each row is read once and its rotation written
//! once, sequence-major (docs/performance-notes.md).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, backend_extension};
use burn::tensor::{DType, Tensor};
use rayon::prelude::*;

use super::matrix::{HeadIndex, Matrix};
use super::storage::{CpuStorage, native_storage};
use crate::execution::FreshOutputs;
use crate::rotary::Rotation;

/// Backends with the rotation op: the CPU backends whose f32 storage it reads, and autodiff
/// over them.
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray"),
    Autodiff
)]
pub(crate) trait RotaryBackend: Backend {
    /// `x` with each pair of features of row `r` turned by the angle of table row
    /// `rotation.rows[r]`.
    ///
    /// # Shapes
    ///
    /// - x: `[batch, heads, rows, head_dim]`, f32
    /// - output: `[batch, heads, rows, head_dim]`, stored sequence-major (`[batch, rows, heads,
    ///   head_dim]` in memory)
    ///
    /// # Panics
    ///
    /// If `head_dim` is odd, or `rotation` does not name a row of its tables for each row.
    fn rotate(x: FloatTensor<Self>, rotation: Rotation) -> FloatTensor<Self>;
}

macro_rules! native_rotary_backend {
    ($backend:ty) => {
        impl RotaryBackend for $backend {
            fn rotate(x: FloatTensor<Self>, rotation: Rotation) -> FloatTensor<Self> {
                rotated::<Self>(&x, &rotation)
            }
        }
    };
}

#[cfg(feature = "flex")]
native_rotary_backend!(burn::backend::Flex);
#[cfg(feature = "ndarray")]
native_rotary_backend!(burn::backend::NdArray);

/// `x` rotated as `rotation` says where the op runs natively (an f32 tensor on flex or
/// ndarray, with or without autodiff); `None` elsewhere, for the tensor ops.
pub(crate) fn native_rotation(
    x: &Tensor<4>,
    rotation: impl FnOnce() -> Rotation,
) -> Option<Tensor<4>> {
    if !native_storage(&x.device()) || x.dtype() != DType::F32 {
        return None;
    }
    let output = <Dispatch as RotaryBackend>::rotate(x.clone().into_dispatch(), rotation());
    Some(Tensor::from_dispatch(output))
}

/// Rotations of at least this many elements go to rayon's threads: below it (a decoding
/// step's rows), waking the workers costs more than the pass.
const PARALLEL_ELEMENTS: usize = 1 << 18;

/// [`RotaryBackend::rotate`] on a CPU backend's storage.
///
/// # Panics
///
/// If `x` is not f32, its `head_dim` is odd, `rotation` does not name a table row per row of
/// `x`, or a named row lies outside the tables.
fn rotated<B: CpuStorage>(x: &FloatTensor<B>, rotation: &Rotation) -> FloatTensor<B> {
    let readable = B::readable(x).expect("RoPE: an f32 tensor");
    let view = B::heads_view(&readable).expect("RoPE: a readable layout");
    let [batch, heads, rows, head_dim] = view.shape();
    let half = head_dim / 2;
    let table_rows = rotation.cos.len() / half.max(1);
    assert!(
        head_dim.is_multiple_of(2)
            && rotation.rows.len() == rows
            && rotation.cos.len() == rotation.sin.len()
            && rotation.cos.len() == table_rows * half
            && rotation.rows.iter().all(|&row| row < table_rows),
        "RoPE: {} table rows of {} pairs ({} cos, {} sin values) cannot rotate heads {:?} \
         (an even head_dim, a table row per row)",
        rotation.rows.len(),
        half,
        rotation.cos.len(),
        rotation.sin.len(),
        view.shape()
    );
    let width = heads * head_dim;
    let mut output = B::output_buffer(batch * rows * width, FreshOutputs::Unspecified);
    // One `[heads, head_dim]` row of the output per (batch, row), each written whole.
    let rotate_row = |(index, out): (usize, &mut [f32])| {
        let (batch, row) = (index / rows.max(1), index % rows.max(1));
        let table_row = rotation.rows[row];
        let angles = PairAngles {
            cos: &rotation.cos[table_row * half..][..half],
            sin: &rotation.sin[table_row * half..][..half],
            sign: if rotation.inverse { -1.0 } else { 1.0 },
        };
        for (head, out) in out.chunks_exact_mut(head_dim).enumerate() {
            let matrix = view.head(HeadIndex { batch, head });
            rotate_pairs(out, matrix, row, &angles, rotation.layout);
        }
    };
    if width > 0 && output.len() >= PARALLEL_ELEMENTS {
        output
            .par_chunks_mut(width)
            .enumerate()
            .for_each(rotate_row);
    } else if width > 0 {
        output.chunks_mut(width).enumerate().for_each(rotate_row);
    }
    B::sequence_major(output, [batch, heads, rows, head_dim])
}

/// One row's angle per pair of features, turned the other way where `sign` is -1.
struct PairAngles<'a> {
    cos: &'a [f32],
    sin: &'a [f32],
    sign: f32,
}

/// Row `row` of `matrix` (`[rows, head_dim]`) rotated into `out`: each pair `(a, b)` becomes
/// `(a·cos - b·sin, b·cos + a·sin)`, each product rounded before the sum, as the tensor ops
/// compute it.
fn rotate_pairs(
    out: &mut [f32],
    matrix: Matrix,
    row: usize,
    angles: &PairAngles,
    layout: crate::rotary::RopeLayout,
) {
    let mut scratch = Vec::new();
    let input = matrix.row_or_copy(row, &mut scratch);
    let turn = |a: f32, b: f32, cos: f32, sin: f32| {
        let sin = angles.sign * sin;
        (a * cos - b * sin, b * cos + a * sin)
    };
    let pairs = angles.cos.iter().zip(angles.sin);
    match layout {
        crate::rotary::RopeLayout::Interleaved => {
            let rows = out.chunks_exact_mut(2).zip(input.chunks_exact(2));
            for ((out, pair), (&cos, &sin)) in rows.zip(pairs) {
                (out[0], out[1]) = turn(pair[0], pair[1], cos, sin);
            }
        }
        crate::rotary::RopeLayout::HalfSplit => {
            let half = out.len() / 2;
            let (out_first, out_second) = out.split_at_mut(half);
            let (first, second) = input.split_at(half);
            for pair in 0..half {
                (out_first[pair], out_second[pair]) = turn(
                    first[pair],
                    second[pair],
                    angles.cos[pair],
                    angles.sin[pair],
                );
            }
        }
    }
}

/// Under autodiff the rotation's backward is the inverse rotation of the output's gradient.
impl<B: RotaryBackend, C: CheckpointStrategy> RotaryBackend for Autodiff<B, C> {
    fn rotate(x: FloatTensor<Self>, rotation: Rotation) -> FloatTensor<Self> {
        match RotaryBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let output = B::rotate(x.into_primitive(), rotation.clone());
                prep.finish(rotation, output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::rotate(x.into_primitive(), rotation)),
        }
    }
}

/// The rotation's autodiff node: one parent, the rotated heads.
#[derive(Debug)]
struct RotaryBackward;

impl<B: RotaryBackend> Backward<B, 1> for RotaryBackward {
    type State = Rotation;

    /// `dx = R(-θ) · dY`: a rotation's transpose is its inverse.
    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let output_grad = grads.consume::<B>(&ops.node);
        let [parent] = ops.parents;
        if let Some(parent) = parent {
            grads.register::<B>(parent.id, B::rotate(output_grad, ops.state.inverted()));
        }
    }
}
