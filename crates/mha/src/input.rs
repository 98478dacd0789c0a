//! What a [`MultiHeadAttention`](crate::MultiHeadAttention) forward takes and returns.

use burn::tensor::{Bool, Int, Tensor};

use crate::cache::picked;

/// Which attention weights a forward returns (PyTorch's `need_weights` and
/// `average_attn_weights`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum NeedWeights {
    /// No weights (the default, unlike PyTorch's): the forward may use a kernel that never
    /// materialises them.
    #[default]
    No,
    /// Weights per head, `[batch, n_heads, seq_q, seq_k]`.
    PerHead,
    /// Weights averaged over heads, `[batch, seq_q, seq_k]` (PyTorch's
    /// `average_attn_weights=True`).
    Averaged,
}

/// Which implementation computes `softmax(q kᵀ · scale + bias) v`. Every path computes the same
/// numbers (to float rounding); they differ in speed, memory and what else they can do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AttentionPath {
    /// Let the module choose (the default), in this order:
    ///
    /// 1. **Explicit** when dropout is active (training mode on an autodiff device), or when
    ///    the weights are requested on an autodiff device (they take part in the gradient there):
    ///    only the explicit path can do those.
    /// 2. **Flash** where it runs natively (flex and ndarray, with this crate's features of
    ///    those names), for inference and training, unless a float attention mask requires a
    ///    gradient (the flash op treats masks as constants). It is the fastest path at every size
    ///    measured there, keeps training memory `O(seq)`, and for inference writes the weights
    ///    when they are requested, as it finds each block's probabilities. Blocks of 256
    ///    queries when every query sees 2048 keys or more (no causal masking, window or
    ///    segments), the [`BlockSizes`] default otherwise.
    /// 3. **Flash** on an autodiff device of the other backends it runs on (the CubeCL ones, see
    ///    [`flash_attention_supported`](crate::flash_attention_supported); native CubeCL
    ///    kernels there), under the same condition, where the device has no tensor cores (the
    ///    kernels are FMA tiles; on lavapipe they trained 1.1-1.7x faster than the explicit
    ///    path from 128 to 2048 tokens, in 1/7 to 1/12 of the memory) or where the explicit
    ///    path's four `[batch, n_heads, seq_q, seq_k]` f32 tensors would take more than half of
    ///    the device's memory (16 GiB assumed where it does not say). On tensor cores below
    ///    that, Burn's matmuls have hardware the kernels do not use: **Explicit** until a GPU
    ///    measures otherwise.
    /// 4. Elsewhere, on an autodiff device: **Explicit** (Burn's autodiff runs its fused op as a
    ///    decomposed fallback that is slower than the explicit path).
    /// 5. For inference: **Explicit** when the weights are requested; else **Chunked** above
    ///    [`CHUNKED_THRESHOLD`](crate::CHUNKED_THRESHOLD) score elements on a backend other than flex (whose fused op is tiled already), else
    ///    **Fused** (a single flash kernel on the CubeCL backends), unless the softmax has a
    ///    sink logit (attention sinks, the quiet softmax), which only the other paths take:
    ///    then **Explicit**.
    #[default]
    Auto,
    /// Burn's fused `burn::tensor::module::attention` (flash kernels on flex and CubeCL
    /// backends). Cannot return weights, apply dropout, attention sinks or a quiet softmax.
    Fused,
    /// Scores, softmax and weighted sum as separate tensor operations; materialises the
    /// `[batch, n_heads, seq_q, seq_k]` weights. Can do everything, and is the reference the
    /// other paths are tested against.
    Explicit,
    /// Query blocks × key blocks with an online softmax, in ordinary tensor operations: never
    /// holds more than one block of scores, so inference memory stays bounded at any length
    /// (under autodiff every block is kept for the backward pass). Cannot return weights or
    /// apply dropout.
    Chunked(BlockSizes),
    /// The blocked computation as one autodiff op whose backward recomputes each score block
    /// from the saved softmax statistics (FlashAttention-2): training memory stays `O(seq)`. Runs
    /// on the backends [`flash_attention_supported`](crate::flash_attention_supported) accepts;
    /// a float attention mask gets no gradient through it. Cannot apply dropout; returns
    /// weights for inference only (on a device without autodiff), since they carry no gradient.
    /// See [`BlockSizes`] for how its native CPU kernel reads the sizes.
    Flash(BlockSizes),
}

