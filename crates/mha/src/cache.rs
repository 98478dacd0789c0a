//! Key/value caches for incremental decoding: projected keys and values are stored, never
//! queries, so a step that feeds `n` new tokens costs `O(n · cached length)`. A cache may keep
//! every position, a fixed number, a sliding window, or a window with the first positions
//! pinned (StreamingLLM's attention sinks); in f32, f16, or int8 with per-position scales
//! (`stored.rs`).

use core::fmt;

use burn::module::ParamId;
use burn::tensor::{Bool, DType, Device, Tensor};

use crate::mask::Positions;
use crate::paged::StoredBlocks;

mod select;
mod storage;
mod stored;
mod tiled;
mod truncate;
mod undo;
// Names burn-ndarray's deprecated backend type, as `cpu` does.
#[allow(deprecated)]
#[cfg(any(feature = "flex", feature = "ndarray"))]
mod widen;

pub use storage::CacheStorage;
pub(crate) use storage::{
    Quantized, beyond_half_range, dequantize_int8, in_dtype, quantize_int8, storage_unsupported,
};
#[cfg(any(feature = "flex", feature = "ndarray"))]
pub(crate) use storage::{int8_scale, int8_value};
use stored::{EVICTION_SLACK, Layout, Side, Stored};
pub(crate) use tiled::TILE as TILE_POSITIONS;
use undo::{StepUndo, UndoLog};

/// A compressed [`KvCache`]'s buffers as the in-place decoding kernel reads them
/// ([`KvCache::in_place_buffers`]): a paged pool's blocks of [`TILE_POSITIONS`] positions, tile
/// `t` of batch element `b` in block `t · batch + b`, every position of their capacity, of
/// which `stored` after the first `evicted` are the cache's.
#[cfg_attr(not(any(feature = "flex", feature = "ndarray")), allow(dead_code))]
pub(crate) struct CompressedCache<'a> {
    /// f16 or int8, feature-major: `[tiles · batch, n_kv_heads, head_dim, TILE_POSITIONS]` (an
    /// int8 cache's scales `[tiles · batch, n_kv_heads, 1, TILE_POSITIONS]`).
    pub keys: StoredBlocks<'a>,
    /// `[tiles · batch, n_kv_heads, TILE_POSITIONS, head_dim]` (scales with a last axis of 1).
    pub values: StoredBlocks<'a>,
    /// The batch size.
    pub batch: usize,
    /// Positions at the front that a sliding window evicted, still in the buffers.
    pub evicted: usize,
    /// Positions the cache holds, after them.
    pub stored: usize,
}

impl CompressedCache<'_> {
    /// The blocks holding batch element `element`'s positions (evicted, then stored), in order.
    #[cfg_attr(not(any(feature = "flex", feature = "ndarray")), allow(dead_code))]
    pub fn blocks_of(&self, element: usize) -> Vec<usize> {
        (0..(self.evicted + self.stored).div_ceil(TILE_POSITIONS))
            .map(|tile| tile * self.batch + element)
            .collect()
    }
}

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
    /// StreamingLLM (Xiao et al. 2023): the first `sinks` positions are kept for good and every
    /// query sees them, besides the sliding window of `window` positions up to its own. Keys
    /// keep the positions they were rotated at (RoPE) and measured from (ALiBi).
    StreamingWindow {
        /// Positions kept from the start of the sequence.
        sinks: usize,
        /// Positions each query sees up to its own.
        window: usize,
    },
}

impl CacheLimit {
    /// The sliding window each query sees through, if the limit has one.
    pub(crate) fn window(self) -> Option<usize> {
        match self {
            Self::SlidingWindow(window) | Self::StreamingWindow { window, .. } => Some(window),
            Self::Unbounded | Self::Fixed(_) => None,
        }
    }
}

