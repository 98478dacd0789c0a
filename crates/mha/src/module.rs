//! [`MultiHeadAttention`]: projections, head split and merge, and the forward pass.

use burn::module::{Content, DisplaySettings, Module, ModuleDisplay, Param};
use burn::nn::{Dropout, Linear};
use burn::tensor::{Bool, Device, Tensor, TensorData};

use crate::alibi::alibi_bias;
use crate::cache::{CacheError, CacheLimit, CrossAttentionCache, KvCache};
use crate::flash::{flash_attention, flash_attention_supported};
use crate::input::{
    AttentionPath, AttentionWeights, AttnMask, MaskValues, MhaInput, MhaOutput, NeedWeights,
};
use crate::kernel::{
    ChunkSizes, SoftmaxOptions, chunked_attention, explicit_attention, fused_attention,
};
use crate::mask::{MaskGeometry, ScoreMasks, build_masks, check_masks};
use crate::rotary::RopeConfig;
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
    /// Rotary position embeddings of queries and keys.
    #[module(skip)]
    pub rope: Option<RopeConfig>,
    /// Whether ALiBi's distance penalty is added to the scores.
    pub alibi: bool,
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
                &self.rope.as_ref().map(|rope| format!("{:?}", rope.layout)),
            )
            .add("alibi", &self.alibi)
            .optional()
    }
}

/// Above this many score elements (`batch · n_heads · seq_q · seq_k`, 64 Mi: 256 MiB of f32
/// scores), [`AttentionPath::Auto`] takes the chunked path on a device without autodiff whose
/// fused attention op may materialise the scores (every backend but flex, whose fused op is
/// already tiled).
pub const CHUNKED_THRESHOLD: usize = 1 << 26;

/// The implementation one forward uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    Fused,
    Explicit,
    Chunked(ChunkSizes),
    Flash(ChunkSizes),
}

/// Shapes of one forward, read off its input.
struct Dims {
    batch: usize,
    seq_q: usize,
    seq_k: usize,
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
    ///   float attention mask that requires a gradient.
    pub fn forward(&self, input: MhaInput) -> MhaOutput {
        let dims = self.check_sequences(&input.query, &input.key, &input.value);
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
        let geometry = self.geometry(&dims, dims.seq_k);
        check_masks(key_padding_mask.as_ref(), attn_mask.as_ref(), geometry);
        let kernel = self.choose_kernel(path, need_weights, &query, attn_mask.as_ref(), &geometry);
        let device = query.device();
        let query_start = dims.seq_k.saturating_sub(dims.seq_q);

        let query = self.project_query(query, query_start);
        let (key, value) = self.project_key_value(key, value, 0);
        let (key, value) = self.append_extra_positions(key, value);
        let alibi = self.alibi.then(|| {
            alibi_bias(
                self.n_heads,
                query_start,
                dims.seq_q,
                0,
                dims.seq_k,
                &device,
            )
        });
        let masks = build_masks(
            key_padding_mask,
            attn_mask,
            causal,
            geometry,
            None,
            alibi,
            &device,
        );
        self.attend(query, key, value, &masks, kernel, need_weights)
    }