/// Query and key block sizes of [`AttentionPath::Chunked`] and [`AttentionPath::Flash`].
///
/// The chunked path and the flash op's generic body (backends without a native kernel, and
/// dtypes other than f32) honour both. The native f32 kernel of flex and ndarray honours
/// `query` (rows per block) and takes every visible key of a query block in one pass, since
/// it holds one `query × seq_k` score block per thread rather than the whole score matrix;
/// `key` does not change its result or its speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizes {
    /// Queries per block. Must be positive.
    pub query: usize,
    /// Keys per block. Must be positive.
    pub key: usize,
}

impl Default for BlockSizes {
    /// 128 queries × 1024 keys, what `Auto` gives the flash op, except on the native kernel for
    /// rows of 2048 keys or more that no positional rule shortens (256 queries there; see
    /// [`AttentionPath::Auto`]): on the native kernel 64, 128 and 256 query rows measured within
    /// noise of each other at 512 tokens (`cargo bench --workspace --bench table`).
    fn default() -> Self {
        Self {
            query: 128,
            key: 1024,
        }
    }
}

/// A caller's attention mask in rank-4 form, with the rank it was given in.
#[derive(Debug, Clone)]
pub struct AttnMask {
    pub(crate) rank: usize,
    pub(crate) values: MaskValues,
}

/// The values of an [`AttnMask`], `[batch | 1, n_heads | 1, seq_q, seq_k]`.
#[derive(Debug, Clone)]
pub(crate) enum MaskValues {
    /// `true` marks a query-key pair that must not attend.
    Bool(Tensor<4, Bool>),
    /// Added to the scaled scores; `-inf` forbids the pair.
    Float(Tensor<4>),
}

impl AttnMask {
    /// The mask's key columns `ranges` (start, length), in order.
    pub(crate) fn with_columns(self, ranges: &[(usize, usize)]) -> Self {
        let values = match self.values {
            MaskValues::Bool(mask) => MaskValues::Bool(picked(&mask, 3, ranges)),
            MaskValues::Float(bias) => MaskValues::Float(picked(&bias, 3, ranges)),
        };
        Self { values, ..self }
    }

    pub(crate) fn dims(&self) -> [usize; 4] {
        match &self.values {
            MaskValues::Bool(mask) => mask.dims(),
            MaskValues::Float(bias) => bias.dims(),
        }
    }
}

/// A tensor accepted as an attention mask: `Tensor<D, Bool>` (`true` = may not attend) or a
/// float `Tensor<D>` (added to the scores), with `D` of 2 (`[seq_q, seq_k]`), 3
/// (`[batch, seq_q, seq_k]`) or 4 (`[batch, n_heads, seq_q, seq_k]`).
pub trait IntoAttnMask {
    /// Converts the mask to its rank-4 form (missing leading axes have size 1).
    ///
    /// # Panics
    ///
    /// Panics if the rank is not 2, 3 or 4.
    fn into_attn_mask(self) -> AttnMask;
}

/// The rank-4 shape of a mask of rank `D` (missing leading axes of size 1).
#[track_caller]
fn rank4_dims<const D: usize>(dims: [usize; D]) -> [usize; 4] {
    match D {
        2 => [1, 1, dims[0], dims[1]],
        3 => [dims[0], 1, dims[1], dims[2]],
        4 => [dims[0], dims[1], dims[2], dims[3]],
        _ => panic!(
            "MultiHeadAttention: `attn_mask` must have rank 2 [seq_q, seq_k], 3 [batch, seq_q, seq_k] or 4 \
             [batch, n_heads, seq_q, seq_k], got rank {D} with shape {dims:?}"
        ),
    }
}

