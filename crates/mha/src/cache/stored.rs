//! A [`KvCache`](super::KvCache)'s keys or values as it stores them ([`Stored`]): float (f32 or
//! f16) or int8 buffers with room to append in place, and what a step reads of them.

use burn::tensor::kind::Basic;
use burn::tensor::{DType, Int, Tensor};

use super::picked;
use super::select::index_tensor;
use super::storage::{CacheStorage, Quantized, dequantize_int8, in_dtype, quantize_int8};
use super::tiled::{TILE, Within, grown, tiled, tiles_for, untiled, written};
#[cfg(any(feature = "flex", feature = "ndarray"))]
use super::widen;
use crate::cpu::aligned::{line_aligned, with_zeros_after};
use crate::cpu::native_storage;
use crate::paged::{BlockTensor, StoredBlocks};

/// Stored keys or values, `[batch, heads, capacity, dim]` (or, [`Layout::Tiles`], a paged
/// pool's blocks), of which [`Stored::len`] positions are held ([`Held`]).
#[derive(Debug, Clone)]
pub(super) struct Stored {
    elements: Elements,
    held: Held,
    layout: Layout,
}

/// Positions a window leaves evicted in a buffer before it moves the ones it keeps together
/// ([`Held::evicted`]): a tile's worth.
pub(super) const EVICTION_SLACK: usize = TILE;

/// Which of a buffer's positions a [`Stored`] holds: `len` after the `evicted` first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Held {
    /// Positions at the front of the buffer that a window evicted, left where they lie (and
    /// hidden from the in-place kernel) until there are [`EVICTION_SLACK`] of them: a window's
    /// cache then moves its positions once every 64 decoding steps, not at every step (which
    /// took 20x an unbounded cache's step in f32 at a window of 4096, 8 heads, on flex: fresh
    /// buffers' page faults and copies).
    pub evicted: usize,
    /// Positions held after them.
    pub len: usize,
}

impl Held {
    /// `len` positions, the buffer's first.
    fn first(len: usize) -> Self {
        Self { evicted: 0, len }
    }

    /// The buffer position after the last held one.
    fn end(self) -> usize {
        self.evicted + self.len
    }

    /// What is held after a window keeps `ranges` (of the held positions, in order) in place,
    /// and the sinks to move: for a window's latest positions, the ones before them are
    /// evicted; for a streaming window's sinks (the first range) and latest positions, the ones
    /// between are, and the sinks move to just before the latest, so that what is held stays
    /// one run of the buffer. `None` where the ranges are neither, or too many positions would
    /// be evicted.
    fn keeping(self, ranges: &[(usize, usize)]) -> Option<(Self, Option<SinksMove>)> {
        let (sinks, (start, len)) = match *ranges {
            [latest] => (0, latest),
            [(0, sinks), latest] => (sinks, latest),
            _ => return None,
        };
        let evicted = self.evicted + start.checked_sub(sinks)?;
        if start + len != self.len || evicted >= EVICTION_SLACK {
            return None;
        }
        let moved = (sinks > 0 && evicted > self.evicted).then_some(SinksMove {
            from: self.evicted,
            to: evicted,
            count: sinks,
        });
        let held = Self {
            evicted,
            len: sinks + len,
        };
        Some((held, moved))
    }
}

/// A streaming window's sinks moved within the buffer (see [`Held::keeping`]): `count`
/// positions from buffer position `from` to `to`, a few positions a step where the window
/// would otherwise be copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SinksMove {
    from: usize,
    to: usize,
    count: usize,
}

/// How a [`Stored`]'s buffers lie.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layout {
    /// `[batch, heads, capacity, dim]` (an int8 buffer's scales `[batch, heads, capacity, 1]`):
    /// a position's features adjacent.
    PositionMajor,
    /// Tiles of [`TILE`] positions as a paged pool's blocks ([`tiled`](super::tiled)): keys
    /// `[tiles · batch, heads, dim, TILE]`, values `[tiles · batch, heads, TILE, dim]` (an int8
    /// buffer's scales with a feature axis of 1), tile `t` of batch element `b` block `t · batch
    /// + b`, so that a decoding step reads a compressed cache in place through the paged kernel
    /// (`paged::native_cached_attention`), a tile's keys and values each one run of memory.
    Tiles { batch: usize, within: Within },
}

