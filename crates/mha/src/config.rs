//! [`MultiHeadAttentionConfig`]: the sizes and switches of a [`MultiHeadAttention`], their
//! validation, and the parameter initialisation.

use core::fmt;

use burn::config::Config;
use burn::module::Param;
use burn::nn::{DropoutConfig, Initializer, Linear, LinearConfig};
use burn::tensor::{Device, Tensor};

use crate::module::MultiHeadAttention;
use crate::rotary::{Rope, RopeConfig};

/// How the parameters of a [`MultiHeadAttention`] are initialised.
#[derive(Config, Debug, PartialEq)]
pub enum AttentionInitializer {
    /// PyTorch's `nn.MultiheadAttention._reset_parameters`:
    ///
    /// - query/key/value weights: Xavier-uniform. When the key and value inputs have the width
    ///   of the query (PyTorch's packed `in_proj_weight`), the bound is computed over the packed
    ///   `[q; k; v]` matrix, so `fan_out = d_q + 2 * d_kv`; otherwise per projection.
    /// - output weight: `nn.Linear`'s default, `U(-1/sqrt(d_model), 1/sqrt(d_model))`.
    /// - every projection bias: zero.
    /// - `bias_k`/`bias_v` (with `add_bias_kv`): Xavier-normal, `N(0, 1/d_kv)`.
    PyTorch,
    /// One Burn [`Initializer`] for every parameter: the projections' weights and biases, as
    /// Burn's `LinearConfig` applies it, and `bias_k`/`bias_v`.
    Custom(Initializer),
}

/// Configuration to create a [`MultiHeadAttention`] layer using the
/// [init function](MultiHeadAttentionConfig::init).
///
/// The defaults reproduce PyTorch's
/// `nn.MultiheadAttention(embed_dim=d_model, num_heads=n_heads)`.
#[derive(Config, Debug)]
pub struct MultiHeadAttentionConfig {
    /// Width of the query input and of the output (PyTorch's `embed_dim`).
    pub d_model: usize,
    /// Number of query heads. Must divide `d_model`; each head has `d_model / n_heads` features.
    pub n_heads: usize,
    /// Number of key/value heads. `None` (the default) means `n_heads`, plain multi-head
    /// attention; fewer gives grouped-query attention (GQA), `Some(1)` multi-query attention
    /// (MQA). Must divide `n_heads`.
    #[config(default = "None")]
    pub n_kv_heads: Option<usize>,
    /// Width of the key input (PyTorch's `kdim`). Default: `None`, meaning `d_model`.
    #[config(default = "None")]
    pub d_key_input: Option<usize>,
    /// Width of the value input (PyTorch's `vdim`). Default: `None`, meaning `d_model`.
    #[config(default = "None")]
    pub d_value_input: Option<usize>,
    /// Whether the query/key/value and output projections have biases. Default: true.
    #[config(default = true)]
    pub bias: bool,
    /// Dropout probability on the attention weights, applied in training mode on an autodiff
    /// device only (as Burn's `Dropout`). Must lie in `[0, 1)`. Default: 0.0.
    #[config(default = 0.0)]
    pub dropout: f64,
    /// Multiplier of the query-key scores. Default: `None`, meaning `1 / sqrt(head_dim)`.
    /// Must be finite and positive.
    #[config(default = "None")]
    pub scale: Option<f64>,
    /// Append a learned key and value position (`bias_k`, `bias_v`) to every key/value sequence,
    /// as PyTorch's `add_bias_kv`. Default: false.
    #[config(default = false)]
    pub add_bias_kv: bool,
    /// Append an all-zero key and value position to every key/value sequence, after any
    /// `add_bias_kv` position, as PyTorch's `add_zero_attn`. Default: false.
    #[config(default = false)]
    pub add_zero_attn: bool,
    /// Use the "quiet" softmax `exp(x_i) / (1 + sum_j exp(x_j))`, which lets a head attend to
    /// nothing (Burn's `quiet_softmax`). Default: false.
    #[config(default = false)]
    pub quiet_softmax: bool,
    /// Rotary position embeddings applied to the query and key heads. Default: `None`.
    /// Needs an even `head_dim`.
    #[config(default = "None")]
    pub rope: Option<RopeConfig>,
    /// Add ALiBi's per-head linear distance penalty to the scores. Default: false.
    #[config(default = false)]
    pub alibi: bool,
    /// Sliding-window attention: each query sees the `window` positions up to and including
    /// its own (Mistral's `sliding_window`; FlashAttention's `window_size = (window - 1, 0)`
    /// with causal masking, `(window - 1, window - 1)` without). Applies to every forward, cached
    /// or not. Must be positive. Default: `None`, no window.
    #[config(default = "None")]
    pub window: Option<usize>,
    /// Logit soft-capping: scores become `softcap · tanh(score / softcap)` after scaling and
    /// before masks and biases (Gemma 2; Burn's `AttentionModuleOptions::softcap`). Must be
    /// finite and positive. Default: `None`.
    #[config(default = "None")]
    pub softcap: Option<f64>,
    /// Learned attention sinks: one logit per query head that joins every softmax's denominator
    /// (as gpt-oss), so that a head may attend to nothing; trained with the rest (initialised
    /// to 0). Default: false.
    #[config(default = false)]
    pub attention_sinks: bool,
    /// How the parameters are initialised. Default: [`AttentionInitializer::PyTorch`].
    #[config(default = "AttentionInitializer::PyTorch")]
    pub initializer: AttentionInitializer,
}

