//! Key/value caches for incremental decoding: projected keys and values are stored, never
//! queries, so a step that feeds `n` new tokens costs `O(n · cached length)`.

use core::fmt;

use burn::module::ParamId;
use burn::tensor::{Bool, Device, Tensor};

use crate::mask::Positions;

/// How many key/value positions a [`KvCache`] keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheLimit {
    /// Every position (the default).
    Unbounded,
    /// At most this many positions; a step that would exceed it is refused with
    /// [`CacheError::CapacityExceeded`].
    Fixed(usize),
    /// Sliding-window attention: each query sees itself and the `window - 1` positions before
    /// it; older entries are evicted (as candle's rotating cache).
    SlidingWindow(usize),
}

/// Why a cached forward was refused. The cache is left unchanged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheError {
    /// The new tokens would take a [`CacheLimit::Fixed`] cache past its capacity.
    CapacityExceeded {
        /// The cache's capacity.
        capacity: usize,
        /// Positions already cached.
        cached: usize,
        /// Positions this step adds.
        new: usize,
    },
    /// The batch size differs from the one the cache was started with.
    BatchChanged {
        /// The cache's batch size.
        cached: usize,
        /// This step's.
        new: usize,
    },
    /// The `key_padding_mask` covers neither the new keys nor cached plus new keys.
    PaddingWidth {
        /// The mask's width.
        width: usize,
        /// Positions already cached.
        cached: usize,
        /// Positions this step adds.
        new: usize,
    },
    /// The cache holds keys and values of another attention module.
    OtherModule {
        /// The module that filled the cache.
        cached: CacheOwner,
        /// The module of this step.
        module: CacheOwner,
    },
}

impl fmt::Display for CacheError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::CapacityExceeded {
                capacity,
                cached,
                new,
            } => write!(
                f,
                "KV cache capacity exceeded: {cached} cached + {new} new positions > capacity \
                 {capacity} (use CacheLimit::SlidingWindow to evict old positions)"
            ),
            Self::BatchChanged { cached, new } => write!(
                f,
                "KV cache batch size changed mid-sequence: the cache holds batch {cached}, this \
                 step has batch {new} (start a new cache with KvCache::reset)"
            ),
            Self::PaddingWidth { width, cached, new } => write!(
                f,
                "`key_padding_mask` has width {width}; under a KV cache it covers the new keys \
                 ({new}) or cached plus new keys ({})",
                cached + new
            ),
            Self::OtherModule { cached, module } => write!(
                f,
                "KV cache filled by another attention module ({cached}) than this step's \
                 ({module}); each layer needs its own cache"
            ),
        }
    }
}

impl core::error::Error for CacheError {}

/// The projected keys and values of a self-attention layer's past positions.
///
/// ```
/// use burn::tensor::{Device, Distribution, Tensor};
/// use mha::{KvCache, MhaInput, MultiHeadAttentionConfig};
///
/// let device = Device::flex();
/// let attention = MultiHeadAttentionConfig::new(16, 4).init(&device);
/// let mut cache = KvCache::new();
/// let prompt = Tensor::<3>::random([1, 5, 16], Distribution::Default, &device);
/// attention.forward_cached(MhaInput::self_attn(prompt).causal(), &mut cache).unwrap();
/// let next = Tensor::<3>::random([1, 1, 16], Distribution::Default, &device);
/// let output = attention.forward_cached(MhaInput::self_attn(next).causal(), &mut cache).unwrap();
/// assert_eq!(output.context.dims(), [1, 1, 16]);
/// assert_eq!(cache.len(), 6);
/// ```
#[derive(Debug, Clone)]
pub struct KvCache {
    /// `[batch, n_kv_heads, stored, head_dim]`.
    key: Option<Tensor<4>>,
    /// `[batch, n_kv_heads, stored, value_dim]`.
    value: Option<Tensor<4>>,
    /// `[batch, stored]`, `true` = padding; `None` while no step gave a padding mask.
    padding: Option<Tensor<2, Bool>>,
    /// Positions seen since the start (the next token's absolute position).
    seen: usize,
    limit: CacheLimit,
    /// The module whose keys and values the cache holds, once a step stored some.
    owner: Option<CacheOwner>,
}

/// Which attention module filled a cache: its key projection's parameter id and its head
/// sizes. A cache is refused by any other module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheOwner {
    /// The id of the module's key projection weight.
    pub key_weight: ParamId,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Features per key head.
    pub head_dim: usize,
}

