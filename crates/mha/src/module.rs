//! [`MultiHeadAttention`]: projections, head split and merge, and the forward pass.

use burn::module::{Content, DisplaySettings, Module, ModuleDisplay, Param};
use burn::nn::{Dropout, Linear};
use burn::tensor::Tensor;

use crate::input::{AttentionPath, AttentionWeights, MhaInput, MhaOutput, NeedWeights};
use crate::kernel::{SoftmaxOptions, explicit_attention, fused_attention};
use crate::mask::{MaskGeometry, build_masks, check_masks};
use crate::shape::check_shape;

/// Multi-head attention ("Attention Is All You Need"), with PyTorch `nn.MultiheadAttention`'s
/// features (key/value widths, `add_bias_kv`, `add_zero_attn`, per-head or averaged weights,
/// key padding and attention masks) and more: grouped-query and multi-query attention, a
/// causal flag, a custom scale, a quiet softmax, and Burn's fused attention kernel.
///
/// Should be created with [`MultiHeadAttentionConfig`](crate::MultiHeadAttentionConfig).
///
/// # Params
///
/// - `query`: [`Linear`] `d_model → d_model`.
/// - `key`: [`Linear`] `d_key_input → n_kv_heads · head_dim`.
/// - `value`: [`Linear`] `d_value_input → n_kv_heads · head_dim`.
/// - `output`: [`Linear`] `d_model → d_model`.
/// - `bias_k`, `bias_v`: `[n_kv_heads · head_dim]`, with `add_bias_kv`.
#[derive(Module, Debug)]
#[module(custom_display)]
pub struct MultiHeadAttention {
    /// Projection of the query input to the query heads.
    pub query: Linear,
    /// Projection of the key input to the key heads.
    pub key: Linear,
    /// Projection of the value input to the value heads.
    pub value: Linear,
    /// Projection of the merged heads to the output.
    pub output: Linear,
    /// Learned key position appended to every key sequence (`add_bias_kv`).
    pub bias_k: Option<Param<Tensor<1>>>,
    /// Learned value position appended to every value sequence (`add_bias_kv`).
    pub bias_v: Option<Param<Tensor<1>>>,
    /// Dropout on the attention weights.
    pub dropout: Dropout,
    /// Width of the query input and of the output.
    pub d_model: usize,
    /// Number of query heads.
    pub n_heads: usize,
    /// Number of key/value heads.
    pub n_kv_heads: usize,
    /// Features per head.
    pub head_dim: usize,
    /// Width of the key input.
    pub d_key_input: usize,
    /// Width of the value input.
    pub d_value_input: usize,
    /// Multiplier of the query-key scores.
    pub scale: f64,
    /// Whether `scale` is the default `1/sqrt(head_dim)`.
    pub default_scale: bool,
    /// Whether an all-zero key/value position is appended.
    pub add_zero_attn: bool,
    /// Whether the softmax is the quiet one.
    pub quiet_softmax: bool,
}

impl ModuleDisplay for MultiHeadAttention {
    fn custom_settings(&self) -> Option<DisplaySettings> {
        DisplaySettings::new()
            .with_new_line_after_attribute(false)
            .optional()
    }

    fn custom_content(&self, content: Content) -> Option<Content> {
        content
            .add("d_model", &self.d_model)
            .add("n_heads", &self.n_heads)
            .add("n_kv_heads", &self.n_kv_heads)
            .add("head_dim", &self.head_dim)
            .add("d_key_input", &self.d_key_input)
            .add("d_value_input", &self.d_value_input)
            .add("dropout", &self.dropout.prob)
            .add("scale", &self.scale)
            .add("add_bias_kv", &self.bias_k.is_some())
            .add("add_zero_attn", &self.add_zero_attn)
            .add("quiet_softmax", &self.quiet_softmax)
            .optional()
    }
}