/// Why a cached forward, or a cut ([`KvCache::truncate`]), was refused. The cache is left
/// unchanged.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
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
    /// The `key_padding_mask` covers neither the new keys, nor cached plus new keys, nor
    /// every position fed and the new ones.
    PaddingWidth {
        /// The mask's width.
        width: usize,
        /// Positions already cached.
        cached: usize,
        /// Positions fed so far ([`KvCache::len`]; more than `cached` once a window evicted).
        fed: usize,
        /// Positions this step adds.
        new: usize,
    },
    /// The cache's storage cannot live on this device (int8 where the backend has no i8, f16
    /// where it has no f16).
    Storage {
        /// What the device lacks.
        reason: String,
    },
    /// A new key or value is beyond f16's range (±65504), which [`CacheStorage::Half`] would
    /// store as an infinity.
    BeyondHalfRange {
        /// The largest magnitude among the step's new keys and values.
        largest: f32,
    },
    /// The cache holds keys and values of another attention module.
    OtherModule {
        /// The module that filled the cache.
        cached: CacheOwner,
        /// The module of this step.
        module: CacheOwner,
    },
    /// [`KvCache::truncate`] to `len` positions was refused: the next query (at position
    /// `len`) would see positions from `sees_from`, and the cache's window evicted those
    /// before `held_from`.
    Evicted {
        /// The length asked for.
        len: usize,
        /// The first position the next query would see (after a streaming window's sinks).
        sees_from: usize,
        /// The first position the cache holds (after its sinks).
        held_from: usize,
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
                 step has batch {new} (keep some of its elements with KvCache::select_batch, or \
                 start a new cache with KvCache::reset)"
            ),
            Self::PaddingWidth {
                width,
                cached,
                fed,
                new,
            } => write!(
                f,
                "`key_padding_mask` has width {width}; under a KV cache it covers the new keys \
                 ({new}), cached plus new keys ({}) or every position fed plus new ({})",
                cached + new,
                fed + new
            ),
            Self::Storage { reason } => write!(f, "KV cache storage: {reason}"),
            Self::BeyondHalfRange { largest } => write!(
                f,
                "KV cache: a new key or value of magnitude {largest} is beyond f16's range \
                 (65504), which CacheStorage::Half cannot hold; use CacheStorage::Float"
            ),
            Self::OtherModule { cached, module } => write!(
                f,
                "KV cache filled by another attention module ({cached}) than this step's \
                 ({module}); each layer needs its own cache"
            ),
            Self::Evicted {
                len,
                sees_from,
                held_from,
            } => write!(
                f,
                "KV cache cannot be cut back to `len` = {len} positions: the next query would \
                 see positions from {sees_from}, and the window evicted those before \
                 {held_from} (keep a clone of the cache to go back further)"
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
    /// `[batch, n_kv_heads, capacity, head_dim]` (a compressed cache's on flex and ndarray in
    /// tiles, as a paged pool's blocks: [`stored::Layout`]).
    key: Option<Stored>,
    /// `[batch, n_kv_heads, capacity, value_dim]`.
    value: Option<Stored>,
    /// `[batch, stored]`, `true` = padding; `None` while no step gave a padding mask.
    padding: Option<Tensor<2, Bool>>,
    /// Positions seen since the start (the next token's absolute position).
    seen: usize,
    limit: CacheLimit,
    storage: CacheStorage,
    /// The module whose keys and values the cache holds, once a step stored some.
    owner: Option<CacheOwner>,
    /// The steps' batch size, once a step was taken (a window of 1 stores no position to
    /// read it from).
    batch: Option<usize>,
    /// What the last step changed, kept only for a layer of a Transformer stack (`undo.rs`).
    undo: UndoLog,
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
    /// Absolute positions of the new queries and of the first unpinned key the step attends
    /// to.
    pub positions: Positions,
    /// Keys at the front at positions `0..pinned_keys` (a streaming cache's sinks).
    pub pinned_keys: usize,
    /// Padding of the cached plus new keys, `[batch, stored + new]`.
    pub padding: Option<Tensor<2, Bool>>,
    /// Where the step's keys lie in a mask over every position fed (`len() + new` columns),
    /// once a window evicted some; `None` while the cache holds all it was fed.
    pub fed_columns: Option<Vec<(usize, usize)>>,
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

    /// An empty cache with a capacity or a window.
    ///
    /// # Panics
    ///
    /// Panics on a zero capacity or window.
    pub fn with_limit(limit: CacheLimit) -> Self {
        match limit {
            CacheLimit::Fixed(0)
            | CacheLimit::SlidingWindow(0)
            | CacheLimit::StreamingWindow { window: 0, .. } => {
                panic!("KvCache: a capacity or window of 0 positions can hold nothing")
            }
            _ => {}
        }
        Self {
            key: None,
            value: None,
            padding: None,
            seen: 0,
            limit,
            storage: CacheStorage::Float,
            owner: None,
            batch: None,
            undo: UndoLog::Off,
        }
    }

    /// The same cache storing keys and values as `storage` says.
    ///
    /// # Panics
    ///
    /// If the cache already holds positions.
    pub fn with_storage(mut self, storage: CacheStorage) -> Self {
        assert!(
            self.is_empty(),
            "KvCache: the storage is chosen before the first step"
        );
        self.storage = storage;
        self
    }

    /// Positions fed so far (the absolute position of the next token).
    pub fn len(&self) -> usize {
        self.seen
    }

    /// Whether nothing was fed yet.
    pub fn is_empty(&self) -> bool {
        self.seen == 0
    }

    /// Positions held now (fewer than [`len`](Self::len) once a window evicts).
    pub fn stored(&self) -> usize {
        self.key.as_ref().map_or(0, Stored::len)
    }

    /// Bytes the key and value buffers take (padding not counted); a cache's buffers keep room
    /// for as many positions again as they hold at most, so that appending does not copy the
    /// cache at every step: under a window, room for 64 positions past the window (and its
    /// sinks), where it leaves the positions it evicts until there are 64 (it moves what it
    /// keeps once every 64 decoding steps, not at every step). An f16 or
    /// int8 cache on flex or ndarray holds whole tiles of 64 positions (up to 63 more), which
    /// a decoding step reads in place as a paged pool's blocks. A windowed layer's cache in a
    /// Transformer stack also holds its buffers from before the last step (not counted), to
    /// take the step back if a later layer refuses it.
    pub fn bytes(&self) -> usize {
        [&self.key, &self.value]
            .into_iter()
            .flatten()
            .map(Stored::bytes)
            .sum()
    }

    /// Empties the cache, keeping its limit and storage.
    pub fn reset(&mut self) {
        let undo = match self.undo {
            UndoLog::Off => UndoLog::Off,
            UndoLog::On(_) => UndoLog::On(None),
        };
        *self = Self::with_limit(self.limit).with_storage(self.storage);
        self.undo = undo;
    }

    /// The capacity or window the cache was made with.
    pub fn limit(&self) -> CacheLimit {
        self.limit
    }

    /// How the cache stores keys and values.
    pub fn storage(&self) -> CacheStorage {
        self.storage
    }

    /// Keys at the front that are pinned (a streaming cache's sinks), of the first `keys`
    /// positions.
    fn pinned(&self, keys: usize) -> usize {
        match self.limit {
            CacheLimit::StreamingWindow { sinks, .. } => sinks.min(keys),
            _ => 0,
        }
    }

    /// Checks a step of `new` tokens of `batch` sequences by `owner`, with this step's padding
    /// mask (`[batch, new]`, `[batch, stored + new]` or `[batch, len + new]`), and says what it
    /// attends to. Changes nothing: a refused step leaves the cache as it was.
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
        if let Some(cached) = self.batch
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
        if let Some(reason) = storage_unsupported(self.storage, device) {
            return Err(CacheError::Storage { reason });
        }
        let stored = self.stored();
        // The step's keys at positions below `sinks`, new ones included: until the sinks are
        // all seen nothing is evicted, so the keys are positions `0..seen + new` in order.
        let pinned = self.pinned(self.seen + new);
        let fed_columns = self.fed_columns(new);
        Ok(CacheStep {
            owner,
            new,
            positions: Positions {
                query: self.seen as i64,
                // The first unpinned key's position.
                key: (self.seen + pinned - stored) as i64,
            },
            pinned_keys: pinned,
            padding: self.padding_with(padding, batch, new, fed_columns.as_deref(), device)?,
            fed_columns,
            keys: stored + new,
            window: self.limit.window(),
        })
    }

    /// Stores a step's projected keys and values (`[batch, n_kv_heads, new, head_dim]`) and
    /// returns the cached plus new ones the step attends to. Then evicts what a window no
    /// longer needs: the `window - 1` latest positions are kept for the next token (and a
    /// streaming cache's sinks).
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
        self.check_step(&step, &key);
        let dtype = key.dtype();
        let attended = self.attended_unless_stored_exactly(&key, &value, dtype);
        let read = attended.is_none().then_some(dtype);
        let stored = self.store_step(step, key, value, read);
        attended
            .or(stored)
            .expect("the stored positions were read where nothing else was")
    }

    /// [`append`](Self::append) for a step that attended to the cache in place
    /// ([`in_place_buffers`](Self::in_place_buffers)): stores the keys and values without
    /// reading the cache.
    ///
    /// # Panics
    ///
    /// As [`append`](Self::append).
    pub(crate) fn store(&mut self, step: CacheStep, key: Tensor<4>, value: Tensor<4>) {
        self.check_step(&step, &key);
        self.store_step(step, key, value, None);
    }

    /// A compressed cache's buffers, which a decoding step reads in place; `None` for float
    /// storage, keys stored position-major, or an empty cache.
    pub(crate) fn in_place_buffers(&self) -> Option<CompressedCache<'_>> {
        let (key, value) = (self.key.as_ref()?, self.value.as_ref()?);
        let Layout::Tiles { batch, .. } = key.layout() else {
            return None;
        };
        let held = key.held();
        if held.len == 0 || !matches!(value.layout(), Layout::Tiles { .. }) || value.held() != held
        {
            return None;
        }
        Some(CompressedCache {
            keys: key.compressed()?,
            values: value.compressed()?,
            batch,
            evicted: held.evicted,
            stored: held.len,
        })
    }

    /// Panics unless `key` holds `step`'s new tokens.
    fn check_step(&self, step: &CacheStep, key: &Tensor<4>) {
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
    }

    /// Stores the step's keys and values after the cached ones, less what a window evicts;
    /// with `read`, returns all of them (before the eviction) as floats of that type.
    fn store_step(
        &mut self,
        step: CacheStep,
        key: Tensor<4>,
        value: Tensor<4>,
        read: Option<DType>,
    ) -> Option<(Tensor<4>, Tensor<4>)> {
        let batch = key.dims()[0];
        if let UndoLog::On(_) = self.undo {
            self.undo = UndoLog::On(Some(Box::new(StepUndo::before(self))));
        }
        let (key, value) = self.stored_with(key, value);
        let read = read.map(|dtype| (key.read(dtype), value.read(dtype)));
        self.seen += step.new;
        self.owner = Some(step.owner);
        self.batch = Some(batch);
        self.keep(key, value, step.padding);
        read
    }

    /// What a step with new keys and values `key`, `value` in `dtype` attends to (the stored
    /// positions as stored, its own exactly), when the storage does not hold exactly that; `None`
    /// when it does (float storage in the step's type), so that the stored tensors serve as they
    /// are: one copy of the cache per step instead of two.
    fn attended_unless_stored_exactly(
        &self,
        key: &Tensor<4>,
        value: &Tensor<4>,
        dtype: DType,
    ) -> Option<(Tensor<4>, Tensor<4>)> {
        let exact = |stored: &Option<Stored>| {
            stored
                .as_ref()
                .is_none_or(|stored| stored.is_float_in(dtype))
        };
        match (&self.key, &self.value) {
            (Some(past_key), Some(past_value)) if !(exact(&self.key) && exact(&self.value)) => {
                Some((
                    past_key.read_then(key, dtype),
                    past_value.read_then(value, dtype),
                ))
            }
            (None, _) | (_, None) => Some((key.clone(), value.clone())),
            _ => None,
        }
    }

    /// The stored keys and values followed by `new_key`, `new_value` (`[batch, n_kv_heads,
    /// new, head_dim]`), stored (taken out of the cache, which [`KvCache::keep`] puts them back
    /// into).
    fn stored_with(&mut self, new_key: Tensor<4>, new_value: Tensor<4>) -> (Stored, Stored) {
        let storage = self.storage;
        match (self.key.take(), self.value.take()) {
            (Some(past_key), Some(past_value)) => {
                // Room to grow where every position is kept; a window's for the positions it
                // evicts in place (`Held::evicted`).
                let max_positions = match self.limit {
                    CacheLimit::Unbounded => usize::MAX,
                    CacheLimit::Fixed(capacity) => capacity,
                    CacheLimit::SlidingWindow(window) => window + EVICTION_SLACK,
                    CacheLimit::StreamingWindow { sinks, window } => {
                        sinks + window + EVICTION_SLACK
                    }
                };
                (
                    past_key.cat(new_key, storage, max_positions),
                    past_value.cat(new_value, storage, max_positions),
                )
            }
            _ => (
                Stored::new(new_key, storage, Side::Key),
                Stored::new(new_value, storage, Side::Value),
            ),
        }
    }

    /// Stores `key`, `value` and their padding, less what a window no longer needs.
    fn keep(&mut self, key: Stored, value: Stored, padding: Option<Tensor<2, Bool>>) {
        match self.kept(key.len()) {
            // A window of 1 (without sinks) keeps nothing: each query sees only itself.
            Some(ranges) if ranges.is_empty() => {
                self.padding = None;
                self.key = None;
                self.value = None;
            }
            Some(ranges) => {
                self.padding = padding.map(|padding| picked(&padding, 1, &ranges));
                self.key = Some(key.select(&ranges));
                self.value = Some(value.select(&ranges));
            }
            None => {
                self.padding = padding;
                self.key = Some(key);
                self.value = Some(value);
            }
        }
    }

    /// The position ranges `(start, length)` a window keeps of `stored`, or `None` to keep all.
    fn kept(&self, stored: usize) -> Option<Vec<(usize, usize)>> {
        let (pinned, window) = match self.limit {
            CacheLimit::SlidingWindow(window) => (0, window),
            CacheLimit::StreamingWindow { sinks, window } => (sinks.min(stored), window),
            _ => return None,
        };
        let recent = (window - 1).min(stored - pinned);
        if pinned + recent == stored {
            return None;
        }
        let ranges = [(0, pinned), (stored - recent, recent)];
        Some(ranges.into_iter().filter(|&(_, len)| len > 0).collect())
    }

    /// Where the keys of a step of `new` tokens (stored, then new) lie in a mask over every
    /// position fed (`len() + new` columns), as `(start, length)` ranges: the sinks, then the
    /// latest positions and the new ones. `None` while the cache holds every position fed.
    fn fed_columns(&self, new: usize) -> Option<Vec<(usize, usize)>> {
        let stored = self.stored();
        if stored == self.seen {
            return None;
        }
        let pinned = self.pinned(self.seen);
        let recent = stored - pinned;
        let ranges = [(0, pinned), (self.seen - recent, recent + new)];
        Some(ranges.into_iter().filter(|&(_, len)| len > 0).collect())
    }

    /// The padding of stored plus new keys, given this step's mask (`[batch, new]`,
    /// `[batch, stored + new]`, or over every position fed, whose `fed` columns are the
    /// step's keys).
    fn padding_with(
        &self,
        mask: Option<Tensor<2, Bool>>,
        batch: usize,
        new: usize,
        fed: Option<&[(usize, usize)]>,
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
        } else if let Some(fed) = fed
            && width == self.seen + new
        {
            Ok(Some(picked(&mask, 1, fed)))
        } else {
            Err(CacheError::PaddingWidth {
                width,
                cached: stored,
                fed: self.seen,
                new,
            })
        }
    }
}

/// Positions `ranges` (start, length) of `tensor` along `axis`, in order, concatenated: what
/// a window keeps of stored keys, values or padding, or the columns of a mask over every
/// position fed that the positions it kept are.
pub(crate) fn picked<const D: usize, K: burn::tensor::kind::Basic>(
    tensor: &Tensor<D, K>,
    axis: usize,
    ranges: &[(usize, usize)],
) -> Tensor<D, K> {
    let parts = ranges
        .iter()
        .map(|&(start, len)| tensor.clone().narrow(axis, start, len))
        .collect();
    Tensor::cat(parts, axis)
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
