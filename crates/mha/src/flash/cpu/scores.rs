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

/// The most query rows a score block computes against the keys read row by row where they
/// lie ([`simd::key_dots`]) rather than through `gemm`: a decoding step's (one query per head)
/// and short continuations. Steps of a `KvCache` of 1, 2, 4 and 8 rows at 16384 positions
/// (d_model 512, 8 query / 2 key-value heads, Intel Xeon, 2 cores; a loop of 100-300
/// `forward_cached` steps, docs/performance-notes.md) took 0.5-0.7x, 0.4-0.5x, 0.6-0.75x and
/// 0.6-0.8x `gemm`'s time, the group's heads reading the keys together; from 12 rows on the
/// two were within noise.
const FEW_QUERY_ROWS: usize = 8;

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
        let scores = self.scaled_dots(scores, block);
        self.finish_scores(scores, cap_derivatives, block);
        scores
    }

    /// `scale · Q Kᵀ` of `block` in `scores`, before the soft cap, biases and masks
    /// ([`Kernel::finish_scores`]).
    fn scaled_dots<'s>(&self, scores: &'s mut Vec<f32>, block: &ScoreBlock) -> &'s mut [f32] {
        let ScoreBlock {
            head,
            queries,
            keys,
            key_t,
        } = block;
        let (rows, width) = (queries.len(), keys.len());
        if self.dots_in_place(
            &[*head],
            queries,
            keys,
            *key_t,
            std::iter::once(&mut *scores),
        ) {
            return &mut scores[..rows * width];
        }
        let scores = grown(scores, rows * width);
        let mut dst = MatrixMut::dense(scores, rows, width);
        gemm(
            &mut dst,
            Write::Overwrite,
            self.query.head(*head).rows(queries.start, rows),
            key_t.columns(keys.start, width),
            self.params.scale as f32,
        );
        scores
    }

    /// `scale · Q Kᵀ` of query block `queries` of each of `heads` (query heads of one
    /// key/value head) over `keys`, head `h`'s in the `h`-th of `outputs` (grown to
    /// `queries.len() · keys.len()`), in one pass over the keys through [`simd::key_dots`],
    /// where the block reads them in place ([`key_rows`]); false, nothing written, elsewhere.
    /// Each score is computed the same way whatever the other heads.
    pub(super) fn dots_in_place<'s>(
        &self,
        heads: &[HeadIndex],
        queries: &Range<usize>,
        keys: &Range<usize>,
        key_t: Matrix,
        outputs: impl Iterator<Item = &'s mut Vec<f32>>,
    ) -> bool {
        let (rows, width) = (queries.len(), keys.len());
        let head_rows = |head: HeadIndex| self.query.head(head).rows(queries.start, rows);
        let Some(&first) = heads.first() else {
            return false;
        };
        let Some(key_rows) = key_rows(head_rows(first), key_t.columns(keys.start, width)) else {
            return false;
        };
        let query_rows: Vec<&[f32]> = heads
            .iter()
            .flat_map(|&head| {
                let query = head_rows(head);
                (0..rows).map(move |row| query.row(row))
            })
            .collect();
        let mut score_rows: Vec<&mut [f32]> = outputs
            .flat_map(|output| grown(output, rows * width).chunks_exact_mut(width))
            .collect();
        simd::key_dots(
            &mut score_rows,
            &query_rows,
            key_rows.values,
            key_rows.row_stride,
            width,
            self.params.scale as f32,
        );
        true
    }

    /// The soft cap, the biases and the masks on a block of `scale · Q Kᵀ`
    /// ([`Kernel::scaled_dots`]).
    pub(super) fn finish_scores(
        &self,
        scores: &mut [f32],
        cap_derivatives: Option<&mut Vec<f32>>,
        block: &ScoreBlock,
    ) {
        let width = block.keys.len();
        if let Some(cap) = self.params.softcap {
            soft_cap(scores, cap as f32, cap_derivatives);
        }
        for (row, row_scores) in scores.chunks_exact_mut(width).enumerate() {
            self.mask_row(
                row_scores,
                block.head,
                block.queries.start + row,
                &block.keys,
            );
        }
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

/// The keys of `key_block` (`[head_dim, keys]`) as rows, where the query rows `query` read them
/// in place through [`simd::key_dots`]: at most [`FEW_QUERY_ROWS`] rows (at least one) with
/// adjacent features, each key's features adjacent (a head read where it lies, not its
/// transposed copy), and a head width this CPU's copy takes. Whether they do depends on the
/// block's shape and the heads' layouts alone, which the forward and the backward share, so
/// that both compute a score the same way.
fn key_rows<'k>(query: Matrix, key_block: Matrix<'k>) -> Option<Matrix<'k>> {
    let key_rows = key_block.transposed();
    let in_place = (1..=FEW_QUERY_ROWS).contains(&query.rows)
        && key_rows.rows > 0
        && key_rows.column_stride == 1
        && query.column_stride == 1
        && simd::key_dots_take(key_rows.columns);
    in_place.then_some(key_rows)
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
