//! What a flash call takes, keeps and returns on the backend that computes it, and the checks
//! that every body runs at entry, so that no caller can drive a kernel out of bounds.

use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{Backend, TensorMetadata};

use crate::execution::Execution;
use crate::geometry::Geometry;
use crate::input::BlockSizes;
use crate::rules::ScoreRules;

/// What one flash-attention call computes besides `q`, `k`, `v` and the masks, and how.
#[derive(Debug, Clone, PartialEq)]
pub struct FlashParams {
    /// Multiplies `q kᵀ`.
    pub scale: f64,
    /// Scores become `softcap · tanh(score / softcap)` after scaling, before biases and masks.
    pub softcap: Option<f64>,
    /// Causal masking, a window, segments, ALiBi: applied by the kernel to each block.
    pub(crate) rules: ScoreRules,
    /// Query and key block sizes.
    pub blocks: BlockSizes,
    /// Which body computes the call, and what it tells a probe.
    pub(crate) execution: Execution,
}

/// The op's inputs on the backend that computes it.
#[derive(Debug, Clone)]
pub(crate) struct FlashInputs<B: Backend> {
    pub query: FloatTensor<B>,
    pub key: FloatTensor<B>,
    pub value: FloatTensor<B>,
    pub bias: Option<FloatTensor<B>>,
    pub forbid: Option<BoolTensor<B>>,
    /// `[n_heads]`
    pub sinks: Option<FloatTensor<B>>,
    pub params: FlashParams,
}

impl<B: Backend> FlashInputs<B> {
    /// The call's sizes, after checking that query, key and value fit together, that the masks
    /// broadcast to `[batch, n_heads, seq_q, seq_k]`, and that the sinks, block sizes and rules
    /// fit the call.
    ///
    /// # Panics
    ///
    /// If they do not.
    pub fn geometry(&self) -> Geometry {
        let geometry = Geometry::of_heads(
            dims(&self.query.shape()),
            dims(&self.key.shape()),
            dims(&self.value.shape()),
        );
        let full = [
            geometry.batch,
            geometry.n_heads,
            geometry.seq_q,
            geometry.seq_k,
        ];
        let masks = [
            ("bias", self.bias.as_ref().map(|bias| bias.shape())),
            ("forbid", self.forbid.as_ref().map(|forbid| forbid.shape())),
        ];
        for (name, shape) in masks {
            if let Some(shape) = shape {
                let shape = dims(&shape);
                assert!(
                    (0..4).all(|axis| shape[axis] == full[axis] || shape[axis] == 1),
                    "flash attention: `{name}` {shape:?} does not broadcast to the scores {full:?}"
                );
            }
        }
        assert!(
            self.params.blocks.query > 0 && self.params.blocks.key > 0,
            "flash attention: block sizes must be positive, got {:?}",
            self.params.blocks
        );
        if let Some(sinks) = &self.sinks {
            let shape = sinks.shape();
            assert!(
                shape.num_dims() == 1 && shape[0] == geometry.n_heads,
                "flash attention: one sink logit per query head, got sinks {shape:?}"
            );
        }
        assert!(
            self.params.rules.fit(&geometry),
            "flash attention: the rules do not fit the call"
        );
        geometry
    }
}

/// The four sizes of a rank-4 shape.
///
/// # Panics
///
/// If the shape does not have rank 4.
pub(crate) fn dims(shape: &burn::backend::Shape) -> [usize; 4] {
    assert_eq!(
        shape.num_dims(),
        4,
        "flash attention: tensors must have rank 4, got shape {shape:?}"
    );
    [shape[0], shape[1], shape[2], shape[3]]
}

/// A forward's results.
pub(crate) struct FlashForward<B: Backend> {
    /// `[batch, n_heads, seq_q, value_dim]`
    pub output: FloatTensor<B>,
    /// `[batch, n_heads, seq_q, 2]`: each query's score maximum `m` and `1 / Σ_k exp(s_k - m)`,
    /// from which the backward recomputes `P = exp(S - m) / Σ`. A query with no allowed key
    /// has the lowest finite `m` and 0, which make every recomputed probability 0.
    ///
    /// (Not FlashAttention's single log-sum-exp `m + ln Σ`: rounded to f32 it carries an
    /// absolute error of an ulp of `m`, which `exp(S - lse)` turns into a relative error of
    /// `|m| · 6e-8` in every probability, 6e-5 at scores of 1000; the pair keeps the
    /// recomputed probabilities as exact as the explicit path's.)
    pub softmax_stats: FloatTensor<B>,
}

/// What the backward pass keeps: the inputs, the output and the softmax statistics, `O(seq)`
/// each.
#[derive(Debug, Clone)]
pub(crate) struct FlashState<B: Backend> {
    pub inputs: FlashInputs<B>,
    pub output: FloatTensor<B>,
    pub softmax_stats: FloatTensor<B>,
}

impl<B: Backend> FlashState<B> {
    /// # Panics
    ///
    /// If `output_grad` does not have the output's shape, or the saved statistics are not two
    /// values per query.
    pub fn check_output_grad(&self, output_grad: &FloatTensor<B>) {
        let output = dims(&self.output.shape());
        let [batch, heads, seq_q, _] = output;
        assert_eq!(
            dims(&output_grad.shape()),
            output,
            "flash attention: the output gradient must have the output's shape"
        );
        assert_eq!(
            dims(&self.softmax_stats.shape()),
            [batch, heads, seq_q, 2],
            "flash attention: two softmax statistics per query"
        );
    }
}

/// A backward's results.
pub(crate) struct FlashGrads<B: Backend> {
    pub query: FloatTensor<B>,
    pub key: FloatTensor<B>,
    pub value: FloatTensor<B>,
    /// `[n_heads]`, when the call had sinks.
    pub sinks: Option<FloatTensor<B>>,
}