    /// Incremental self-attention: `input` holds **only the new tokens** (as query, key and
    /// value), whose keys and values are appended to `cache`. Each new query attends to every
    /// cached position and to the new ones its masks allow — with `.causal()`, new token `i`
    /// sees the cache and new tokens `≤ i` (bottom-right alignment). RoPE and ALiBi take the
    /// positions from the cache.
    ///
    /// Feeding a sequence in any number of steps gives the outputs of one causal
    /// [`forward`](Self::forward) over the whole sequence.
    ///
    /// `key_padding_mask` covers either the new keys (`[batch, new]`, remembered by the cache)
    /// or cached plus new keys (`[batch, stored + new]`); `attn_mask` covers
    /// `[new, stored + new]`.
    ///
    /// # Errors
    ///
    /// [`CacheError`] when the step would exceed a fixed capacity, changes the batch size or
    /// brings a padding mask of another width; the cache is then unchanged.
    ///
    /// # Panics
    ///
    /// As [`forward`](Self::forward), and if the key and value do not have the query's length
    /// (they are the new tokens).
    pub fn forward_cached(
        &self,
        input: MhaInput,
        cache: &mut KvCache,
    ) -> Result<MhaOutput, CacheError> {
        let dims = self.check_sequences(&input.query, &input.key, &input.value);
        assert!(
            dims.seq_k == dims.seq_q,
            "MultiHeadAttention: under a KV cache `key` and `value` are the new tokens and must have \
             the query's length {}, got {}",
            dims.seq_q,
            dims.seq_k
        );
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
        let new = dims.seq_q;
        cache.check(dims.batch, new)?;
        let device = query.device();
        let padding = cache.padding_with(key_padding_mask, dims.batch, new, &device)?;
        let stored = cache.stored();
        let total = stored + new;
        let first_query = cache.seen;
        let first_key = cache.seen - stored;
        let geometry = self.geometry(&dims, total);
        check_masks(padding.as_ref(), attn_mask.as_ref(), geometry);
        let kernel = self.choose_kernel(path, need_weights, &query, attn_mask.as_ref(), &geometry);

        let query = self.project_query(query, first_query);
        let (key, value) = self.project_key_value(key, value, first_query);
        let (key, value) = match (&cache.key, &cache.value) {
            (Some(past_key), Some(past_value)) => (
                Tensor::cat(vec![past_key.clone(), key], 2),
                Tensor::cat(vec![past_value.clone(), value], 2),
            ),
            _ => (key, value),
        };
        let band = match cache.limit {
            CacheLimit::SlidingWindow(window) => Some(sliding_window_mask(
                first_query,
                new,
                first_key,
                total,
                window,
                &device,
            )),
            _ => None,
        };
        let alibi = self
            .alibi
            .then(|| alibi_bias(self.n_heads, first_query, new, first_key, total, &device));
        let masks = build_masks(
            padding.clone(),
            attn_mask,
            causal,
            geometry,
            band,
            alibi,
            &device,
        );
        let (attended_key, attended_value) =
            self.append_extra_positions(key.clone(), value.clone());
        let output = self.attend(
            query,
            attended_key,
            attended_value,
            &masks,
            kernel,
            need_weights,
        );
        cache.store(key, value, padding, new);
        Ok(output)
    }

    /// Projects an encoder's memory once for a decoder's cross-attention; reuse the result at
    /// every decoding step with [`forward_cross_cached`](Self::forward_cross_cached).
    ///
    /// # Shapes
    ///
    /// - key: `[batch, seq_k, d_key_input]`
    /// - value: `[batch, seq_k, d_value_input]`
    ///
    /// # Panics
    ///
    /// On shapes as [`forward`](Self::forward), and for a module with RoPE or ALiBi, whose
    /// positions are those of self-attention.
    pub fn cross_attention_cache(&self, key: Tensor<3>, value: Tensor<3>) -> CrossAttentionCache {
        assert!(
            self.rope.is_none() && !self.alibi,
            "MultiHeadAttention: a cross-attention cache needs a module without RoPE or ALiBi"
        );
        let [batch, seq_k, _] = key.dims();
        self.check_key_value(&key, &value, batch);
        assert!(
            batch > 0 && seq_k > 0,
            "MultiHeadAttention: the memory `key` must have a non-empty batch and sequence, got {:?}",
            key.dims()
        );
        let (key, value) = self.project_key_value(key, value, 0);
        let (key, value) = self.append_extra_positions(key, value);
        CrossAttentionCache {
            key,
            value,
            seq_k,
            key_padding_mask: None,
        }
    }

