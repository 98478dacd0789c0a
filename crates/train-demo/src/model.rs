//! A small pre-LayerNorm Transformer built from `mha::MultiHeadAttention`: encoder-only,
//! decoder-only or encoder-decoder, with learned or rotary positions and, optionally, a
//! previous-token embedding.

use burn::config::Config;
use burn::module::Module;
use burn::nn::{
    Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig, Linear, LinearConfig,
};
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Int, Tensor};
use mha::{
    CrossAttentionCache, KvCache, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig,
    NeedWeights, RopeConfig,
};

use crate::tasks::Architecture;

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
    /// Replace every attention output with zeros (ablation).
    pub no_attention: bool,
    /// Rotary positions in every self-attention instead of learned position embeddings.
    pub rotary: bool,
    /// Add an embedding of the previous token to each position's input (a one-step token
    /// shift, like the "smeared keys" of Olsson et al. 2022 or the short convolutions of
    /// Zoology's models). It hands every position the token before it, which an induction
    /// circuit otherwise has to learn with a previous-token head first. Default: false.
    #[config(default = false)]
    pub token_shift: bool,
}

/// Self-attention (and, in a decoder of an encoder-decoder, cross-attention) then an MLP, each
/// behind a LayerNorm and a residual connection.
#[derive(Module, Debug)]
pub struct Block {
    attention_norm: LayerNorm,
    attention: MultiHeadAttention,
    cross_norm: Option<LayerNorm>,
    cross_attention: Option<MultiHeadAttention>,
    mlp_norm: LayerNorm,
    mlp_in: Linear,
    mlp_out: Linear,
    causal: bool,
    no_attention: bool,
}

/// Attention weights of one forward, for the heatmaps: `[batch, heads, seq_q, seq_k]` for each
/// layer, labelled.
pub type LayerWeights = Vec<(String, Tensor<4>)>;

impl Block {
    fn new(config: &TransformerConfig, causal: bool, cross: bool, device: &Device) -> Self {
        let d = config.d_model;
        let attention = || {
            MultiHeadAttentionConfig::new(d, config.heads).with_n_kv_heads(Some(config.kv_heads))
        };
        let rope = config.rotary.then(RopeConfig::new);
        Self {
            attention_norm: LayerNormConfig::new(d).init(device),
            attention: attention().with_rope(rope).init(device),
            cross_norm: cross.then(|| LayerNormConfig::new(d).init(device)),
            cross_attention: cross.then(|| attention().init(device)),
            mlp_norm: LayerNormConfig::new(d).init(device),
            mlp_in: LinearConfig::new(d, 4 * d).init(device),
            mlp_out: LinearConfig::new(4 * d, d).init(device),
            causal,
            no_attention: config.no_attention,
        }
    }

    fn attend(
        &self,
        attention: &MultiHeadAttention,
        input: MhaInput,
        label: &str,
        weights: &mut Option<LayerWeights>,
    ) -> Tensor<3> {
        let need = if weights.is_some() {
            NeedWeights::PerHead
        } else {
            NeedWeights::No
        };
        let output = attention.forward(input.need_weights(need));
        if let (Some(store), Some(w)) = (weights.as_mut(), output.weights) {
            store.push((label.to_string(), w.per_head().expect("per-head weights")));
        }
        if self.no_attention {
            // The ablation: nothing flows between positions.
            output.context.zeros_like()
        } else {
            output.context
        }
    }

    fn forward(
        &self,
        x: Tensor<3>,
        memory: Option<&Tensor<3>>,
        label: &str,
        weights: &mut Option<LayerWeights>,
    ) -> Tensor<3> {
        let normed = self.attention_norm.forward(x.clone());
        let mut input = MhaInput::self_attn(normed);
        if self.causal {
            input = input.causal();
        }
        let x = x + self.attend(&self.attention, input, &format!("{label} self"), weights);
        let x = match (&self.cross_attention, &self.cross_norm, memory) {
            (Some(cross), Some(norm), Some(memory)) => {
                let input = MhaInput::new(norm.forward(x.clone()), memory.clone(), memory.clone());
                x.clone() + self.attend(cross, input, &format!("{label} cross"), weights)
            }
            _ => x,
        };
        let hidden = gelu(self.mlp_in.forward(self.mlp_norm.forward(x.clone())));
        x + self.mlp_out.forward(hidden)
    }
}

