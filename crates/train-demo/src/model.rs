//! The demo's models, built from the library's Transformer layers (`mha::transformer`), pre-norm:
//! an encoder ([`TransformerEncoder`]), a decoder-only model (a causal [`TransformerEncoder`])
//! or an encoder-decoder ([`TransformerDecoder`] over the encoder's output); around them the
//! token embedding, learned or rotary positions, optionally a previous-token embedding, a final
//! norm and the output head. An encoder may also be attention layers alone, without feed-forward
//! blocks (the pair task's).

use burn::config::Config;
use burn::module::Module;
use burn::nn::LinearConfig;
use burn::nn::{Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig, Linear};
use burn::tensor::{Bool, Device, Int, Tensor};
use mha::transformer::{
    TransformerDecoder, TransformerDecoderCache, TransformerDecoderConfig, TransformerDecoderInput,
    TransformerEncoder, TransformerEncoderCache, TransformerEncoderConfig, TransformerEncoderInput,
};
use mha::{MhaInput, MultiHeadAttention, MultiHeadAttentionConfig, NeedWeights, RopeConfig};

use crate::tasks::Architecture;

mod paged;

pub use paged::{StepRun, token_row};

/// Sizes of the model; saved with every checkpoint, which refuses to load into another size.
#[derive(Config, Debug, PartialEq)]
pub struct TransformerConfig {
    pub architecture: Architecture,
    pub vocab: usize,
    pub max_len: usize,
    pub d_model: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// Layers of each stack (the encoder's and the decoder's).
    pub layers: usize,
    /// The ablation: no information moves between positions. Every self-attention sees only
    /// its own position (a window of 1) and every cross-attention no memory position (its
    /// memory fully padded, so its output is zero).
    pub no_attention: bool,
    /// Rotary positions in every self-attention instead of learned position embeddings.
    pub rotary: bool,
    /// Add an embedding of the previous token to each position's input (a one-step token
    /// shift, like the "smeared keys" of Olsson et al. 2022 or the short convolutions of
    /// Zoology's models). It hands every position the token before it, which an induction
    /// circuit otherwise has to learn with a previous-token head first. Default: false.
    #[config(default = false)]
    pub token_shift: bool,
    /// A feed-forward block after every attention (true), or attention layers alone (false, an
    /// encoder only): the pair task's model, whose linear readout then sees exactly what the
    /// heads carry, so that one head cannot stand in for two. Default: true.
    #[config(default = true)]
    pub feed_forward: bool,
}

/// Attention weights of one forward, for the heatmaps: `[batch, heads, seq_q, seq_k]` for each
/// layer, labelled.
pub type LayerWeights = Vec<(String, Tensor<4>)>;

/// Incremental decoding state: the stacks' KV caches and the next position.
pub struct DecodeState {
    cache: StackCache,
    /// The encoder's output for the cross-attentions, `[batch, seq_source, d_model]`.
    memory: Option<Tensor<3>>,
    position: usize,
    /// The last token fed, `[batch, 1]`: the previous token of the next step's first one.
    last_token: Option<Tensor<2, Int>>,
}

enum StackCache {
    DecoderOnly(TransformerEncoderCache),
    EncoderDecoder(TransformerDecoderCache),
}

/// A pre-norm self-attention layer without a feed-forward block: `x + attention(norm(x))`.
#[derive(Module, Debug)]
pub struct AttentionLayer {
    norm: LayerNorm,
    attention: MultiHeadAttention,
}

impl AttentionLayer {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let normed = self.norm.forward(x.clone());
        x + self.attention.forward(MhaInput::self_attn(normed)).context
    }
}

#[derive(Module, Debug)]
pub struct Transformer {
    token_embedding: Embedding,
    position_embedding: Option<Embedding>,
    /// `vocab + 1` rows: the last one stands for "no previous token".
    previous_token_embedding: Option<Embedding>,
    /// Bidirectional, over the source (encoder and encoder-decoder models).
    encoder: Option<TransformerEncoder>,
    /// Bidirectional attention layers alone, over the source (an encoder without feed-forward
    /// blocks); empty otherwise.
    attention_layers: Vec<AttentionLayer>,
    /// Causal, over the decoder input (decoder-only models).
    causal_stack: Option<TransformerEncoder>,
    /// Causal self-attention and cross-attention to the encoder's output.
    decoder: Option<TransformerDecoder>,
    encoder_norm: Option<LayerNorm>,
    final_norm: LayerNorm,
    head: Linear,
    no_attention: bool,
}