    /// Cross-attention of `query` (`[batch, seq_q, d_model]`) over a memory projected once by
    /// [`cross_attention_cache`](Self::cross_attention_cache). Gives the outputs of
    /// [`forward`](Self::forward) with the memory as key and value.
    ///
    /// # Panics
    ///
    /// If `query` does not have shape `[batch, seq_q, d_model]` with the memory's batch.
    pub fn forward_cross_cached(
        &self,
        query: Tensor<3>,
        cache: &CrossAttentionCache,
        need_weights: NeedWeights,
    ) -> MhaOutput {
        let [batch, seq_q, _] = query.dims();
        check_shape(
            "query",
            query.dims(),
            [
                ("batch", Some(cache.key.dims()[0])),
                ("seq_q", None),
                ("d_model", Some(self.d_model)),
            ],
        );
        let dims = Dims {
            batch,
            seq_q,
            seq_k: cache.seq_k,
        };
        let geometry = self.geometry(&dims, cache.seq_k);
        check_masks(cache.key_padding_mask.as_ref(), None, geometry);
        let kernel = self.choose_kernel(AttentionPath::Auto, need_weights, &query, None, &geometry);
        let device = query.device();
        let query = self.project_query(query, 0);
        let masks = build_masks(
            cache.key_padding_mask.clone(),
            None,
            false,
            geometry,
            None,
            None,
            &device,
        );
        self.attend(
            query,
            cache.key.clone(),
            cache.value.clone(),
            &masks,
            kernel,
            need_weights,
        )
    }

    /// Checks the three sequences' shapes.
    #[track_caller]
    fn check_sequences(&self, query: &Tensor<3>, key: &Tensor<3>, value: &Tensor<3>) -> Dims {
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
        self.check_key_value(key, value, batch);
        assert!(
            batch > 0 && seq_q > 0 && seq_k > 0,
            "MultiHeadAttention: `query` and `key` must have a non-empty batch and sequence, got \
             query {:?} and key {:?}",
            query.dims(),
            key.dims()
        );
        Dims {
            batch,
            seq_q,
            seq_k,
        }
    }

