//! [`MultiHeadAttention`]: the parameters, and the stages every forward shares — checks,
//! projections and head split, the kernel, head merge and output projection. The entry points
//! for decoding with caches are in `decoding.rs`.

use burn::module::{Content, DisplaySettings, Module, ModuleDisplay, Param};
use burn::nn::{Dropout, Linear};
use burn::tensor::{Device, Tensor};

use crate::cache::CacheOwner;
use crate::cpu::{native_linear, native_packed_linear};
use crate::dispatch::{Kernel, KernelRequest, LONG_ROW_KEYS, choose_kernel, runs_on_flex};
use crate::execution::Execution;
use crate::flash::{flash_attention, flash_attention_with_weights};
use crate::geometry::Geometry;
use crate::input::{AttentionPath, AttentionWeights, MhaInput, MhaOutput, NeedWeights};
use crate::kernel::{SoftmaxOptions, chunked_attention, explicit_attention, fused_attention};
use crate::mask::{Positions, SegmentIds, Visibility};
use crate::rotary::{Rope, RopeConfig};
use crate::shape::check_shape;

/// Multi-head attention ("Attention Is All You Need"), with PyTorch `nn.MultiheadAttention`'s
/// features (key/value widths, `add_bias_kv`, `add_zero_attn`, per-head or averaged weights,
/// key padding and attention masks) and more: grouped-query and multi-query attention, a
/// causal flag, a custom scale, a quiet softmax, RoPE, ALiBi, KV caches and a flash kernel.
///
/// Should be created with [`MultiHeadAttentionConfig`](crate::MultiHeadAttentionConfig). The
/// parameters are public (to load or inspect weights); the sizes and switches are read through
/// methods and fixed by the configuration.
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
    pub(crate) dropout: Dropout,
    pub(crate) d_model: usize,
    pub(crate) n_heads: usize,
    pub(crate) n_kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) d_key_input: usize,
    pub(crate) d_value_input: usize,
    pub(crate) scale: f64,
    /// `scale` was configured rather than `1/sqrt(head_dim)`.
    pub(crate) custom_scale: bool,
    pub(crate) add_zero_attn: bool,
    pub(crate) quiet_softmax: bool,
    #[module(skip)]
    pub(crate) rope: Option<Rope>,
    pub(crate) alibi: bool,
    #[module(skip)]
    pub(crate) window: Option<usize>,
    #[module(skip)]
    pub(crate) softcap: Option<f64>,
    /// One learned logit per query head in every softmax's denominator
    /// (`attention_sinks`), `[n_heads]`.
    pub sinks: Option<Param<Tensor<1>>>,
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
            .add(
                "rope",
                &self
                    .rope
                    .as_ref()
                    .map(|rope| format!("{:?}", rope.config.layout)),
            )
            .add("alibi", &self.alibi)
            .add("window", &self.window.map(|w| w.to_string()))
            .add("softcap", &self.softcap.map(|c| c.to_string()))
            .add("attention_sinks", &self.sinks.is_some())
            .optional()
    }
}

/// The sizes and switches, read-only.
/// A call's query, key and value sequences before their projections, `[batch, seq, width]`.
pub(crate) struct Sequences {
    pub query: Tensor<3>,
    pub key: Tensor<3>,
    pub value: Tensor<3>,
}

/// The positions RoPE rotates the first query and the first key from.
pub(crate) struct RopeStarts {
    pub query: usize,
    pub key: usize,
}

impl MultiHeadAttention {
    /// Width of the query input and of the output.
    pub fn d_model(&self) -> usize {
        self.d_model
    }

    /// Number of query heads.
    pub fn n_heads(&self) -> usize {
        self.n_heads
    }