impl Layout {
    /// The layout of a side's positions in `storage`, for steps like `tensor`'s: a compressed
    /// cache's in tiles where the in-place decoding kernel reads them (f32 on flex or ndarray,
    /// outside autodiff), everything else position-major, as the other kernels read them.
    fn of(side: Side, storage: CacheStorage, tensor: &Tensor<4>) -> Self {
        let device = tensor.device();
        let read_in_place =
            native_storage(&device) && !device.is_autodiff() && tensor.dtype() == DType::F32;
        let within = match side {
            Side::Key => Within::FeatureMajor,
            Side::Value => Within::PositionMajor,
        };
        match storage {
            CacheStorage::Half | CacheStorage::Int8 if read_in_place => Self::Tiles {
                batch: tensor.dims()[0],
                within,
            },
            _ => Self::PositionMajor,
        }
    }

    /// Positions `[batch, heads, n, dim]` laid out: as they are position-major, in the tiles
    /// that hold them (the last one's spare positions zero).
    fn laid_out<K: Basic>(self, positions: Tensor<4, K>) -> Tensor<4, K> {
        match self {
            Self::PositionMajor => positions,
            Self::Tiles { within, .. } => {
                let tiles = tiles_for(positions.dims()[2]);
                tiled(positions, within, tiles)
            }
        }
    }

    /// The `held` positions of `buffer` as `[batch, heads, held.len, dim]`.
    fn positions<K: Basic>(self, buffer: &Tensor<4, K>, held: Held) -> Tensor<4, K> {
        let Held { evicted, len } = held;
        match self {
            Self::PositionMajor if buffer.dims()[2] == len => buffer.clone(),
            Self::PositionMajor => buffer.clone().narrow(2, evicted, len),
            Self::Tiles { batch, within } if evicted == 0 => untiled(buffer, within, batch, len),
            Self::Tiles { batch, within } => {
                untiled(buffer, within, batch, held.end()).narrow(2, evicted, len)
            }
        }
    }

    /// `buffer`'s positions `0..len`, then `new`'s (`[batch, heads, n, dim]`): written into the
    /// buffer's spare positions in place where they fit (a uniquely held buffer on flex), so
    /// that a decoding step copies only its own keys, not the whole cache; else into a new
    /// buffer with room for up to as many positions again, but never more than
    /// `max_positions` in all (in tiles: rounded up to a whole tile).
    fn appended<K: Basic>(
        self,
        buffer: Tensor<4, K>,
        len: usize,
        new: Tensor<4, K>,
        max_positions: usize,
    ) -> Tensor<4, K> {
        let dims = buffer.dims();
        let total = len + new.dims()[2];
        let capacity = match self {
            Self::PositionMajor => dims[2],
            Self::Tiles { batch, .. } => dims[0] / batch * TILE,
        };
        let grown_to = (2 * capacity).min(max_positions).max(total);
        match self {
            Self::PositionMajor if total <= capacity => self.written_at(buffer, len, new),
            Self::PositionMajor => {
                let grown = with_zeros_after(buffer.narrow(2, 0, len), 2, grown_to - len);
                self.written_at(grown, len, new)
            }
            Self::Tiles { batch, .. } => {
                let buffer = if total <= capacity {
                    buffer
                } else {
                    grown(buffer, batch, tiles_for(grown_to))
                };
                self.written_at(buffer, len, new)
            }
        }
    }

    /// `buffer` with `new` (`[batch, heads, n, dim]`) written at positions `at..at + n`, in
    /// place where flex holds the buffer once.
    ///
    /// # Panics
    ///
    /// If the positions do not fit the buffer.
    fn written_at<K: Basic>(
        self,
        buffer: Tensor<4, K>,
        at: usize,
        new: Tensor<4, K>,
    ) -> Tensor<4, K> {
        match self {
            Self::PositionMajor => {
                let mut ranges = buffer.dims().map(|size| 0..size);
                ranges[2] = at..at + new.dims()[2];
                buffer.slice_assign(ranges, new)
            }
            Self::Tiles { batch, within } => written(buffer, within, batch, at, new),
        }
    }

    /// `buffer` with a streaming window's sinks moved as `moved` says.
    fn with_sinks_moved<K: Basic>(self, buffer: Tensor<4, K>, moved: SinksMove) -> Tensor<4, K>
    where
        Tensor<4, K>: BlockTensor,
    {
        let sinks = Held {
            evicted: moved.from,
            len: moved.count,
        };
        // Of its own, so that the buffer is held once when the sinks are written into it.
        let sinks = self.positions(&buffer, sinks).materialized();
        self.written_at(buffer, moved.to, sinks)
    }
}

/// Whether a [`Stored`] holds keys or values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Side {
    Key,
    Value,
}