impl IntoAttnMask for AttnMask {
    fn into_attn_mask(self) -> AttnMask {
        self
    }
}

impl<const D: usize> IntoAttnMask for Tensor<D, Bool> {
    fn into_attn_mask(self) -> AttnMask {
        let dims = rank4_dims(self.dims());
        // No values to keep where an axis is empty; Burn's `reshape` (and `unsqueeze`, built on
        // it) reads a 0 in the target shape as "keep this axis", which would misplace it.
        let values = if dims.contains(&0) {
            Tensor::zeros(dims, &self.device())
        } else {
            self.reshape(dims)
        };
        AttnMask {
            rank: D,
            values: MaskValues::Bool(values),
        }
    }
}

impl<const D: usize> IntoAttnMask for Tensor<D> {
    fn into_attn_mask(self) -> AttnMask {
        let dims = rank4_dims(self.dims());
        let values = if dims.contains(&0) {
            Tensor::zeros(dims, &self.device())
        } else {
            self.reshape(dims)
        };
        AttnMask {
            rank: D,
            values: MaskValues::Float(values),
        }
    }
}

/// [`MultiHeadAttention`](crate::MultiHeadAttention) forward input: the query, key and value
/// sequences, the masks, and what to return.
///
/// # Mask polarity
///
/// | mask | `true` / value means | as in |
/// |---|---|---|
/// | `key_padding_mask` (bool) | `true` = this key is padding, ignore it | PyTorch `nn.MultiheadAttention` |
/// | `attn_mask` (bool) | `true` = this query may **not** attend to this key | PyTorch `nn.MultiheadAttention`, Burn `MhaInput` |
/// | `attn_mask` (float) | added to the scaled scores (`-inf` = forbidden) | both |
///
/// PyTorch's `F.scaled_dot_product_attention` uses the **opposite** bool polarity
/// (`true` = may attend): invert such a mask with `bool_not()` before passing it here.
#[derive(Debug, Clone)]
pub struct MhaInput {
    pub(crate) query: Tensor<3>,
    pub(crate) key: Tensor<3>,
    pub(crate) value: Tensor<3>,
    pub(crate) key_padding_mask: Option<Tensor<2, Bool>>,
    pub(crate) attn_mask: Option<AttnMask>,
    pub(crate) causal: bool,
    /// Segment ids of the queries, and of the keys when they differ (cross-attention).
    pub(crate) segment_ids: Option<(Tensor<2, Int>, Option<Tensor<2, Int>>)>,
    pub(crate) need_weights: NeedWeights,
    pub(crate) path: AttentionPath,
    /// Made by [`MhaInput::self_attn`]: query, key and value are one tensor, so that their
    /// projections can be one op.
    pub(crate) shared_input: bool,
}

impl MhaInput {
    /// Self-attention: `x` is the query, the key and the value.
    ///
    /// # Shapes
    ///
    /// - x: `[batch, seq, d_model]` (requires `d_key_input == d_value_input == d_model`)
    pub fn self_attn(x: Tensor<3>) -> Self {
        Self {
            shared_input: true,
            ..Self::new(x.clone(), x.clone(), x)
        }
    }

    /// Attention of `query` over the `key`/`value` sequence (cross-attention when they differ).
    ///
    /// # Shapes
    ///
    /// - query: `[batch, seq_q, d_model]`
    /// - key: `[batch, seq_k, d_key_input]`
    /// - value: `[batch, seq_k, d_value_input]`
    pub fn new(query: Tensor<3>, key: Tensor<3>, value: Tensor<3>) -> Self {
        Self {
            query,
            key,
            value,
            key_padding_mask: None,
            attn_mask: None,
            causal: false,
            segment_ids: None,
            need_weights: NeedWeights::No,
            path: AttentionPath::Auto,
            shared_input: false,
        }
    }

    /// Keys to ignore, per batch element: `[batch, seq_k]`, **`true` = padding, ignored**
    /// (PyTorch `nn.MultiheadAttention` polarity).
    pub fn key_padding_mask(mut self, mask: Tensor<2, Bool>) -> Self {
        self.key_padding_mask = Some(mask);
        self
    }