    /// Number of key/value heads (`n_heads` for plain multi-head attention).
    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }

    /// Features per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Width of the key input.
    pub fn d_key_input(&self) -> usize {
        self.d_key_input
    }

    /// Width of the value input.
    pub fn d_value_input(&self) -> usize {
        self.d_value_input
    }

    /// Multiplier of the query-key scores.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Whether the scale was configured rather than the default `1/sqrt(head_dim)`.
    pub fn has_custom_scale(&self) -> bool {
        self.custom_scale
    }

    /// Dropout probability on the attention weights.
    pub fn dropout(&self) -> f64 {
        self.dropout.prob
    }

    /// Whether an all-zero key/value position is appended (`add_zero_attn`).
    pub fn add_zero_attn(&self) -> bool {
        self.add_zero_attn
    }

    /// Whether the softmax is the quiet one.
    pub fn quiet_softmax(&self) -> bool {
        self.quiet_softmax
    }

    /// The rotary position embedding of queries and keys, if any.
    pub fn rope(&self) -> Option<&RopeConfig> {
        self.rope.as_ref().map(|rope| &rope.config)
    }

    /// Whether ALiBi's distance penalty is added to the scores.
    pub fn alibi(&self) -> bool {
        self.alibi
    }

    /// The sliding window, if any: each query sees this many positions up to its own.
    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// The logit soft cap, if any.
    pub fn softcap(&self) -> Option<f64> {
        self.softcap
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
    /// With RoPE or ALiBi, queries sit at positions `seq_k - seq_q ..` and keys at `0 ..`
    /// (aligned at the end, as the causal mask and a KV cache are).
    ///
    /// # Panics
    ///
    /// - if a tensor's shape does not match the above (the message names the argument, the
    ///   expected and the actual shape), or a sequence or the batch is empty;
    /// - if [`AttentionPath::Fused`], [`AttentionPath::Chunked`] or [`AttentionPath::Flash`] is
    ///   forced while weights are requested, dropout is active or the softmax is quiet, which
    ///   those kernels cannot do, or [`AttentionPath::Flash`] on a backend without it or with a
    ///   float attention mask that requires a gradient, or with block sizes of zero.
    pub fn forward(&self, input: MhaInput) -> MhaOutput {
        let geometry = self.check_sequences(&input.query, &input.key, &input.value);
        let MhaInput {
            query,
            key,
            value,
            key_padding_mask,
            attn_mask,
            causal,
            segment_ids,
            need_weights,
            path,
            shared_input,
        } = input;
        let positions = Positions {
            query: geometry.seq_k as i64 - geometry.seq_q as i64,
            key: 0,
        };
        let visibility = Visibility {
            key_padding: key_padding_mask,
            attn_mask,
            causal,
            window: self.window,
            alibi: self.alibi,
            positions,
            pinned_keys: 0,
            segments: segment_ids.map(|(query, key)| SegmentIds {
                key: key.unwrap_or_else(|| query.clone()),
                query,
            }),
            extra_keys: self.extra_keys(),
        };
        let plan = self.plan(visibility, geometry, path, need_weights, &query.device());
        let sequences = Sequences { query, key, value };
        let starts = RopeStarts {
            query: positions.rope_query(),
            key: 0,
        };
        let (query, key, value) = self.project(sequences, shared_input, starts);
        let (key, value) = self.append_extra_positions(key, value);
        self.attend(query, key, value, &plan)
    }

    /// Checks the three sequences' shapes; the geometry's `seq_k` counts the caller's keys.
    #[track_caller]
    pub(crate) fn check_sequences(
        &self,
        query: &Tensor<3>,
        key: &Tensor<3>,
        value: &Tensor<3>,
    ) -> Geometry {
        let [batch, seq_q, _] = query.dims();
        check_shape(
            "query",
            query.dims(),
            [
                ("batch", None),
                ("seq_q", None),
                ("d_model", Some(self.d_model)),
            ],
        );
        self.check_key_value(key, value, batch);
        let seq_k = key.dims()[1];
        assert!(
            batch > 0 && seq_q > 0 && seq_k > 0,
            "MultiHeadAttention: `query` and `key` must have a non-empty batch and sequence, got \
             query {:?} and key {:?}",
            query.dims(),
            key.dims()
        );
        self.geometry(batch, seq_q, seq_k)
    }

    /// Checks key and value against the module's widths, `batch` and each other's length.
    #[track_caller]
    pub(crate) fn check_key_value(&self, key: &Tensor<3>, value: &Tensor<3>, batch: usize) {
        let seq_k = key.dims()[1];
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
    }

    pub(crate) fn geometry(&self, batch: usize, seq_q: usize, seq_k: usize) -> Geometry {
        Geometry {
            batch,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            seq_q,
            seq_k,
            head_dim: self.head_dim,
            value_dim: self.head_dim,
        }
    }

    /// Key positions appended after the caller's (`add_bias_kv`, `add_zero_attn`).
    pub(crate) fn extra_keys(&self) -> usize {
        usize::from(self.bias_k.is_some()) + usize::from(self.add_zero_attn)
    }

    /// Who owns the caches this module fills.
    pub(crate) fn cache_owner(&self) -> CacheOwner {
        CacheOwner {
            key_weight: self.key.weight.id,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// Checks the masks against `geometry` (whose `seq_k` counts the caller's keys) and picks
    /// the kernel; panics on a mask that does not fit or a forced path that cannot run.
    #[track_caller]
    pub(crate) fn plan(
        &self,
        visibility: Visibility,
        geometry: Geometry,
        path: AttentionPath,
        need_weights: NeedWeights,
        device: &Device,
    ) -> Plan {
        visibility.check(&geometry);
        // Dropout changes the weights in training mode on an autodiff device only, as Burn's
        // `Dropout` decides.
        let dropout_active =
            self.dropout.prob > 0.0 && self.dropout.training.is_enabled() && device.is_autodiff();
        let kernel = choose_kernel(&KernelRequest {
            path,
            need_weights,
            dropout_active,
            sinks: self.quiet_softmax || self.sinks.is_some(),
            float_mask_requires_grad: visibility.float_mask_requires_grad(),
            score_elements: geometry.score_elements()
                + geometry.batch * geometry.n_heads * geometry.seq_q * self.extra_keys(),
            long_rows: geometry.seq_k + self.extra_keys() >= LONG_ROW_KEYS
                && !visibility.shortens_rows(),
            device,
        });
        Plan {
            visibility,
            geometry,
            kernel,
            need_weights,
        }
    }

    /// Query heads `[batch, n_heads, seq_q, head_dim]`, key and value heads `[batch,
    /// n_kv_heads, seq_k, head_dim]`, the queries and keys rotated with RoPE from `starts`.
    /// When the three inputs are one tensor (`shared_input`), the three projections are one op
    /// where [`native_packed_linear`] runs, and the heads views of its output.
    pub(crate) fn project(
        &self,
        sequences: Sequences,
        shared_input: bool,
        starts: RopeStarts,
    ) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
        let (query, key, value) = self.project_unrotated(sequences, shared_input);
        (
            self.rotated(query, starts.query),
            self.rotated(key, starts.key),
            value,
        )
    }

    /// [`project`](Self::project) of one input whose row `i` is at position `positions[i]`
    /// (`[1, rows, d_model]`, the rows of a ragged batch): queries and keys rotated each at its
    /// own position.
    pub(crate) fn project_at(
        &self,
        x: Tensor<3>,
        positions: &[usize],
    ) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
        let sequences = Sequences {
            query: x.clone(),
            key: x.clone(),
            value: x,
        };
        let (query, key, value) = self.project_unrotated(sequences, true);
        match &self.rope {
            Some(rope) => (
                rope.apply_at(query, positions),
                rope.apply_at(key, positions),
                value,
            ),
            None => (query, key, value),
        }
    }

    /// The heads of [`project`](Self::project), not rotated.
    fn project_unrotated(
        &self,
        sequences: Sequences,
        shared_input: bool,
    ) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
        let Sequences { query, key, value } = sequences;
        let packed = if shared_input {
            native_packed_linear([&self.query, &self.key, &self.value], &query)
        } else {
            None
        };
        let Some(packed) = packed else {
            return (
                self.project_heads(query, &self.query, self.n_heads),
                self.project_heads(key, &self.key, self.n_kv_heads),
                self.project_heads(value, &self.value, self.n_kv_heads),
            );
        };
        let [batch, seq, _] = packed.dims();
        let [heads, kv_heads, head_dim] = [self.n_heads, self.n_kv_heads, self.head_dim];
        // Contiguous, so the reshape is free; each part is then a strided view the kernels
        // read in place.
        let packed = packed.reshape([batch, seq, heads + 2 * kv_heads, head_dim]);
        let part = |first: usize, count: usize| {
            packed
                .clone()
                .slice([0..batch, 0..seq, first..first + count, 0..head_dim])
                .swap_dims(1, 2)
        };
        (
            part(0, heads),
            part(heads, kv_heads),
            part(heads + kv_heads, kv_heads),
        )
    }

    /// `heads` rotated from position `start` with RoPE, if the module has it.
    fn rotated(&self, heads: Tensor<4>, start: usize) -> Tensor<4> {
        match &self.rope {
            Some(rope) => rope.apply(heads, start),
            None => heads,
        }
    }

    /// `[batch, seq_q, d_model]` → query heads `[batch, n_heads, seq_q, head_dim]`, rotated
    /// from position `start` with RoPE.
    pub(crate) fn project_query(&self, query: Tensor<3>, start: usize) -> Tensor<4> {
        self.rotated(self.project_heads(query, &self.query, self.n_heads), start)
    }

    /// Projects key and value to heads, `[batch, n_kv_heads, seq_k, head_dim]` each, keys
    /// rotated from position `start` with RoPE.
    pub(crate) fn project_key_value(
        &self,
        key: Tensor<3>,
        value: Tensor<3>,
        start: usize,
    ) -> (Tensor<4>, Tensor<4>) {
        let key = self.project_heads(key, &self.key, self.n_kv_heads);
        let value = self.project_heads(value, &self.value, self.n_kv_heads);
        (self.rotated(key, start), value)
    }

    /// Appends `bias_k`/`bias_v` and the all-zero position (`add_bias_kv`, `add_zero_attn`).
    pub(crate) fn append_extra_positions(
        &self,
        mut key: Tensor<4>,
        mut value: Tensor<4>,
    ) -> (Tensor<4>, Tensor<4>) {
        if let (Some(bias_k), Some(bias_v)) = (&self.bias_k, &self.bias_v) {
            key = append_position(key, bias_k.val());
            value = append_position(value, bias_v.val());
        }
        if self.add_zero_attn {
            key = append_zero_position(key);
            value = append_zero_position(value);
        }
        (key, value)
    }

    /// The kernel, the head merge and the output projection; `key` and `value` hold the
    /// appended positions too.
    pub(crate) fn attend(
        &self,
        query: Tensor<4>,
        key: Tensor<4>,
        value: Tensor<4>,
        plan: &Plan,
    ) -> MhaOutput {
        let (context, weights) = self.attention_heads(query, key, value, plan);
        let context = self.output_projection(context);
        let weights = match plan.need_weights {
            NeedWeights::No => None,
            NeedWeights::PerHead => weights.map(AttentionWeights::PerHead),
            NeedWeights::Averaged => {
                weights.map(|weights| AttentionWeights::PerHead(weights).averaged_variant())
            }
        };
        MhaOutput { context, weights }
    }

    /// The softmax options of this module's kernels.
    pub(crate) fn softmax_options(&self, device: &Device) -> SoftmaxOptions {
        SoftmaxOptions {
            scale: self.scale,
            custom_scale: self.custom_scale,
            softcap: self.softcap,
            // The quiet softmax is a sink of logit 0, constant.
            sinks: match (&self.sinks, self.quiet_softmax) {
                (Some(sinks), _) => Some(sinks.val()),
                (None, true) => Some(Tensor::zeros([self.n_heads], device)),
                (None, false) => None,
            },
        }
    }

    /// `[batch, n_heads, seq_q, head_dim]` context heads → `[batch, seq_q, d_model]` through
    /// the output projection.
    pub(crate) fn output_projection(&self, context: Tensor<4>) -> Tensor<3> {
        let merged = merge_heads(context);
        native_linear(&self.output, &merged).unwrap_or_else(|| self.output.forward(merged))
    }

    /// The kernel of `plan`: context heads `[batch, n_heads, seq_q, head_dim]` and, where it
    /// computes them, the per-head weights.
    pub(crate) fn attention_heads(
        &self,
        query: Tensor<4>,
        key: Tensor<4>,
        value: Tensor<4>,
        plan: &Plan,
    ) -> (Tensor<4>, Option<Tensor<4>>) {
        let device = query.device();
        let masks = plan
            .visibility
            .score_masks(&plan.geometry, (&device, query.dtype()));
        let options = self.softmax_options(&device);
        let ordinary = Execution::default();
        match plan.kernel {
            Kernel::Fused => (fused_attention(query, key, value, &masks, &options), None),
            Kernel::Chunked(blocks) => (
                chunked_attention(query, key, value, &masks, &options, blocks),
                None,
            ),
            Kernel::Flash(blocks) if plan.need_weights != NeedWeights::No => {
                let (context, weights) = flash_attention_with_weights(
                    query, key, value, &masks, &options, blocks, &ordinary,
                );
                (context, Some(weights))
            }
            Kernel::Flash(blocks) => (
                flash_attention(query, key, value, &masks, &options, blocks, &ordinary),
                None,
            ),
            Kernel::Explicit => {
                let (context, weights) =
                    explicit_attention(query, key, value, &masks, &options, &self.dropout);
                (context, Some(weights))
            }
        }
    }

    /// `linear(x)` split into heads, `[batch, heads, seq, head_dim]`.
    ///
    /// On flex and ndarray in f32 with this crate's native kernels, the projection op
    /// (`projection.rs`, with its own backward in training) writes `linear(x)` in one GEMM, and
    /// the split is a view the flash kernel reads through its strides. Otherwise, for inference
    /// on flex (another dtype, or without this crate's `flex` feature, where `Auto` takes
    /// flex's fused kernel) it is computed head-major: one batched matmul against the weight
    /// viewed as
    /// `[heads, d_input, head_dim]` writes each head contiguously, where `linear` then a split
    /// leaves a strided view that flex's fused attention kernel reads more slowly (75.6 ms
    /// against 86.6 ms for a forward at batch 4, 512 tokens, d_model 512, 8 heads).
    /// Under autodiff the input's gradient would then be reduced over a `heads`-times larger
    /// broadcast (496 ms against 400 ms for forward + backward), so training splits instead,
    /// and so does every backend but flex (see `dispatch::runs_on_flex`).
    fn project_heads(&self, x: Tensor<3>, linear: &Linear, heads: usize) -> Tensor<4> {
        if let Some(projected) = native_linear(linear, &x) {
            return self.split_heads(projected, heads);
        }
        let device = x.device();
        if device.is_autodiff() || !runs_on_flex(&device) {
            return self.split_heads(linear.forward(x), heads);
        }
        let [d_input, _] = linear.weight.dims();
        let weight = linear
            .weight
            .val()
            .reshape([1, d_input, heads, self.head_dim])
            .swap_dims(1, 2);
        let projected = x.unsqueeze_dim::<4>(1).matmul(weight);
        match &linear.bias {
            Some(bias) => projected + bias.val().reshape([1, heads, 1, self.head_dim]),
            None => projected,
        }
    }

    /// `[batch, seq, heads · head_dim]` → `[batch, heads, seq, head_dim]`.
    fn split_heads(&self, x: Tensor<3>, heads: usize) -> Tensor<4> {
        let [batch, seq, _] = x.dims();
        x.reshape([batch, seq, heads, self.head_dim])
            .swap_dims(1, 2)
    }
}