/// A [`MultiHeadAttentionConfig`] that breaks a rule: which field, and what the rule is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The offending field of [`MultiHeadAttentionConfig`].
    pub field: &'static str,
    /// The rule it breaks, with the values involved.
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid MultiHeadAttentionConfig: `{}` {}",
            self.field, self.reason
        )
    }
}

impl core::error::Error for ConfigError {}

/// The sizes a valid configuration resolves to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ResolvedSizes {
    pub head_dim: usize,
    pub n_kv_heads: usize,
    pub d_key_input: usize,
    pub d_value_input: usize,
}

impl MultiHeadAttentionConfig {
    /// Checks every rule of the configuration, returning the first one broken.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.resolve().map(|_| ())
    }

    // One rule after another, each a few lines: longer than most functions, kept whole so
    // that every rule of the configuration is read in one place.
    pub(crate) fn resolve(&self) -> Result<ResolvedSizes, ConfigError> {
        let error = |field, reason: String| Err(ConfigError { field, reason });
        if self.d_model == 0 {
            return error("d_model", "must be positive, got 0".into());
        }
        if self.n_heads == 0 {
            return error("n_heads", "must be positive, got 0".into());
        }
        if !self.d_model.is_multiple_of(self.n_heads) {
            return error(
                "n_heads",
                format!(
                    "must divide `d_model`: d_model = {} is not divisible by n_heads = {}",
                    self.d_model, self.n_heads
                ),
            );
        }
        let n_kv_heads = self.n_kv_heads.unwrap_or(self.n_heads);
        if n_kv_heads == 0 {
            return error("n_kv_heads", "must be positive, got 0".into());
        }
        if !self.n_heads.is_multiple_of(n_kv_heads) {
            return error(
                "n_kv_heads",
                format!(
                    "must divide `n_heads`: n_heads = {} is not divisible by n_kv_heads = {}",
                    self.n_heads, n_kv_heads
                ),
            );
        }
        let d_key_input = self.d_key_input.unwrap_or(self.d_model);
        if d_key_input == 0 {
            return error("d_key_input", "must be positive, got 0".into());
        }
        let d_value_input = self.d_value_input.unwrap_or(self.d_model);
        if d_value_input == 0 {
            return error("d_value_input", "must be positive, got 0".into());
        }
        if !self.dropout.is_finite() || !(0.0..1.0).contains(&self.dropout) {
            return error(
                "dropout",
                format!("must lie in [0, 1), got {}", self.dropout),
            );
        }
        if let Some(scale) = self.scale
            && (!scale.is_finite() || scale <= 0.0)
        {
            return error("scale", format!("must be finite and positive, got {scale}"));
        }
        let head_dim = self.d_model / self.n_heads;
        if self.rope.is_some() && !head_dim.is_multiple_of(2) {
            return error(
                "rope",
                format!("needs an even head_dim (d_model / n_heads), got {head_dim}"),
            );
        }
        if let Some(rope) = &self.rope {
            rope.validate().map_err(|reason| ConfigError {
                field: "rope",
                reason,
            })?;
        }
        if self.attention_sinks && self.quiet_softmax {
            return error(
                "attention_sinks",
                "cannot go with `quiet_softmax`, which is a sink of logit 0 already".into(),
            );
        }
        if self.window == Some(0) {
            return error("window", "must be positive, got 0".into());
        }
        if let Some(softcap) = self.softcap
            && (!softcap.is_finite() || softcap <= 0.0)
        {
            return error(
                "softcap",
                format!("must be finite and positive, got {softcap}"),
            );
        }
        Ok(ResolvedSizes {
            head_dim: self.d_model / self.n_heads,
            n_kv_heads,
            d_key_input,
            d_value_input,
        })
    }

    /// Initializes a [`MultiHeadAttention`] module, or says which field breaks which rule.
    pub fn try_init(&self, device: &Device) -> Result<MultiHeadAttention, ConfigError> {
        let sizes = self.resolve()?;
        let d_kv = sizes.n_kv_heads * sizes.head_dim;
        let packed_fan_out = self.d_model + 2 * d_kv;
        let packed = sizes.d_key_input == self.d_model && sizes.d_value_input == self.d_model;

        let input_projection = |d_input: usize, d_output: usize| match &self.initializer {
            AttentionInitializer::PyTorch => {
                let fan_out = if packed { packed_fan_out } else { d_output };
                pytorch_linear(
                    d_input,
                    d_output,
                    Initializer::XavierUniform { gain: 1.0 },
                    Some(fan_out),
                    self.bias,
                    device,
                )
            }
            AttentionInitializer::Custom(initializer) => LinearConfig::new(d_input, d_output)
                .with_bias(self.bias)
                .with_initializer(initializer.clone())
                .init(device),
        };
        let output = match &self.initializer {
            AttentionInitializer::PyTorch => pytorch_linear(
                self.d_model,
                self.d_model,
                // kaiming_uniform(a = sqrt(5)) on [out, in] is U(-1/sqrt(in), 1/sqrt(in)).
                Initializer::KaimingUniform {
                    gain: 1.0 / 3.0f64.sqrt(),
                    fan_out_only: false,
                },
                None,
                self.bias,
                device,
            ),
            AttentionInitializer::Custom(initializer) => {
                LinearConfig::new(self.d_model, self.d_model)
                    .with_bias(self.bias)
                    .with_initializer(initializer.clone())
                    .init(device)
            }
        };
        let kv_bias = || {
            let initializer = match &self.initializer {
                AttentionInitializer::PyTorch => Initializer::XavierNormal { gain: 1.0 },
                AttentionInitializer::Custom(initializer) => initializer.clone(),
            };
            initializer.init_with([d_kv], Some(d_kv), Some(d_kv), device)
        };

        Ok(MultiHeadAttention {
            query: input_projection(self.d_model, self.d_model),
            key: input_projection(sizes.d_key_input, d_kv),
            value: input_projection(sizes.d_value_input, d_kv),
            output,
            bias_k: self.add_bias_kv.then(kv_bias),
            bias_v: self.add_bias_kv.then(kv_bias),
            dropout: DropoutConfig::new(self.dropout).init(),
            d_model: self.d_model,
            n_heads: self.n_heads,
            n_kv_heads: sizes.n_kv_heads,
            head_dim: sizes.head_dim,
            d_key_input: sizes.d_key_input,
            d_value_input: sizes.d_value_input,
            scale: self.scale.unwrap_or(1.0 / (sizes.head_dim as f64).sqrt()),
            custom_scale: self.scale.is_some(),
            add_zero_attn: self.add_zero_attn,
            quiet_softmax: self.quiet_softmax,
            rope: self.rope.clone().map(Rope::new),
            alibi: self.alibi,
            window: self.window,
            softcap: self.softcap,
            sinks: self
                .attention_sinks
                .then(|| Initializer::Zeros.init([self.n_heads], device)),
        })
    }

    /// Initializes a [`MultiHeadAttention`] module.
    ///
    /// # Panics
    ///
    /// Panics with the [`ConfigError`] message when the configuration breaks a rule; see
    /// [`try_init`](Self::try_init) for the non-panicking form.
    pub fn init(&self, device: &Device) -> MultiHeadAttention {
        self.try_init(device)
            .unwrap_or_else(|error| panic!("{error}"))
    }
}