impl TransformerConfig {
    fn window(&self) -> Option<usize> {
        self.no_attention.then_some(1)
    }

    fn encoder(&self, causal: bool) -> TransformerEncoderConfig {
        TransformerEncoderConfig::new(self.d_model, 4 * self.d_model, self.heads, self.layers)
            .with_dropout(0.0)
            .with_norm_first(true)
            .with_n_kv_heads(Some(self.kv_heads))
            .with_rope(self.rotary.then(RopeConfig::new))
            .with_window(self.window())
            .with_causal(causal)
    }

    fn decoder(&self) -> TransformerDecoderConfig {
        TransformerDecoderConfig::new(self.d_model, 4 * self.d_model, self.heads, self.layers)
            .with_dropout(0.0)
            .with_norm_first(true)
            .with_n_kv_heads(Some(self.kv_heads))
            .with_rope(self.rotary.then(RopeConfig::new))
            .with_window(self.window())
    }

    /// The layers of an encoder without feed-forward blocks.
    fn attention_layers(&self, device: &Device) -> Vec<AttentionLayer> {
        let attention = MultiHeadAttentionConfig::new(self.d_model, self.heads)
            .with_n_kv_heads(Some(self.kv_heads))
            .with_rope(self.rotary.then(RopeConfig::new))
            .with_window(self.window());
        (0..self.layers)
            .map(|_| AttentionLayer {
                norm: LayerNormConfig::new(self.d_model).init(device),
                attention: attention.init(device),
            })
            .collect()
    }

    pub fn init(&self, device: &Device) -> Transformer {
        let embedding = |n| {
            EmbeddingConfig::new(n, self.d_model)
                .with_initializer(Initializer::Normal {
                    mean: 0.0,
                    std: 0.02,
                })
                .init(device)
        };
        let attention_only = !self.feed_forward && self.architecture == Architecture::Encoder;
        let (encoder, causal_stack, decoder) = match self.architecture {
            Architecture::Encoder if attention_only => (None, None, None),
            Architecture::Encoder => (Some(self.encoder(false).init(device)), None, None),
            Architecture::Decoder => (None, Some(self.encoder(true).init(device)), None),
            Architecture::EncoderDecoder => (
                Some(self.encoder(false).init(device)),
                None,
                Some(self.decoder().init(device)),
            ),
        };
        let cross = decoder.is_some();
        Transformer {
            token_embedding: embedding(self.vocab),
            position_embedding: (!self.rotary).then(|| embedding(self.max_len)),
            previous_token_embedding: self.token_shift.then(|| embedding(self.vocab + 1)),
            encoder,
            attention_layers: if attention_only {
                self.attention_layers(device)
            } else {
                Vec::new()
            },
            causal_stack,
            decoder,
            encoder_norm: cross.then(|| LayerNormConfig::new(self.d_model).init(device)),
            final_norm: LayerNormConfig::new(self.d_model).init(device),
            head: LinearConfig::new(self.d_model, self.vocab).init(device),
            no_attention: self.no_attention,
        }
    }
}

impl Transformer {
    /// Token plus position (plus previous-token) embeddings, the first token at position
    /// `start`; `previous` `[batch, 1]` is the token before it, if any.
    fn embed_from(
        &self,
        tokens: Tensor<2, Int>,
        start: usize,
        previous: Option<Tensor<2, Int>>,
    ) -> Tensor<3> {
        let [batch, seq] = tokens.dims();
        let device = tokens.device();
        let positions = Tensor::<1, Int>::arange(start as i64..(start + seq) as i64, &device)
            .reshape([1, seq])
            .expand([batch, seq]);
        let mut embedded = self.token_embedding.forward(tokens.clone());
        if let Some(positions_table) = &self.position_embedding {
            embedded = embedded + positions_table.forward(positions);
        }
        if let Some(previous_table) = &self.previous_token_embedding {
            let none = previous_table.weight.dims()[0] as i64 - 1;
            let first =
                previous.unwrap_or_else(|| Tensor::<2, Int>::full([batch, 1], none, &device));
            let shifted = if seq == 1 {
                first
            } else {
                Tensor::cat(vec![first, tokens.narrow(1, 0, seq - 1)], 1)
            };
            embedded = embedded + previous_table.forward(shifted);
        }
        embedded
    }