/// A [`Stored`]'s buffers (in its [`Layout`]), or a step's positions encoded for storage
/// (`[batch, heads, n, dim]`).
#[derive(Debug, Clone)]
// The int8 variant holds two tensors; the enum lives in a cache, two per layer, never in bulk.
#[allow(clippy::large_enum_variant)]
enum Elements {
    /// f32 or f16.
    Float(Tensor<4>),
    /// i8, and one scale per position and head (a feature axis of 1).
    Int8 {
        values: Tensor<4, Int>,
        scales: Tensor<4>,
    },
}

impl Elements {
    /// The buffers' length along their first axis (a batch, or tiles of every element).
    fn blocks(&self) -> usize {
        match self {
            Self::Float(buffer) => buffer.dims()[0],
            Self::Int8 { scales, .. } => scales.dims()[0],
        }
    }

    fn device(&self) -> burn::tensor::Device {
        match self {
            Self::Float(buffer) => buffer.device(),
            Self::Int8 { scales, .. } => scales.device(),
        }
    }

    /// `tensor` as `storage` stores it.
    fn encoded(tensor: Tensor<4>, storage: CacheStorage) -> Self {
        match storage {
            CacheStorage::Float => Self::Float(tensor),
            CacheStorage::Half => Self::Float(in_dtype(tensor, DType::F16)),
            CacheStorage::Int8 => {
                // One scale per position, over its features.
                let Quantized { values, scales } = quantize_int8(tensor);
                Self::Int8 { values, scales }
            }
        }
    }
}

impl Stored {
    /// `tensor` (`[batch, heads, positions, dim]`) stored as `storage` says, in the layout of
    /// `side` ([`Layout::of`]).
    pub(super) fn new(tensor: Tensor<4>, storage: CacheStorage, side: Side) -> Self {
        let layout = Layout::of(side, storage, &tensor);
        let len = tensor.dims()[2];
        let elements = match Elements::encoded(tensor, storage) {
            Elements::Float(positions) => Elements::Float(layout.laid_out(positions)),
            Elements::Int8 { values, scales } => Elements::Int8 {
                values: layout.laid_out(values),
                scales: layout.laid_out(scales),
            },
        };
        Self {
            elements,
            held: Held::first(len),
            layout,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.held.len
    }

    /// Which of the buffer's positions are held.
    pub(crate) fn held(&self) -> Held {
        self.held
    }

    pub(crate) fn layout(&self) -> Layout {
        self.layout
    }

    /// Whether the positions are stored as floats of `dtype` (what [`Stored::read`] returns
    /// without a conversion).
    pub(super) fn is_float_in(&self, dtype: DType) -> bool {
        matches!(&self.elements, Elements::Float(buffer) if buffer.dtype() == dtype)
    }

    /// The f16 or int8 buffers, whole (spare positions included), as the in-place kernel reads
    /// a paged pool's; `None` for f32 storage.
    pub(crate) fn compressed(&self) -> Option<StoredBlocks<'_>> {
        match &self.elements {
            Elements::Float(buffer) if buffer.dtype() == DType::F16 => {
                Some(StoredBlocks::Float(buffer))
            }
            Elements::Float(_) => None,
            Elements::Int8 { values, scales } => Some(StoredBlocks::Int8 { values, scales }),
        }
    }

    /// The stored positions as floats, in `dtype`.
    pub(super) fn read(&self, dtype: DType) -> Tensor<4> {
        let (layout, held) = (self.layout, self.held);
        match &self.elements {
            Elements::Float(buffer) => in_dtype(layout.positions(buffer, held), dtype),
            Elements::Int8 { values, scales } => dequantize_int8(
                layout.positions(values, held),
                layout.positions(scales, held),
                dtype,
            ),
        }
    }

    /// The stored positions in `dtype` with `new` (in `dtype`) after them: where f16 or int8
    /// are widened to f32 on flex or ndarray, in one pass over the positions (`widen.rs`;
    /// tiles are first moved into positions' order); elsewhere a conversion, then a
    /// concatenation.
    pub(super) fn read_then(&self, new: &Tensor<4>, dtype: DType) -> Tensor<4> {
        #[cfg(any(feature = "flex", feature = "ndarray"))]
        {
            let (layout, held) = (self.layout, self.held);
            let (half, int8_values, int8_scales);
            let compressed = match &self.elements {
                Elements::Float(buffer) if buffer.dtype() == DType::F16 => {
                    half = layout.positions(buffer, held);
                    Some(widen::Compressed::Half(&half))
                }
                Elements::Float(_) => None,
                Elements::Int8 { values, scales } => {
                    (int8_values, int8_scales) = (
                        layout.positions(values, held),
                        layout.positions(scales, held),
                    );
                    Some(widen::Compressed::Int8 {
                        values: &int8_values,
                        scales: &int8_scales,
                    })
                }
            };
            if let Some(widened) =
                compressed.and_then(|stored| widen::widened_then_rows(stored, new))
            {
                return widened;
            }
        }
        Tensor::cat(vec![self.read(dtype), new.clone()], 2)
    }