    /// Checks key and value against the module's widths, `batch` and each other's length.
    #[track_caller]
    fn check_key_value(&self, key: &Tensor<3>, value: &Tensor<3>, batch: usize) {
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

    fn geometry(&self, dims: &Dims, seq_k: usize) -> MaskGeometry {
        MaskGeometry {
            batch: dims.batch,
            n_heads: self.n_heads,
            seq_q: dims.seq_q,
            seq_k,
            extra_keys: usize::from(self.bias_k.is_some()) + usize::from(self.add_zero_attn),
        }
    }

    /// Whether dropout changes the weights in this forward: training mode, an autodiff
    /// device and a non-zero probability, as Burn's `Dropout` decides.
    fn dropout_active(&self, query: &Tensor<3>) -> bool {
        self.dropout.prob > 0.0
            && self.dropout.training.is_enabled()
            && query.device().is_autodiff()
    }

    fn choose_kernel(
        &self,
        path: AttentionPath,
        need_weights: NeedWeights,
        query: &Tensor<3>,
        attn_mask: Option<&AttnMask>,
        geometry: &MaskGeometry,
    ) -> Kernel {
        let blocker = if need_weights != NeedWeights::None {
            Some("attention weights are requested")
        } else if self.dropout_active(query) {
            Some("dropout is active")
        } else if self.quiet_softmax {
            Some("the softmax is quiet")
        } else {
            None
        };
        let forced = |kernel: Kernel, name: &str| match blocker {
            None => kernel,
            Some(reason) => panic!(
                "MultiHeadAttention: `{name}` was forced but {reason}, which that kernel cannot \
                 do; use `AttentionPath::Auto` or `AttentionPath::Explicit`"
            ),
        };
        let score_elements = geometry.batch
            * geometry.n_heads
            * geometry.seq_q
            * (geometry.seq_k + geometry.extra_keys);
        let device = query.device();
        let mask_needs_grad = attn_mask.is_some_and(|mask| match &mask.values {
            MaskValues::Float(values) => values.is_require_grad(),
            MaskValues::Bool(_) => false,
        });
        let flash_blocker = blocker.or_else(|| {
            if !flash_attention_supported(&device) {
                Some("this backend has no flash kernel (see `flash_attention_supported`)")
            } else if mask_needs_grad {
                Some("the float attention mask requires a gradient")
            } else {
                None
            }
        });
        match path {
            AttentionPath::Explicit => Kernel::Explicit,
            AttentionPath::Fused => forced(Kernel::Fused, "AttentionPath::Fused"),
            AttentionPath::Chunked(sizes) => {
                forced(Kernel::Chunked(sizes), "AttentionPath::Chunked")
            }
            AttentionPath::Flash(sizes) => match flash_blocker {
                None => Kernel::Flash(sizes),
                Some(reason) => panic!(
                    "MultiHeadAttention: `AttentionPath::Flash` was forced but {reason}, which \
                     that kernel cannot do; use `AttentionPath::Auto` or `AttentionPath::Explicit`"
                ),
            },
            AttentionPath::Auto if blocker.is_some() => Kernel::Explicit,
            // Where the flash kernel is compiled it runs natively on the backend's storage
            // (`flash_cpu.rs`) and beats every other path at every size measured, inference
            // and training, on flex and on ndarray (benches/table.rs).
            AttentionPath::Auto if flash_blocker.is_none() => Kernel::Flash(ChunkSizes::default()),
            // Burn's autodiff runs the fused op as a decomposed fallback that scales and clamps
            // the full score matrix; the explicit path scales the queries instead and uses the
            // one-op softmax: 400 ms against 485 ms for a forward + backward at batch 4, 512
            // tokens, d_model 512, 8 heads on flex (benches/table.rs).
            AttentionPath::Auto if device.is_autodiff() => Kernel::Explicit,
            AttentionPath::Auto if score_elements > CHUNKED_THRESHOLD && !runs_on_flex(&device) => {
                Kernel::Chunked(ChunkSizes::default())
            }
            AttentionPath::Auto => Kernel::Fused,
        }
    }

    /// `[batch, seq_q, d_model]` → query heads `[batch, n_heads, seq_q, head_dim]`, rotated
    /// from position `start` with RoPE.
    fn project_query(&self, query: Tensor<3>, start: usize) -> Tensor<4> {
        let query = self.project_heads(query, &self.query, self.n_heads);
        match &self.rope {
            Some(rope) => rope.apply(query, start),
            None => query,
        }
    }

    /// Projects key and value to heads, `[batch, n_kv_heads, seq_k, head_dim]` each, keys
    /// rotated from position `start` with RoPE.
    fn project_key_value(
        &self,
        key: Tensor<3>,
        value: Tensor<3>,
        start: usize,
    ) -> (Tensor<4>, Tensor<4>) {
        let key = self.project_heads(key, &self.key, self.n_kv_heads);
        let value = self.project_heads(value, &self.value, self.n_kv_heads);
        let key = match &self.rope {
            Some(rope) => rope.apply(key, start),
            None => key,
        };
        (key, value)
    }

    /// Appends `bias_k`/`bias_v` and the all-zero position (`add_bias_kv`, `add_zero_attn`).
    fn append_extra_positions(
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

    /// The kernel, the head merge and the output projection.
    fn attend(
        &self,
        query: Tensor<4>,
        key: Tensor<4>,
        value: Tensor<4>,
        masks: &ScoreMasks,
        kernel: Kernel,
        need_weights: NeedWeights,
    ) -> MhaOutput {
        let options = SoftmaxOptions {
            scale: self.scale,
            default_scale: self.default_scale,
            quiet: self.quiet_softmax,
        };
        let (context, weights) = match kernel {
            Kernel::Fused => (
                fused_attention(query, key, value, masks.clone(), options),
                None,
            ),
            Kernel::Chunked(sizes) => (
                chunked_attention(query, key, value, masks, options, sizes),
                None,
            ),
            Kernel::Flash(sizes) => (
                flash_attention(query, key, value, masks, options, sizes),
                None,
            ),
            Kernel::Explicit => {
                let (context, weights) =
                    explicit_attention(query, key, value, masks, options, &self.dropout);
                (context, Some(weights))
            }
        };
        let context = self.output.forward(merge_heads(context));
        let weights = match need_weights {
            NeedWeights::None => None,
            NeedWeights::PerHead => weights.map(AttentionWeights::PerHead),
            NeedWeights::Averaged => {
                weights.map(|weights| AttentionWeights::PerHead(weights).averaged_variant())
            }
        };
        MhaOutput { context, weights }
    }

    /// `linear(x)` split into heads, `[batch, heads, seq, head_dim]`.
    ///
    /// For inference it is computed head-major: one batched matmul against the weight viewed as
    /// `[heads, d_input, head_dim]` writes each head contiguously, where `linear` then a split
    /// leaves a strided view that the attention kernel reads more slowly (75.6 ms against
    /// 86.6 ms for a forward at batch 4, 512 tokens, d_model 512, 8 heads on flex). Under
    /// autodiff the input's gradient would then be reduced over a `heads`-times larger
    /// broadcast (496 ms against 400 ms for forward + backward), so training splits instead,
    /// and so does every backend but flex (see [`runs_on_flex`]).
    fn project_heads(&self, x: Tensor<3>, linear: &Linear, heads: usize) -> Tensor<4> {
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

/// Sliding-window band for queries at `first_query..` over keys at `first_key..`: `true` where
/// the key is `window` or more positions before the query.
fn sliding_window_mask(
    first_query: usize,
    new: usize,
    first_key: usize,
    total: usize,
    window: usize,
    device: &Device,
) -> Tensor<4, Bool> {
    let values: Vec<bool> = (0..new)
        .flat_map(|q| (0..total).map(move |k| first_key + k + window <= first_query + q))
        .collect();
    Tensor::<2, Bool>::from_data(TensorData::new(values, [new, total]), device)
        .reshape([1, 1, new, total])
}

/// Whether `device` (or the device under its autodiff) is flex, where two choices pay off that
/// were measured nowhere else:
/// - Where the flash kernel cannot run (a float mask that needs a gradient, or this crate's
///   `flex` feature off), Burn's fused attention op is a kernel whose memory does not grow with `seq_q × seq_k`
///   (it tiles keys with an online softmax above 256 Ki score elements per head, and at 8192
///   tokens runs in 2.5 s where the chunked path takes 4.6 s), so it needs no chunked path.
///   Other backends may materialise the scores (ndarray always does).
/// - Head-major projections (`project_heads`) feed its attention kernel faster; on ndarray
///   they are slightly slower than a `Linear` and a split.
///
/// Burn exposes no backend query that compiles whatever backends are enabled, hence the
/// device's `Debug` form (a test pins it).
fn runs_on_flex(device: &Device) -> bool {
    format!("{:?}", device.clone().inner()).starts_with("Device<Flex")
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
    let zeros = Tensor::<4>::zeros([batch, heads, 1, head_dim], &x.device());
    Tensor::cat(vec![x, zeros], 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pins the `Debug` form `runs_on_flex` reads, so that a Burn upgrade that
    /// changes it fails here rather than silently sending flex to the slower chunked path.
    #[test]
    fn flex_is_recognised_and_ndarray_is_not() {
        assert!(runs_on_flex(&Device::flex()));
        assert!(runs_on_flex(&Device::flex().autodiff()));
        #[allow(deprecated)]
        let ndarray = Device::ndarray();
        assert!(!runs_on_flex(&ndarray));
    }
}
