//! A block of scores, `cap(scale · Q Kᵀ) + biases` with the hidden keys at `-inf`: the one
//! computation the forward and the backward share, so that the backward's recomputed
//! probabilities are the forward's to the bit.

use std::ops::Range;

use super::Kernel;
use crate::cpu::matrix::{BroadcastRow, HeadIndex, Matrix, MatrixMut, Write, gemm, grown};
use crate::cpu::simd;

/// Which scores a [`Kernel::score_block`] computes: queries `queries` of head `head` over keys
/// `keys`, with `key_t` the head's keys as `[head_dim, seq_k]`.
pub(super) struct ScoreBlock<'k> {
    pub head: HeadIndex,
    pub queries: Range<usize>,
    pub keys: Range<usize>,
    pub key_t: Matrix<'k>,
}

impl Kernel<'_> {
    /// The `[queries.len(), keys.len()]` score block `block` in `scores`:
    /// `cap(scale · Q Kᵀ) + bias`, hidden keys at `-inf`. Under a soft cap, `cap_derivatives`
    /// (if given) ← `1 - tanh²` of the same block.
    pub(super) fn score_block<'s>(
        &self,
        scores: &'s mut Vec<f32>,
        cap_derivatives: Option<&mut Vec<f32>>,
        block: &ScoreBlock,
    ) -> &'s mut [f32] {
        let ScoreBlock {
            head,
            queries,
            keys,
            key_t,
        } = block;
        let (rows, width) = (queries.len(), keys.len());
        let scores = grown(scores, rows * width);
        let query = self.query.head(*head).rows(queries.start, rows);
        let mut dst = MatrixMut::dense(scores, rows, width);
        gemm(
            &mut dst,
            Write::Overwrite,
            query,
            key_t.columns(keys.start, width),
            self.params.scale as f32,
        );
        if let Some(cap) = self.params.softcap {
            soft_cap(scores, cap as f32, cap_derivatives);
        }
        for (row, row_scores) in scores.chunks_exact_mut(width).enumerate() {
            self.mask_row(row_scores, *head, queries.start + row, keys);
        }
        scores
    }

    /// Adds the biases (the caller's, ALiBi) to one query's scores over keys `keys`, then hides
    /// the keys its masks and the rules forbid. Hiding replaces the score, so that a forbidden
    /// key drops out whatever its score.
    fn mask_row(&self, scores: &mut [f32], head: HeadIndex, query: usize, keys: &Range<usize>) {
        if let Some(bias) = &self.bias {
            match bias.row(head, query, keys) {
                BroadcastRow::Scalar(value) => scores.iter_mut().for_each(|s| *s += value),
                BroadcastRow::Values(row) => {
                    scores.iter_mut().zip(row).for_each(|(s, v)| *s += v);
                }
            }
        }
        let rules = &self.params.rules;
        if let Some(slopes) = &rules.alibi {
            for (run, distance) in rules.distance_runs(query, keys) {
                simd::add_distance_penalty(
                    &mut scores[run.start - keys.start..run.end - keys.start],
                    distance as f32,
                    -slopes[head.head],
                );
            }
        }
        if let Some(forbid) = &self.forbid {
            match forbid.row(head, query, keys) {
                BroadcastRow::Scalar(flag) if flag != 0.0 => scores.fill(f32::NEG_INFINITY),
                BroadcastRow::Scalar(_) => {}
                BroadcastRow::Values(flags) => {
                    for (score, &flag) in scores.iter_mut().zip(flags) {
                        if flag != 0.0 {
                            *score = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
        if rules.hides_keys() {
            self.hide_by_rules(scores, head.batch, query, keys);
        }
    }

    /// Hides the positional keys among `keys` that the rules (causal masking, the window,
    /// segments) hide from `query` of batch element `batch`.
    fn hide_by_rules(&self, scores: &mut [f32], batch: usize, query: usize, keys: &Range<usize>) {
        let rules = &self.params.rules;
        let positional = keys
            .end
            .min(rules.positional_keys)
            .saturating_sub(keys.start);
        match rules.contiguous_range(batch, query) {
            Some(visible) => {
                // Hide the positional keys of the block outside `visible`.
                let local =
                    |key: usize| key.clamp(keys.start, keys.start + positional) - keys.start;
                let (lo, hi) = (
                    local(visible.start),
                    local(visible.end).max(local(visible.start)),
                );
                scores[..lo].fill(f32::NEG_INFINITY);
                scores[hi..positional].fill(f32::NEG_INFINITY);
            }
            None => {
                for (score, key) in scores[..positional].iter_mut().zip(keys.clone()) {
                    if !rules.visible(batch, query, key) {
                        *score = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
}

/// Scores ← `cap · tanh(score / cap)`, and `derivatives` (if given) ← `1 - tanh²` of each.
fn soft_cap(scores: &mut [f32], cap: f32, derivatives: Option<&mut Vec<f32>>) {
    match derivatives {
        Some(derivatives) => {
            derivatives.clear();
            derivatives.resize(scores.len(), 0.0);
            simd::soft_cap_with_derivatives(scores, derivatives, cap);
        }
        None => simd::soft_cap(scores, cap),
    }
}