/// A [`Linear`] whose weight follows `weight_init` (with an explicit `fan_out` where PyTorch
/// computes it over a packed matrix) and whose bias starts at zero, as in PyTorch's MHA.
fn pytorch_linear(
    d_input: usize,
    d_output: usize,
    weight_init: Initializer,
    fan_out: Option<usize>,
    bias: bool,
    device: &Device,
) -> Linear {
    let weight: Param<Tensor<2>> = weight_init.init_with(
        [d_input, d_output],
        Some(d_input),
        Some(fan_out.unwrap_or(d_output)),
        device,
    );
    let bias = bias.then(|| Initializer::Zeros.init([d_output], device));
    Linear { weight, bias }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(config: MultiHeadAttentionConfig) -> ConfigError {
        config
            .validate()
            .expect_err("configuration should be refused")
    }

    // Longer than most: a table of (configuration, field, rule) rows; it grows by a row per rule.
    #[test]
    fn every_rule_names_its_field() {
        let base = || MultiHeadAttentionConfig::new(16, 4);
        assert!(base().validate().is_ok());
        let cases = [
            (
                MultiHeadAttentionConfig::new(0, 4),
                "d_model",
                "must be positive",
            ),
            (
                MultiHeadAttentionConfig::new(16, 0),
                "n_heads",
                "must be positive",
            ),
            (
                MultiHeadAttentionConfig::new(16, 3),
                "n_heads",
                "not divisible by n_heads = 3",
            ),
            (
                base().with_n_kv_heads(Some(0)),
                "n_kv_heads",
                "must be positive",
            ),
            (
                base().with_n_kv_heads(Some(3)),
                "n_kv_heads",
                "not divisible by n_kv_heads = 3",
            ),
            (
                base().with_d_key_input(Some(0)),
                "d_key_input",
                "must be positive",
            ),
            (
                base().with_d_value_input(Some(0)),
                "d_value_input",
                "must be positive",
            ),
            (
                base().with_dropout(1.0),
                "dropout",
                "must lie in [0, 1), got 1",
            ),
            (base().with_dropout(-0.1), "dropout", "must lie in [0, 1)"),
            (
                base().with_dropout(f64::NAN),
                "dropout",
                "must lie in [0, 1)",
            ),
            (base().with_scale(Some(0.0)), "scale", "finite and positive"),
            (
                base().with_scale(Some(-1.0)),
                "scale",
                "finite and positive",
            ),
            (
                base().with_scale(Some(f64::INFINITY)),
                "scale",
                "finite and positive",
            ),
            (base().with_window(Some(0)), "window", "must be positive"),
            (
                base().with_softcap(Some(0.0)),
                "softcap",
                "finite and positive",
            ),
            (
                base().with_softcap(Some(f64::NAN)),
                "softcap",
                "finite and positive",
            ),
            (
                base().with_rope(Some(RopeConfig::new().with_theta(1.0))),
                "rope",
                "theta must be finite and greater than 1",
            ),
        ];
        for (config, field, rule) in cases {
            let error = refused(config);
            assert_eq!(error.field, field, "{error}");
            let message = error.to_string();
            assert!(message.contains(&format!("`{field}`")), "{message}");
            assert!(message.contains(rule), "{message} should mention {rule:?}");
        }
    }

    #[test]
    #[should_panic(expected = "invalid MultiHeadAttentionConfig: `n_heads` must divide `d_model`")]
    fn init_panics_with_the_config_error() {
        MultiHeadAttentionConfig::new(10, 4).init(&Device::flex());
    }

    #[test]
    fn gqa_and_cross_widths_resolve() {
        let sizes = MultiHeadAttentionConfig::new(32, 8)
            .with_n_kv_heads(Some(2))
            .with_d_key_input(Some(12))
            .resolve()
            .unwrap();
        assert_eq!(
            sizes,
            ResolvedSizes {
                head_dim: 4,
                n_kv_heads: 2,
                d_key_input: 12,
                d_value_input: 32
            }
        );
    }

    #[test]
    fn pytorch_initialisation_has_the_expected_bounds_and_zero_biases() {
        let device = Device::flex();
        device.seed(7);
        let mha = MultiHeadAttentionConfig::new(64, 4)
            .with_add_bias_kv(true)
            .init(&device);
        let max_abs = |t: Tensor<2>| t.abs().max().into_scalar::<f32>();
        // Packed in-projection: xavier bound sqrt(6 / (64 + 192)).
        let bound = (6.0f32 / 256.0).sqrt();
        for projection in [&mha.query, &mha.key, &mha.value] {
            let largest = max_abs(projection.weight.val());
            assert!(
                largest <= bound && largest > 0.8 * bound,
                "{largest} vs {bound}"
            );
            let bias = projection.bias.as_ref().unwrap().val();
            assert_eq!(bias.abs().max().into_scalar::<f32>(), 0.0);
        }
        let out_bound = 1.0 / 8.0;
        let largest = max_abs(mha.output.weight.val());
        assert!(largest <= out_bound && largest > 0.8 * out_bound);
        let bias_k = mha.bias_k.as_ref().unwrap().val();
        let std = bias_k
            .clone()
            .powi_scalar(2)
            .mean()
            .sqrt()
            .into_scalar::<f32>();
        assert!((std - 0.125).abs() < 0.05, "bias_k std {std}");
    }
}