    /// These positions, then `new`'s (`[batch, heads, n, dim]`, stored as `storage` says: the
    /// cache's), in this layout ([`Layout::appended`]).
    ///
    /// # Panics
    ///
    /// If `storage` is not these positions' (f32 or f16 against int8).
    pub(super) fn cat(self, new: Tensor<4>, storage: CacheStorage, max_positions: usize) -> Self {
        let Self {
            elements,
            held,
            layout,
        } = self;
        let (end, new_len) = (held.end(), new.dims()[2]);
        let elements = match (elements, Elements::encoded(new, storage)) {
            (Elements::Float(buffer), Elements::Float(new)) => {
                Elements::Float(layout.appended(buffer, end, new, max_positions))
            }
            (
                Elements::Int8 { values, scales },
                Elements::Int8 {
                    values: new_values,
                    scales: new_scales,
                },
            ) => Elements::Int8 {
                values: layout.appended(values, end, new_values, max_positions),
                scales: layout.appended(scales, end, new_scales, max_positions),
            },
            _ => unreachable!("one cache has one storage"),
        };
        Self {
            elements,
            held: Held {
                len: held.len + new_len,
                ..held
            },
            layout,
        }
    }

    /// The first `len` positions (positions past them stay in the buffer as spare room).
    ///
    /// # Panics
    ///
    /// If more positions than are held are asked for.
    pub(super) fn truncated(self, len: usize) -> Self {
        assert!(
            len <= self.held.len,
            "Stored::truncated: {len} > {}",
            self.held.len
        );
        Self {
            held: Held { len, ..self.held },
            ..self
        }
    }

    /// Positions `ranges` (in order), concatenated: where they are a window's latest
    /// positions (after its sinks), by evicting the others in place while fewer than
    /// [`EVICTION_SLACK`] are ([`Held::keeping`]); else into a new buffer.
    pub(super) fn select(self, ranges: &[(usize, usize)]) -> Self {
        let held = self.held;
        if let Some((kept, moved)) = held.keeping(ranges) {
            let layout = self.layout;
            let elements = match (self.elements, moved) {
                (elements, None) => elements,
                (Elements::Float(buffer), Some(moved)) => {
                    Elements::Float(layout.with_sinks_moved(buffer, moved))
                }
                (Elements::Int8 { values, scales }, Some(moved)) => Elements::Int8 {
                    values: layout.with_sinks_moved(values, moved),
                    scales: layout.with_sinks_moved(scales, moved),
                },
            };
            return Self {
                elements,
                held: kept,
                layout,
            };
        }
        fn kept_of<K: Basic>(
            buffer: &Tensor<4, K>,
            (layout, held): (Layout, Held),
            ranges: &[(usize, usize)],
        ) -> Tensor<4, K> {
            layout.laid_out(picked(&layout.positions(buffer, held), 2, ranges))
        }
        let kept = ranges.iter().map(|&(_, len)| len).sum();
        let from = (self.layout, held);
        let elements = match self.elements {
            Elements::Float(buffer) => Elements::Float(kept_of(&buffer, from, ranges)),
            Elements::Int8 { values, scales } => Elements::Int8 {
                values: kept_of(&values, from, ranges),
                scales: kept_of(&scales, from, ranges),
            },
        };
        Self {
            elements,
            held: Held::first(kept),
            layout: self.layout,
        }
    }

