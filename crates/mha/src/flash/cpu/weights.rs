//! The forward that writes the attention weights `[batch, n_heads, seq_q, seq_k]` too, for
//! inference: each query block's probabilities go into the weights as they are found, with no
//! second pass over the scores.

use std::ops::Range;

use burn::backend::tensor::FloatTensor;

use super::forward::{HeadRows, Weights, forward_writing};
use crate::cpu::simd;
use crate::cpu::storage::CpuStorage;
use crate::execution::FreshOutputs;
use crate::flash::inputs::FlashInputs;
use crate::geometry::Geometry;

/// The output and the attention weights, zero for hidden keys; `None` for inputs the kernel
/// does not take.
///
/// # Panics
///
/// If the inputs' shapes do not fit together ([`FlashInputs::geometry`]).
pub(in crate::flash) fn forward_with_weights<B: CpuStorage>(
    inputs: &FlashInputs<B>,
) -> Option<(FloatTensor<B>, FloatTensor<B>)> {
    let (forward, weights) = forward_writing::<B>(inputs, Weights::Written)?;
    let geometry = inputs.geometry();
    let weights = weights.expect("the weights were asked for");
    Some((forward.output, B::contiguous(weights, shape(&geometry))))
}

/// `[batch, n_heads, seq_q, seq_k]`
fn shape(geometry: &Geometry) -> [usize; 4] {
    [
        geometry.batch,
        geometry.n_heads,
        geometry.seq_q,
        geometry.seq_k,
    ]
}

/// A buffer for the weights of a call, every element of which the forward writes.
pub(super) fn buffer<B: CpuStorage>(geometry: &Geometry, fresh: FreshOutputs) -> Vec<f32> {
    B::output_buffer(shape(geometry).iter().product(), fresh)
}

/// Each head's rows of the softmax statistics (`[batch, n_heads, seq_q, 2]`) and of the weights
/// when there are any, in head order.
pub(super) fn per_head<'s>(
    softmax_stats: &'s mut [f32],
    weights: Option<&'s mut [f32]>,
    geometry: &Geometry,
) -> Vec<HeadRows<'s>> {
    let heads = geometry.batch * geometry.n_heads;
    let head_weights: Vec<Option<&mut [f32]>> = match weights {
        Some(weights) if !weights.is_empty() => weights
            .chunks_mut(geometry.seq_q * geometry.seq_k)
            .map(Some)
            .collect(),
        _ => (0..heads).map(|_| None).collect(),
    };
    softmax_stats
        .chunks_mut(geometry.seq_q * 2)
        .zip(head_weights)
        .map(|(stats, weights)| HeadRows { stats, weights })
        .collect()
}

/// A query block's softmax numerators over keys `keys` (`[queries, keys.len()]`) and the
/// inverse of each row's sum.
pub(super) struct BlockNumerators<'a> {
    pub values: &'a [f32],
    pub keys: &'a Range<usize>,
    pub inverse_sums: &'a [f32],
}

/// Writes one query block's weight rows (`[queries, seq_k]` flattened): zeros outside the
/// block's keys, each numerator times its row's inverse sum inside.
pub(super) fn write_block(weights: &mut [f32], seq_k: usize, block: BlockNumerators) {
    let BlockNumerators {
        values,
        keys,
        inverse_sums,
    } = block;
    for ((weights_row, numerators), inverse_sum) in weights
        .chunks_exact_mut(seq_k)
        .zip(values.chunks_exact(keys.len()))
        .zip(inverse_sums)
    {
        weights_row[..keys.start].fill(0.0);
        weights_row[keys.end..].fill(0.0);
        simd::scaled_copy(&mut weights_row[keys.clone()], numerators, *inverse_sum);
    }
}