    /// Query-key pairs to forbid (bool, **`true` = may not attend**) or an additive score bias
    /// (float). Shapes: `[seq_q, seq_k]`, `[batch, seq_q, seq_k]` or
    /// `[batch, n_heads, seq_q, seq_k]`.
    pub fn attn_mask(mut self, mask: impl IntoAttnMask) -> Self {
        self.attn_mask = Some(mask.into_attn_mask());
        self
    }

    /// Causal attention without a mask tensor: query `i` attends to keys `j <= i + seq_k -
    /// seq_q`. Aligned at the bottom-right corner when `seq_q != seq_k` (FlashAttention's
    /// convention): the last query sees every key, as a decoder with a cache of past keys
    /// needs. Combines with the other masks.
    pub fn causal(mut self) -> Self {
        self.causal = true;
        self
    }

    /// Packed sequences (several documents in one row): `[batch, seq]` segment ids, one per
    /// position; a query attends only to the keys of its own segment (FlashAttention's varlen
    /// attention, with ids in place of cumulative lengths). Self-attention: the ids serve
    /// queries and keys. With `.causal()`, masking is causal within each segment. Ids that never
    /// decrease along a row (documents one after another) let the kernels skip whole blocks
    /// between segments; any ids are correct. Combines with the other masks; RoPE and ALiBi
    /// are relative, so positions need not restart per document.
    pub fn segment_ids(mut self, ids: Tensor<2, Int>) -> Self {
        self.segment_ids = Some((ids, None));
        self
    }

    /// [`segment_ids`](Self::segment_ids) for cross-attention: the queries' `[batch, seq_q]`
    /// and the keys' `[batch, seq_k]`.
    pub fn segment_ids_cross(mut self, query_ids: Tensor<2, Int>, key_ids: Tensor<2, Int>) -> Self {
        self.segment_ids = Some((query_ids, Some(key_ids)));
        self
    }

    /// Which attention weights to return. Default: [`NeedWeights::No`].
    pub fn need_weights(mut self, need_weights: NeedWeights) -> Self {
        self.need_weights = need_weights;
        self
    }

    /// Forces an attention implementation. Default: [`AttentionPath::Auto`].
    pub fn path(mut self, path: AttentionPath) -> Self {
        self.path = path;
        self
    }
}

/// Attention weights returned by a forward, per [`NeedWeights`].
#[derive(Debug, Clone)]
pub enum AttentionWeights {
    /// `[batch, n_heads, seq_q, seq_k]`.
    PerHead(Tensor<4>),
    /// `[batch, seq_q, seq_k]`, the mean over heads.
    Averaged(Tensor<3>),
}

impl AttentionWeights {
    /// The head-averaged weights `[batch, seq_q, seq_k]`, computing the mean if needed.
    pub fn averaged(self) -> Tensor<3> {
        match self {
            Self::PerHead(weights) => weights.mean_dim(1).squeeze_dim(1),
            Self::Averaged(weights) => weights,
        }
    }

    /// This weights' head-averaged variant.
    pub(crate) fn averaged_variant(self) -> Self {
        Self::Averaged(self.averaged())
    }

    /// The per-head weights, if they were requested.
    pub fn per_head(self) -> Option<Tensor<4>> {
        match self {
            Self::PerHead(weights) => Some(weights),
            Self::Averaged(_) => None,
        }
    }
}

/// [`MultiHeadAttention`](crate::MultiHeadAttention) forward output.
#[derive(Debug, Clone)]
pub struct MhaOutput {
    /// `[batch, seq_q, d_model]`.
    pub context: Tensor<3>,
    /// The attention weights, when requested with [`MhaInput::need_weights`]. They are the
    /// probabilities after dropout (rows of a training forward may not sum to 1) and include
    /// the extra key positions of `add_bias_kv`/`add_zero_attn`. A query whose keys are all
    /// masked has a row of zeros.
    pub weights: Option<AttentionWeights>,
}