impl Block {
    /// [`forward`](Self::forward) for the new tokens only, with this block's self-attention
    /// cache and the memory's cross-attention cache.
    fn forward_cached(
        &self,
        x: Tensor<3>,
        cache: &mut KvCache,
        cross: Option<&CrossAttentionCache>,
    ) -> Tensor<3> {
        let silence = |context: Tensor<3>| {
            if self.no_attention {
                context.zeros_like()
            } else {
                context
            }
        };
        let normed = self.attention_norm.forward(x.clone());
        let attended = self
            .attention
            .forward_cached(MhaInput::self_attn(normed).causal(), cache)
            .expect("an unbounded cache accepts every step");
        let x = x + silence(attended.context);
        let x = match (&self.cross_attention, &self.cross_norm, cross) {
            (Some(attention), Some(norm), Some(memory)) => {
                let output = attention.forward_cross_cached(
                    norm.forward(x.clone()),
                    memory,
                    NeedWeights::No,
                );
                x + silence(output.context)
            }
            _ => x,
        };
        let hidden = gelu(self.mlp_in.forward(self.mlp_norm.forward(x.clone())));
        x + self.mlp_out.forward(hidden)
    }
}

/// Incremental decoding: one KV cache per decoder block, the memory projected once for each
/// cross-attention, and the next position.
pub struct DecodeState {
    caches: Vec<KvCache>,
    cross: Vec<Option<CrossAttentionCache>>,
    position: usize,
    /// The last token fed, `[batch, 1]`: the previous token of the next step's first one.
    last_token: Option<Tensor<2, Int>>,
}

#[derive(Module, Debug)]
pub struct Transformer {
    token_embedding: Embedding,
    position_embedding: Option<Embedding>,
    /// `vocab + 1` rows: the last one stands for "no previous token".
    previous_token_embedding: Option<Embedding>,
    encoder: Vec<Block>,
    decoder: Vec<Block>,
    encoder_norm: Option<LayerNorm>,
    final_norm: LayerNorm,
    head: Linear,
}

impl TransformerConfig {
    pub fn init(&self, device: &Device) -> Transformer {
        let (encoder_layers, decoder_layers, cross) = match self.architecture {
            Architecture::Encoder => (self.layers, 0, false),
            Architecture::Decoder => (0, self.layers, false),
            Architecture::EncoderDecoder => (self.layers, self.layers, true),
        };
        let embedding = |n| {
            EmbeddingConfig::new(n, self.d_model)
                .with_initializer(Initializer::Normal {
                    mean: 0.0,
                    std: 0.02,
                })
                .init(device)
        };
        Transformer {
            token_embedding: embedding(self.vocab),
            position_embedding: (!self.rotary).then(|| embedding(self.max_len)),
            previous_token_embedding: self.token_shift.then(|| embedding(self.vocab + 1)),
            encoder: (0..encoder_layers)
                .map(|_| Block::new(self, false, false, device))
                .collect(),
            decoder: (0..decoder_layers)
                .map(|_| Block::new(self, true, cross, device))
                .collect(),
            encoder_norm: cross.then(|| LayerNormConfig::new(self.d_model).init(device)),
            final_norm: LayerNormConfig::new(self.d_model).init(device),
            head: LinearConfig::new(self.d_model, self.vocab).init(device),
        }
    }
}

impl Transformer {
    fn embed(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        self.embed_from(tokens, 0, None)
    }

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

    /// The encoder's output for `source` (normed for cross-attention), if there is an encoder.
    fn encode(
        &self,
        source: Option<Tensor<2, Int>>,
        weights: &mut Option<LayerWeights>,
    ) -> Option<Tensor<3>> {
        let mut memory = source.map(|tokens| self.embed(tokens));
        for (index, block) in self.encoder.iter().enumerate() {
            let x = memory.take().expect("encoder input");
            memory = Some(block.forward(x, None, &format!("encoder {index}"), weights));
        }
        match &self.encoder_norm {
            Some(norm) => memory.map(|m| norm.forward(m)),
            None => memory,
        }
    }

    /// Starts greedy decoding: encodes the source once and projects it for every
    /// cross-attention.
    pub fn start_decoding(&self, source: Option<Tensor<2, Int>>) -> DecodeState {
        let memory = self.encode(source, &mut None);
        let cross = self
            .decoder
            .iter()
            .map(|block| match (&block.cross_attention, &memory) {
                (Some(attention), Some(memory)) => {
                    Some(attention.cross_attention_cache(memory.clone(), memory.clone()))
                }
                _ => None,
            })
            .collect();
        DecodeState {
            caches: self.decoder.iter().map(|_| KvCache::new()).collect(),
            cross,
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
        let mut x = self.embed_from(tokens, state.position, previous);
        state.position += new;
        for ((block, cache), cross) in self.decoder.iter().zip(&mut state.caches).zip(&state.cross)
        {
            x = block.forward_cached(x, cache, cross.as_ref());
        }
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
        let memory = self.encode(source, weights);
        let output = match decoder_input {
            Some(tokens) => {
                let mut x = self.embed(tokens);
                for (index, block) in self.decoder.iter().enumerate() {
                    x = block.forward(x, memory.as_ref(), &format!("decoder {index}"), weights);
                }
                x
            }
            None => memory.expect("an encoder-only model reads the source"),
        };
        self.head.forward(self.final_norm.forward(output))
    }
}