impl fmt::Display for CacheOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "key weight {}, {} key/value heads of {} features",
            self.key_weight, self.n_kv_heads, self.head_dim
        )
    }
}

/// A step a [`KvCache`] accepted but has not stored yet: [`KvCache::begin`] checks it without
/// changing the cache, [`KvCache::append`] stores it.
#[derive(Debug)]
pub(crate) struct CacheStep {
    owner: CacheOwner,
    new: usize,
    /// Absolute positions of the new queries and of the first key the step attends to.
    pub positions: Positions,
    /// Padding of the cached plus new keys, `[batch, stored + new]`.
    pub padding: Option<Tensor<2, Bool>>,
    /// Keys the step attends to: cached plus new.
    pub keys: usize,
    /// The sliding window each new query sees through, if the cache has one.
    pub window: Option<usize>,
}

impl Default for KvCache {
    fn default() -> Self {
        Self::new()
    }
}

impl KvCache {
    /// An empty, unbounded cache.
    pub fn new() -> Self {
        Self::with_limit(CacheLimit::Unbounded)
    }

    /// An empty cache with a capacity or a sliding window.
    ///
    /// # Panics
    ///
    /// Panics on a zero capacity or window.
    pub fn with_limit(limit: CacheLimit) -> Self {
        if let CacheLimit::Fixed(0) | CacheLimit::SlidingWindow(0) = limit {
            panic!("KvCache: a capacity or window of 0 positions can hold nothing");
        }
        Self {
            key: None,
            value: None,
            padding: None,
            seen: 0,
            limit,
            owner: None,
        }
    }

    /// Positions fed so far (the absolute position of the next token).
    pub fn len(&self) -> usize {
        self.seen
    }

    /// Whether nothing was fed yet.
    pub fn is_empty(&self) -> bool {
        self.seen == 0
    }

    /// Positions held now (fewer than [`len`](Self::len) once a sliding window evicts).
    pub fn stored(&self) -> usize {
        self.key.as_ref().map_or(0, |key| key.dims()[2])
    }

    /// Empties the cache, keeping its limit.
    pub fn reset(&mut self) {
        *self = Self::with_limit(self.limit);
    }

    /// The capacity or window the cache was made with.
    pub fn limit(&self) -> CacheLimit {
        self.limit
    }

    fn batch(&self) -> Option<usize> {
        self.key.as_ref().map(|key| key.dims()[0])
    }

    /// Checks a step of `new` tokens of `batch` sequences by `owner`, with this step's padding
    /// mask (`[batch, new]` or `[batch, stored + new]`), and says what it attends to. Changes
    /// nothing: a refused step leaves the cache as it was.
    pub(crate) fn begin(
        &self,
        owner: CacheOwner,
        batch: usize,
        new: usize,
        padding: Option<Tensor<2, Bool>>,
        device: &Device,
    ) -> Result<CacheStep, CacheError> {
        if let Some(cached) = self.owner
            && cached != owner
        {
            return Err(CacheError::OtherModule {
                cached,
                module: owner,
            });
        }
        if let Some(cached) = self.batch()
            && cached != batch
        {
            return Err(CacheError::BatchChanged { cached, new: batch });
        }
        if let CacheLimit::Fixed(capacity) = self.limit
            && self.seen + new > capacity
        {
            return Err(CacheError::CapacityExceeded {
                capacity,
                cached: self.seen,
                new,
            });
        }
        let stored = self.stored();
        Ok(CacheStep {
            owner,
            new,
            positions: Positions {
                query: self.seen,
                key: self.seen - stored,
            },
            padding: self.padding_with(padding, batch, new, device)?,
            keys: stored + new,
            window: match self.limit {
                CacheLimit::SlidingWindow(window) => Some(window),
                _ => None,
            },
        })
    }