    /// The batch elements `batch_indices` (in order, repeats allowed) of the buffers, each
    /// holding what it held: new buffers of `batch_indices.len()` elements with the same room
    /// (in tiles, element `i`'s tile `t` is block `t · batch_indices.len() + i`), on a cache
    /// line on flex as grown buffers are ([`with_zeros_after`]).
    pub(super) fn with_batch_elements(self, batch_indices: &[usize]) -> Self {
        let blocks: Vec<usize> = match self.layout {
            Layout::PositionMajor => batch_indices.to_vec(),
            Layout::Tiles { batch, .. } => {
                let tiles = self.elements.blocks() / batch;
                (0..tiles)
                    .flat_map(|tile| {
                        batch_indices
                            .iter()
                            .map(move |&element| tile * batch + element)
                    })
                    .collect()
            }
        };
        let blocks = index_tensor(&blocks, &self.elements.device());
        let chosen = |buffer: Tensor<4>| line_aligned(buffer.select(0, blocks.clone()));
        let buffers = match self.elements {
            Elements::Float(buffer) => Elements::Float(chosen(buffer)),
            Elements::Int8 { values, scales } => Elements::Int8 {
                values: line_aligned(values.select(0, blocks.clone())),
                scales: chosen(scales),
            },
        };
        let layout = match self.layout {
            Layout::PositionMajor => Layout::PositionMajor,
            Layout::Tiles { within, .. } => Layout::Tiles {
                batch: batch_indices.len(),
                within,
            },
        };
        Self {
            elements: buffers,
            held: self.held,
            layout,
        }
    }

    /// Bytes the stored tensors take.
    pub(super) fn bytes(&self) -> usize {
        let size = |dims: [usize; 4], dtype: DType| dims.iter().product::<usize>() * dtype.size();
        match &self.elements {
            Elements::Float(buffer) => size(buffer.dims(), buffer.dtype()),
            Elements::Int8 { values, scales } => {
                size(values.dims(), values.dtype()) + size(scales.dims(), scales.dtype())
            }
        }
    }
}

// The tests run on flex.
#[cfg(all(test, feature = "flex"))]
mod tests {
    use burn::tensor::{Device, Distribution};

    use super::*;
    use crate::cpu::aligned::starts_on_a_line;

    #[test]
    fn a_grown_buffer_starts_on_a_cache_line_and_holds_every_position() {
        let device = Device::flex();
        let rows = |n| Tensor::<4>::random([1, 8, n, 64], Distribution::Normal(0.0, 1.0), &device);
        for storage in [CacheStorage::Float, CacheStorage::Half, CacheStorage::Int8] {
            for side in [Side::Key, Side::Value] {
                // 128 positions fill the first buffer (two whole tiles when compressed), so the
                // first append grows it.
                let steps = [rows(128), rows(1), rows(1), rows(1)];
                let mut stored = Stored::new(steps[0].clone(), storage, side);
                for step in &steps[1..] {
                    stored = stored.cat(step.clone(), storage, usize::MAX);
                }
                let expected = Stored::new(Tensor::cat(steps.to_vec(), 2), storage, side);
                let read = |stored: &Stored| match &stored.elements {
                    Elements::Float(buffer) => {
                        vec![stored.layout.positions(buffer, stored.held).into_data()]
                    }
                    Elements::Int8 { values, scales } => vec![
                        stored.layout.positions(values, stored.held).into_data(),
                        stored.layout.positions(scales, stored.held).into_data(),
                    ],
                };
                for (actual, expected) in read(&stored).iter().zip(&read(&expected)) {
                    actual.assert_eq(expected, true);
                }
                let buffers = match stored.elements {
                    Elements::Float(buffer) => vec![starts_on_a_line(buffer)],
                    Elements::Int8 { values, scales } => {
                        vec![starts_on_a_line(values), starts_on_a_line(scales)]
                    }
                };
                assert_eq!(buffers, vec![true; buffers.len()], "{storage:?} {side:?}");
            }
        }
    }

    #[test]
    fn chosen_batch_elements_start_on_a_cache_line_and_hold_their_positions() {
        let device = Device::flex();
        // Two elements of 70 positions: two tiles each when compressed.
        let positions =
            Tensor::<4>::random([2, 2, 70, 64], Distribution::Normal(0.0, 1.0), &device);
        let chosen = [1, 0, 1];
        let expected_positions = positions.clone().select(0, index_tensor(&chosen, &device));
        for storage in [CacheStorage::Float, CacheStorage::Half, CacheStorage::Int8] {
            for side in [Side::Key, Side::Value] {
                let stored =
                    Stored::new(positions.clone(), storage, side).with_batch_elements(&chosen);
                let expected = Stored::new(expected_positions.clone(), storage, side);
                assert_eq!(stored.layout, expected.layout, "{storage:?} {side:?}");
                let read = |stored: &Stored| stored.read(DType::F32).into_data();
                read(&stored).assert_eq(&read(&expected), true);
                let buffers = match stored.elements {
                    Elements::Float(buffer) => vec![starts_on_a_line(buffer)],
                    Elements::Int8 { values, scales } => {
                        vec![starts_on_a_line(values), starts_on_a_line(scales)]
                    }
                };
                assert_eq!(buffers, vec![true; buffers.len()], "{storage:?} {side:?}");
            }
        }
    }
}