impl MultiHeadAttention {
    /// Applies multi-head attention.
    ///
    /// # Arguments
    ///
    /// - `input` - the query/key/value sequences, masks and options, see [`MhaInput`].
    ///
    /// # Shapes
    ///
    /// - query: `[batch, seq_q, d_model]`
    /// - key: `[batch, seq_k, d_key_input]`
    /// - value: `[batch, seq_k, d_value_input]`
    /// - key_padding_mask: `[batch, seq_k]`, `true` = ignore the key
    /// - attn_mask: `[seq_q, seq_k]`, `[batch, seq_q, seq_k]` or
    ///   `[batch, n_heads, seq_q, seq_k]`; bool (`true` = may not attend) or float (added)
    /// - context: `[batch, seq_q, d_model]`
    /// - weights: `[batch, n_heads, seq_q, seq_k']` or `[batch, seq_q, seq_k']`, where `seq_k'`
    ///   counts the positions that `add_bias_kv` and `add_zero_attn` append
    ///
    /// # Panics
    ///
    /// - if a tensor's shape does not match the above (the message names the argument, the
    ///   expected and the actual shape), or a sequence or the batch is empty;
    /// - if [`AttentionPath::Fused`] is forced while weights are requested, dropout is active
    ///   or the softmax is quiet, which the fused kernel cannot do.
    pub fn forward(&self, input: MhaInput) -> MhaOutput {
        let MhaInput {
            query,
            key,
            value,
            key_padding_mask,
            attn_mask,
            causal,
            need_weights,
            path,
        } = input;
        let [batch, seq_q, _] = query.dims();
        let seq_k = key.dims()[1];
        check_shape(
            "query",
            query.dims(),
            [
                ("batch", None),
                ("seq_q", None),
                ("d_model", Some(self.d_model)),
            ],
        );
        check_shape(
            "key",
            key.dims(),
            [
                ("batch", Some(batch)),
                ("seq_k", None),
                ("d_key_input", Some(self.d_key_input)),
            ],
        );
        check_shape(
            "value",
            value.dims(),
            [
                ("batch", Some(batch)),
                ("seq_k", Some(seq_k)),
                ("d_value_input", Some(self.d_value_input)),
            ],
        );
        assert!(
            batch > 0 && seq_q > 0 && seq_k > 0,
            "MultiHeadAttention: `query` and `key` must have a non-empty batch and sequence, got \
             query {:?} and key {:?}",
            query.dims(),
            key.dims()
        );
        let extra_keys = usize::from(self.bias_k.is_some()) + usize::from(self.add_zero_attn);
        let geometry = MaskGeometry {
            batch,
            n_heads: self.n_heads,
            seq_q,
            seq_k,
            extra_keys,
        };
        check_masks(key_padding_mask.as_ref(), attn_mask.as_ref(), geometry);
        let fused = self.choose_fused(path, need_weights, &query);

        let query = self.split_heads(self.query.forward(query), self.n_heads);
        let (key, value) = self.project_key_value(key, value);
        let masks = build_masks(
            key_padding_mask,
            attn_mask,
            causal,
            geometry,
            &query.device(),
        );
        let options = SoftmaxOptions {
            scale: self.scale,
            default_scale: self.default_scale,
            quiet: self.quiet_softmax,
        };
        let (context, weights) = if fused {
            (fused_attention(query, key, value, masks, options), None)
        } else {
            let (context, weights) =
                explicit_attention(query, key, value, &masks, options, &self.dropout);
            (context, Some(weights))
        };
        let context = self.output.forward(merge_heads(context));
        let weights = match need_weights {
            NeedWeights::None => None,
            NeedWeights::PerHead => weights.map(AttentionWeights::PerHead),
            NeedWeights::Averaged => weights
                .map(|weights| AttentionWeights::Averaged(weights.mean_dim(1).squeeze_dim(1))),
        };
        MhaOutput { context, weights }
    }

    /// Whether dropout changes the weights in this forward: training mode, an autodiff
    /// device and a non-zero probability, as Burn's `Dropout` decides.
    fn dropout_active(&self, query: &Tensor<3>) -> bool {
        self.dropout.prob > 0.0
            && self.dropout.training.is_enabled()
            && query.device().is_autodiff()
    }

    fn choose_fused(
        &self,
        path: AttentionPath,
        need_weights: NeedWeights,
        query: &Tensor<3>,
    ) -> bool {
        let blocker = if need_weights != NeedWeights::None {
            Some("attention weights are requested")
        } else if self.dropout_active(query) {
            Some("dropout is active")
        } else if self.quiet_softmax {
            Some("the softmax is quiet")
        } else {
            None
        };
        match (path, blocker) {
            (AttentionPath::Explicit, _) => false,
            (AttentionPath::Auto, blocker) => blocker.is_none(),
            (AttentionPath::Fused, None) => true,
            (AttentionPath::Fused, Some(reason)) => panic!(
                "MultiHeadAttention: `AttentionPath::Fused` was forced but {reason}, which the \
                 fused kernel cannot do; use `AttentionPath::Auto` or `AttentionPath::Explicit`"
            ),
        }
    }

    /// Projects key and value, appends `bias_k`/`bias_v` and the zero position, and splits
    /// heads: `[batch, n_kv_heads, seq_k + extra_keys, head_dim]` each.
    fn project_key_value(&self, key: Tensor<3>, value: Tensor<3>) -> (Tensor<4>, Tensor<4>) {
        let mut key = self.key.forward(key);
        let mut value = self.value.forward(value);
        if let (Some(bias_k), Some(bias_v)) = (&self.bias_k, &self.bias_v) {
            key = append_position(key, bias_k.val());
            value = append_position(value, bias_v.val());
        }
        let mut key = self.split_heads(key, self.n_kv_heads);
        let mut value = self.split_heads(value, self.n_kv_heads);
        if self.add_zero_attn {
            key = append_zero_position(key);
            value = append_zero_position(value);
        }
        (key, value)
    }

    /// `[batch, seq, heads · head_dim]` → `[batch, heads, seq, head_dim]`.
    fn split_heads(&self, x: Tensor<3>, heads: usize) -> Tensor<4> {
        let [batch, seq, _] = x.dims();
        x.reshape([batch, seq, heads, self.head_dim])
            .swap_dims(1, 2)
    }
}

/// `[batch, heads, seq, head_dim]` → `[batch, seq, heads · head_dim]`.
fn merge_heads(x: Tensor<4>) -> Tensor<3> {
    let [batch, heads, seq, head_dim] = x.dims();
    x.swap_dims(1, 2).reshape([batch, seq, heads * head_dim])
}

/// Appends `position` (`[width]`) to every sequence of `x` (`[batch, seq, width]`).
fn append_position(x: Tensor<3>, position: Tensor<1>) -> Tensor<3> {
    let [batch, _, width] = x.dims();
    let position = position.reshape([1, 1, width]).expand([batch, 1, width]);
    Tensor::cat(vec![x, position], 1)
}

/// Appends an all-zero position to every head's sequence.
fn append_zero_position(x: Tensor<4>) -> Tensor<4> {
    let [batch, heads, _, head_dim] = x.dims();
    let zeros = Tensor::<4>::zeros([batch, heads, 1, head_dim], &x.device());
    Tensor::cat(vec![x, zeros], 2)
}