    /// Stores a step's projected keys and values (`[batch, n_kv_heads, new, head_dim]`) and
    /// returns the cached plus new ones the step attends to. Then evicts what a sliding window
    /// no longer needs: the `window - 1` latest positions are kept for the next token.
    ///
    /// # Panics
    ///
    /// If the keys are not `step`'s new tokens.
    pub(crate) fn append(
        &mut self,
        step: CacheStep,
        key: Tensor<4>,
        value: Tensor<4>,
    ) -> (Tensor<4>, Tensor<4>) {
        let [_, n_kv_heads, new, head_dim] = key.dims();
        assert!(
            new == step.new
                && n_kv_heads == step.owner.n_kv_heads
                && head_dim == step.owner.head_dim,
            "KvCache: appended keys {:?} are not the step's {} new tokens of {}",
            key.dims(),
            step.new,
            step.owner
        );
        let (key, value) = match (self.key.take(), self.value.take()) {
            (Some(past_key), Some(past_value)) => (
                Tensor::cat(vec![past_key, key], 2),
                Tensor::cat(vec![past_value, value], 2),
            ),
            _ => (key, value),
        };
        self.seen += step.new;
        self.owner = Some(step.owner);
        let (mut kept_key, mut kept_value, mut kept_padding) =
            (key.clone(), value.clone(), step.padding);
        if let CacheLimit::SlidingWindow(window) = self.limit {
            let stored = key.dims()[2];
            let keep = (window - 1).min(stored);
            let drop = stored - keep;
            if drop > 0 {
                kept_key = kept_key.narrow(2, drop, keep);
                kept_value = kept_value.narrow(2, drop, keep);
                kept_padding = kept_padding.map(|p| p.narrow(1, drop, keep));
            }
        }
        self.key = Some(kept_key);
        self.value = Some(kept_value);
        self.padding = kept_padding;
        (key, value)
    }

    /// The padding of stored plus new keys, given this step's mask (`[batch, new]` or
    /// `[batch, stored + new]`).
    fn padding_with(
        &self,
        mask: Option<Tensor<2, Bool>>,
        batch: usize,
        new: usize,
        device: &Device,
    ) -> Result<Option<Tensor<2, Bool>>, CacheError> {
        let stored = self.stored();
        let Some(mask) = mask else {
            return Ok(self.padding.clone().map(|past| {
                let none = Tensor::<2, Bool>::zeros([batch, new], device);
                Tensor::cat(vec![past, none], 1)
            }));
        };
        let width = mask.dims()[1];
        if width == stored + new {
            Ok(Some(mask))
        } else if width == new {
            let past = self
                .padding
                .clone()
                .unwrap_or_else(|| Tensor::<2, Bool>::zeros([batch, stored], device));
            Ok(Some(Tensor::cat(vec![past, mask], 1)))
        } else {
            Err(CacheError::PaddingWidth {
                width,
                cached: stored,
                new,
            })
        }
    }
}

/// Keys and values of a fixed memory (an encoder's output), projected once and reused by a
/// decoder's cross-attention at every step. Made by
/// [`MultiHeadAttention::cross_attention_cache`](crate::MultiHeadAttention::cross_attention_cache).
#[derive(Debug, Clone)]
pub struct CrossAttentionCache {
    /// `[batch, n_kv_heads, seq_k (+ appended positions), head_dim]`.
    pub(crate) key: Tensor<4>,
    pub(crate) value: Tensor<4>,
    /// The memory's own length (before `add_bias_kv`/`add_zero_attn` positions).
    pub(crate) seq_k: usize,
    pub(crate) key_padding_mask: Option<Tensor<2, Bool>>,
    /// The module that projected the memory.
    pub(crate) owner: CacheOwner,
}

impl CrossAttentionCache {
    /// The memory's batch size.
    pub fn batch(&self) -> usize {
        self.key.dims()[0]
    }

    /// The memory's length (without the positions `add_bias_kv`/`add_zero_attn` append).
    pub fn len(&self) -> usize {
        self.seq_k
    }

    /// Whether the memory is empty (never: the module refuses an empty memory).
    pub fn is_empty(&self) -> bool {
        self.seq_k == 0
    }

    /// The module that projected the memory.
    pub fn owner(&self) -> CacheOwner {
        self.owner
    }

    /// Ignores memory positions (`[batch, seq_k]`, `true` = padding) at every step.
    ///
    /// # Panics
    ///
    /// If the mask is not `[batch, seq_k]` of the memory.
    pub fn with_key_padding_mask(mut self, mask: Tensor<2, Bool>) -> Self {
        crate::shape::check_shape(
            "key_padding_mask",
            mask.dims(),
            [("batch", Some(self.batch())), ("seq_k", Some(self.seq_k))],
        );
        self.key_padding_mask = Some(mask);
        self
    }
}