/// One forward's checked masks, sizes and kernel.
pub(crate) struct Plan {
    visibility: Visibility,
    /// `seq_k` counts the caller's keys, without the appended positions.
    geometry: Geometry,
    kernel: Kernel,
    need_weights: NeedWeights,
}

/// `[batch, heads, seq, head_dim]` → `[batch, seq, heads · head_dim]`.
fn merge_heads(x: Tensor<4>) -> Tensor<3> {
    let [batch, heads, seq, head_dim] = x.dims();
    x.swap_dims(1, 2).reshape([batch, seq, heads * head_dim])
}

/// Appends `position` (`[heads · head_dim]`) to every head's sequence of `x`
/// (`[batch, heads, seq, head_dim]`).
fn append_position(x: Tensor<4>, position: Tensor<1>) -> Tensor<4> {
    let [batch, heads, _, head_dim] = x.dims();
    let position = position
        .reshape([1, heads, 1, head_dim])
        .expand([batch, heads, 1, head_dim]);
    Tensor::cat(vec![x, position], 2)
}

/// Appends an all-zero position to every head's sequence.
fn append_zero_position(x: Tensor<4>) -> Tensor<4> {
    let [batch, heads, _, head_dim] = x.dims();
    let zeros = Tensor::<4>::zeros([batch, heads, 1, head_dim], (&x.device(), x.dtype()));
    Tensor::cat(vec![x, zeros], 2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MultiHeadAttentionConfig;
    use crate::dispatch::LONG_ROW_BLOCKS;
    use crate::input::BlockSizes;
    use burn::tensor::Device;

    fn visibility(causal: bool, window: Option<usize>) -> Visibility {
        Visibility {
            causal,
            window,
            ..Visibility::nothing_hidden()
        }
    }

    /// The plan's block sizes for one query against `seq_k` keys under `visibility`.
    fn auto_kernel(seq_k: usize, visibility: Visibility) -> Kernel {
        let device = Device::flex();
        let module = MultiHeadAttentionConfig::new(16, 2).init(&device);
        let query = Tensor::<3>::zeros([1, 1, 16], &device);
        let geometry = module.geometry(1, 1, seq_k);
        let plan = module.plan(
            visibility,
            geometry,
            AttentionPath::Auto,
            NeedWeights::No,
            &query.device(),
        );
        plan.kernel
    }

    #[test]
    fn auto_gives_long_unshortened_rows_the_larger_query_blocks() {
        let long = LONG_ROW_KEYS;
        assert_eq!(
            auto_kernel(long, visibility(false, None)),
            Kernel::Flash(LONG_ROW_BLOCKS)
        );
        assert_eq!(
            auto_kernel(long - 1, visibility(false, None)),
            Kernel::Flash(BlockSizes::default())
        );
        for shortened in [visibility(true, None), visibility(false, Some(64))] {
            assert_eq!(
                auto_kernel(long, shortened),
                Kernel::Flash(BlockSizes::default())
            );
        }
    }
}