    /// The encoder's output (normed for cross-attention), if there is an encoder.
    fn encode(&self, source: Option<Tensor<2, Int>>) -> Option<Tensor<3>> {
        if self.encoder.is_none() && self.attention_layers.is_empty() {
            return None;
        }
        let x = self.embed_from(source?, 0, None);
        let memory = match &self.encoder {
            Some(encoder) => encoder.forward(TransformerEncoderInput::new(x)),
            None => self
                .attention_layers
                .iter()
                .fold(x, |x, layer| layer.forward(x)),
        };
        Some(match &self.encoder_norm {
            Some(norm) => norm.forward(memory),
            None => memory,
        })
    }

    /// The decoder's input over `memory`; under the ablation the memory is all padding.
    fn decoder_input(&self, target: Tensor<3>, memory: Tensor<3>) -> TransformerDecoderInput {
        let [batch, seq_memory, _] = memory.dims();
        let device = memory.device();
        let input = TransformerDecoderInput::new(target, memory);
        if self.no_attention {
            input.memory_mask_pad(Tensor::<2, Bool>::full([batch, seq_memory], true, &device))
        } else {
            input
        }
    }

    /// Starts greedy decoding: encodes the source once.
    pub fn start_decoding(&self, source: Option<Tensor<2, Int>>) -> DecodeState {
        let cache = match (&self.causal_stack, &self.decoder) {
            (Some(stack), _) => StackCache::DecoderOnly(stack.new_cache()),
            (None, Some(decoder)) => StackCache::EncoderDecoder(decoder.new_cache()),
            (None, None) => panic!("an encoder-only model does not decode"),
        };
        DecodeState {
            cache,
            memory: self.encode(source),
            position: 0,
            last_token: None,
        }
    }

    /// Feeds the new decoder tokens `[batch, new]` and returns the logits of the last one,
    /// `[batch, vocab]`; each step costs O(length) thanks to the KV caches.
    pub fn decode_step(&self, tokens: Tensor<2, Int>, state: &mut DecodeState) -> Tensor<2> {
        let [batch, new] = tokens.dims();
        let previous = state
            .last_token
            .replace(tokens.clone().narrow(1, new - 1, 1));
        let x = self.embed_from(tokens, state.position, previous);
        state.position += new;
        let x = match (&mut state.cache, &self.causal_stack, &self.decoder) {
            (StackCache::DecoderOnly(cache), Some(stack), _) => {
                stack.forward_cached(TransformerEncoderInput::new(x), cache)
            }
            (StackCache::EncoderDecoder(cache), _, Some(decoder)) => {
                let memory = state
                    .memory
                    .clone()
                    .expect("an encoder-decoder has a memory");
                decoder.forward_cached(self.decoder_input(x, memory), cache)
            }
            _ => unreachable!("the cache matches the model that made it"),
        }
        .expect("an unbounded cache accepts every step");
        let vocab = self.head.weight.dims()[1];
        let last = x.narrow(1, new - 1, 1);
        self.head
            .forward(self.final_norm.forward(last))
            .reshape([batch, vocab])
    }

    /// Logits `[batch, seq, vocab]` over the output sequence: the source's positions for an
    /// encoder, the decoder input's otherwise. `weights`, when given, collects every attention
    /// layer's per-head weights.
    pub fn forward(
        &self,
        source: Option<Tensor<2, Int>>,
        decoder_input: Option<Tensor<2, Int>>,
        weights: &mut Option<LayerWeights>,
    ) -> Tensor<3> {
        if let Some(weights) = weights.as_mut() {
            weights.extend(self.attention_weights(source.clone(), decoder_input.clone()));
        }
        let memory = self.encode(source);
        let output = match (decoder_input, &self.causal_stack, &self.decoder) {
            (Some(tokens), Some(stack), _) => stack.forward(TransformerEncoderInput::new(
                self.embed_from(tokens, 0, None),
            )),
            (Some(tokens), None, Some(decoder)) => {
                let target = self.embed_from(tokens, 0, None);
                let memory = memory.expect("an encoder-decoder reads a source");
                decoder.forward(self.decoder_input(target, memory))
            }
            _ => memory.expect("an encoder-only model reads the source"),
        };
        self.head.forward(self.final_norm.forward(output))
    }

    /// Every attention layer's per-head weights, for the heatmaps: each layer's input is
    /// rebuilt by running the layers before it, and its attention asked for weights on that
    /// input normed (the layers are pre-norm).
    fn attention_weights(
        &self,
        source: Option<Tensor<2, Int>>,
        decoder_input: Option<Tensor<2, Int>>,
    ) -> LayerWeights {
        let weights = |attention: &MultiHeadAttention, input: MhaInput| {
            let output = attention.forward(input.need_weights(NeedWeights::PerHead));
            let weights = output.weights.expect("weights were asked for");
            (
                output.context,
                weights.per_head().expect("per-head weights"),
            )
        };
        let mut all = Vec::new();
        if let (false, Some(source)) = (self.attention_layers.is_empty(), source.clone()) {
            let mut x = self.embed_from(source, 0, None);
            for (index, layer) in self.attention_layers.iter().enumerate() {
                let input = MhaInput::self_attn(layer.norm.forward(x.clone()));
                let (context, layer_weights) = weights(&layer.attention, input);
                all.push((format!("encoder {index} self"), layer_weights));
                x = x + context;
            }
        }
        let mut stack_weights = |stack: &TransformerEncoder, x: Tensor<3>, label: &str| {
            let input = TransformerEncoderInput::new(x.clone());
            let mut x = x;
            for (index, layer) in stack.layers.iter().enumerate() {
                let mut attention_input =
                    MhaInput::self_attn(layer.attention_norm.forward(x.clone()));
                if layer.causal {
                    attention_input = attention_input.causal();
                }
                all.push((
                    format!("{label} {index} self"),
                    weights(&layer.attention, attention_input).1,
                ));
                x = layer.forward(x, &input);
            }
            x
        };
        let memory = match (&self.encoder, source) {
            (Some(encoder), Some(source)) => {
                let x = stack_weights(encoder, self.embed_from(source, 0, None), "encoder");
                Some(match &self.encoder_norm {
                    Some(norm) => norm.forward(x),
                    None => x,
                })
            }
            _ => None,
        };
        if let (Some(stack), Some(tokens)) = (&self.causal_stack, decoder_input.clone()) {
            stack_weights(stack, self.embed_from(tokens, 0, None), "decoder");
        }
        if let (Some(decoder), Some(tokens), Some(memory)) = (&self.decoder, decoder_input, memory)
        {
            let mut x = self.embed_from(tokens, 0, None);
            let input = self.decoder_input(x.clone(), memory.clone());
            for (index, layer) in decoder.layers.iter().enumerate() {
                let normed = layer.self_attention_norm.forward(x.clone());
                let (context, self_weights) =
                    weights(&layer.self_attention, MhaInput::self_attn(normed).causal());
                all.push((format!("decoder {index} self"), self_weights));
                let after_self = x.clone() + context;
                let normed = layer.cross_attention_norm.forward(after_self);
                let mut cross = MhaInput::new(normed, memory.clone(), memory.clone());
                if self.no_attention {
                    let [batch, seq_memory, _] = memory.dims();
                    let padding =
                        Tensor::<2, Bool>::full([batch, seq_memory], true, &memory.device());
                    cross = cross.key_padding_mask(padding);
                }
                all.push((
                    format!("decoder {index} cross"),
                    weights(&layer.cross_attention, cross).1,
                ));
                x = layer.forward(x, &input);
            }
        }
        all
    }
}
