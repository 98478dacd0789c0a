//! The block pool of one of a [`PagedKvCache`](super::PagedKvCache)'s two sides: values
//! `[blocks, heads, block_size, dim]`, keys feature-major `[blocks, heads, dim, block_size]`
//! ([`BlockLayout`]), in floats (the module's type, or f16 as [`CacheStorage::Half`]) or in
//! int8 with a scale per position and head (as [`CacheStorage::Int8`]).

use std::ops::Range;

use burn::tensor::{DType, Device, IndexingUpdateOp, Int, Tensor, TensorData};

use super::cache::{BlockTable, PagedKvCacheConfig};
use super::cpu::{Int8Blocks, PoolWrite, Slot, native_write, native_write_int8};
use crate::cache::{CacheStorage, Quantized, dequantize_int8, in_dtype, quantize_int8};
use crate::cpu::aligned::with_zeros_after;
use crate::cpu::native_storage;

/// How a block lays out its positions and features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlockLayout {
    /// `[blocks, heads, block_size, dim]`: each position's features side by side (values,
    /// which a query sums row by row).
    PositionMajor,
    /// `[blocks, heads, dim, block_size]`: each feature's positions side by side (keys), so
    /// that a query's scores over a block are `dim` vector products with no horizontal sums
    /// (vLLM's key cache is feature-major within a block likewise).
    FeatureMajor,
}

impl BlockLayout {
    /// The axis along which a block's positions run.
    fn position_axis(self) -> usize {
        match self {
            Self::PositionMajor => 2,
            Self::FeatureMajor => 3,
        }
    }
}

/// One side's blocks.
#[derive(Debug, Clone)]
pub(crate) struct BlockStore {
    data: BlockData,
    layout: BlockLayout,
}

/// A store's tensors as the native kernel reads them, in the store's [`BlockLayout`].
#[cfg_attr(not(any(feature = "flex", feature = "ndarray")), allow(dead_code))]
pub(crate) enum StoredBlocks<'a> {
    /// In the module's float type, or f16.
    Float(&'a Tensor<4>),
    /// i8 values, and their scales with a feature axis of 1.
    Int8 {
        values: &'a Tensor<4, Int>,
        scales: &'a Tensor<4>,
    },
}

/// A store's tensors, in its [`BlockLayout`].
#[derive(Debug, Clone)]
// The int8 variant holds two tensors; two stores live in a cache, never in bulk.
#[allow(clippy::large_enum_variant)]
enum BlockData {
    /// In the module's float type, or f16 ([`CacheStorage::Half`]).
    Float { blocks: Tensor<4> },
    /// i8 values and their scales (one per position and head: a feature axis of 1).
    Int8 {
        values: Tensor<4, Int>,
        scales: Tensor<4>,
    },
}

impl BlockStore {
    /// One block of zeros for `heads` heads of `dim` features, stored as `config` says.
    pub fn new(
        config: PagedKvCacheConfig,
        layout: BlockLayout,
        (heads, dim): (usize, usize),
        (device, dtype): (&Device, DType),
    ) -> Self {
        let rows = Tensor::zeros([1, heads, config.block_size, dim], (device, dtype));
        let data = match config.storage {
            CacheStorage::Float => BlockData::Float {
                blocks: laid_out(rows, layout),
            },
            CacheStorage::Half => BlockData::Float {
                blocks: laid_out(in_dtype(rows, DType::F16), layout),
            },
            CacheStorage::Int8 => {
                // Scales in the module's float type, as each step's quantized rows have them
                // (and as `KvCache` keeps them).
                let Quantized { values, scales } = quantize_int8(rows);
                BlockData::Int8 {
                    values: laid_out(values, layout),
                    scales: laid_out(scales, layout),
                }
            }
        };
        Self { data, layout }
    }

    /// How the blocks are laid out.
    // Read by the in-place kernel, compiled with a CPU backend.
    #[cfg_attr(not(any(feature = "flex", feature = "ndarray")), allow(dead_code))]
    pub fn layout(&self) -> BlockLayout {
        self.layout
    }

    /// The blocks allocated.
    pub fn blocks(&self) -> usize {
        match &self.data {
            BlockData::Float { blocks } => blocks.dims()[0],
            BlockData::Int8 { scales, .. } => scales.dims()[0],
        }
    }

    /// Bytes one block takes.
    pub fn block_bytes(&self) -> usize {
        let bytes =
            |dims: [usize; 4], dtype: DType| dims[1..].iter().product::<usize>() * dtype.size();
        match &self.data {
            BlockData::Float { blocks } => bytes(blocks.dims(), blocks.dtype()),
            BlockData::Int8 { values, scales } => {
                bytes(values.dims(), values.dtype()) + bytes(scales.dims(), scales.dtype())
            }
        }
    }

    /// The blocks in their layout, for the native kernel.
    #[cfg_attr(not(any(feature = "flex", feature = "ndarray")), allow(dead_code))]
    pub fn stored(&self) -> StoredBlocks<'_> {
        match &self.data {
            BlockData::Float { blocks } => StoredBlocks::Float(blocks),
            BlockData::Int8 { values, scales } => StoredBlocks::Int8 { values, scales },
        }
    }

    /// The pool grown to `blocks` blocks (the new ones zero); never shrunk.
    pub fn grown(self, blocks: usize) -> Self {
        let extra = blocks.saturating_sub(self.blocks());
        if extra == 0 {
            return self;
        }
        let data = match self.data {
            BlockData::Float { blocks } => BlockData::Float {
                blocks: blocks.with_zeros(extra),
            },
            BlockData::Int8 { values, scales } => BlockData::Int8 {
                values: values.with_zeros(extra),
                scales: scales.with_zeros(extra),
            },
        };
        Self { data, ..self }
    }

    /// The pool with block `from` copied into block `to`.
    pub fn with_block_copied(self, from: usize, to: usize) -> Self {
        fn copied<T: BlockTensor>(tensor: T, from: usize, to: usize) -> T {
            // The block is made a tensor of its own first, so that the pool is held once when
            // it is assigned (in place on flex) rather than through a view of itself.
            let block = tensor.block(from).materialized();
            tensor.with_block(to, [0, 0], block)
        }
        let data = match self.data {
            BlockData::Float { blocks } => BlockData::Float {
                blocks: copied(blocks, from, to),
            },
            BlockData::Int8 { values, scales } => BlockData::Int8 {
                values: copied(values, from, to),
                scales: copied(scales, from, to),
            },
        };
        Self { data, ..self }
    }

    /// The pool with `rows` (`[1, heads, n, dim]`) written at positions `past..past + n` of
    /// `table`.
    pub fn written(self, table: &BlockTable, past: usize, rows: Tensor<4>) -> Self {
        let layout = self.layout;
        let data = match self.data {
            BlockData::Float { blocks } => {
                let rows = laid_out(in_dtype(rows, blocks.dtype()), layout);
                BlockData::Float {
                    blocks: write_rows(blocks, layout, table, past, rows),
                }
            }
            BlockData::Int8 { values, scales } => {
                let Quantized {
                    values: new_values,
                    scales: new_scales,
                } = quantize_int8(rows);
                BlockData::Int8 {
                    values: write_rows(values, layout, table, past, laid_out(new_values, layout)),
                    scales: write_rows(scales, layout, table, past, laid_out(new_scales, layout)),
                }
            }
        };
        Self { data, layout }
    }

    /// The pool with every write's rows of `rows` (the step's `[1, heads, step rows, dim]`)
    /// written at its sequence's positions: in place, in one pass, where the native writer
    /// takes the pool (f32 rows on flex or ndarray, into f32, f16 or int8 blocks), else
    /// through tensor ops, [`TensorOpWrites::ByBlock`] on flex and ndarray (autodiff, rows of
    /// another float type), [`TensorOpWrites::Scatter`] elsewhere (a GPU).
    pub fn written_all(self, writes: &[RowsWrite], rows: &Tensor<4>) -> Self {
        let layout = self.layout;
        let block_size = self.block_size();
        let slots = writes
            .iter()
            .flat_map(|write| write.slots(block_size))
            .collect();
        let data = match self.data {
            BlockData::Float { blocks } => match native_write(blocks, rows, slots, layout) {
                PoolWrite::Written(blocks) => {
                    return Self {
                        data: BlockData::Float { blocks },
                        layout,
                    };
                }
                PoolWrite::Declined(blocks) => BlockData::Float { blocks },
            },
            BlockData::Int8 { values, scales } => {
                let pool = Int8Blocks { values, scales };
                match native_write_int8(pool, rows, slots, layout) {
                    PoolWrite::Written(Int8Blocks { values, scales }) => {
                        return Self {
                            data: BlockData::Int8 { values, scales },
                            layout,
                        };
                    }
                    PoolWrite::Declined(Int8Blocks { values, scales }) => {
                        BlockData::Int8 { values, scales }
                    }
                }
            }
        };
        // flex and ndarray assign into a pool held once in place, where flex's scatter copies
        // the whole pool; on a GPU each assignment is a kernel launch of its own.
        let how = if native_storage(&rows.device()) {
            TensorOpWrites::ByBlock
        } else {
            TensorOpWrites::Scatter
        };
        Self { data, layout }.written_by_tensor_ops(writes, rows, how)
    }

    /// Positions in a block.
    fn block_size(&self) -> usize {
        let shape = match &self.data {
            BlockData::Float { blocks } => blocks.dims(),
            BlockData::Int8 { values, .. } => values.dims(),
        };
        shape[self.layout.position_axis()]
    }

    /// [`written_all`](Self::written_all) through tensor ops, the writes as `how` says.
    fn written_by_tensor_ops(
        self,
        writes: &[RowsWrite],
        rows: &Tensor<4>,
        how: TensorOpWrites,
    ) -> Self {
        let (short, long): (Vec<&RowsWrite>, Vec<&RowsWrite>) = writes
            .iter()
            .partition(|write| write.rows.len() <= SCATTERED_ROWS);
        // One short write keeps its one or few assignments, with no indices to upload.
        let (store, by_block) = if how == TensorOpWrites::Scatter && short.len() > 1 {
            let block_size = self.block_size();
            let slots: Vec<Slot> = short
                .iter()
                .flat_map(|write| write.slots(block_size))
                .collect();
            (self.scattered(&slots, rows), long)
        } else {
            (self, writes.iter().collect())
        };
        by_block.into_iter().fold(store, |store, write| {
            let (start, count) = (write.rows.start, write.rows.len());
            store.written(
                write.table,
                write.past,
                rows.clone().narrow(2, start, count),
            )
        })
    }

    /// The pool with row `slot.row` of `rows` (the step's `[1, heads, step rows, dim]`)
    /// written at each of `slots`, in one scatter of all of them (vLLM's `reshape_and_cache`).
    fn scattered(self, slots: &[Slot], rows: &Tensor<4>) -> Self {
        let layout = self.layout;
        let picked = picked_rows(rows, slots);
        let data = match self.data {
            BlockData::Float { blocks } => {
                let picked = in_dtype(picked, blocks.dtype());
                BlockData::Float {
                    blocks: blocks.with_rows_scattered(layout, slots, picked),
                }
            }
            BlockData::Int8 { values, scales } => {
                let Quantized {
                    values: new_values,
                    scales: new_scales,
                } = quantize_int8(picked);
                BlockData::Int8 {
                    values: values.with_rows_scattered(layout, slots, new_values),
                    scales: scales.with_rows_scattered(layout, slots, new_scales),
                }
            }
        };
        Self { data, layout }
    }

    /// The positions of `table` from its first held one ([`BlockTable::first_held`]) up to
    /// `len` as `[1, heads, positions, dim]` floats of `dtype`: one gather of the sequence's
    /// held blocks into a contiguous tensor (the generic path).
    pub fn gather(&self, table: &BlockTable, len: usize, dtype: DType) -> Tensor<4> {
        let layout = self.layout;
        match &self.data {
            BlockData::Float { blocks } => in_dtype(gathered(blocks, layout, table, len), dtype),
            BlockData::Int8 { values, scales } => dequantize_int8(
                gathered(values, layout, table, len),
                gathered(scales, layout, table, len),
                dtype,
            ),
        }
    }

    /// [`gather`](Self::gather) for many sequences in one gather of all their held blocks:
    /// each `(table, len)`'s positions from its first held one up to `len`, padded behind to
    /// the whole blocks of the longest, `[sequences, heads, positions, dim]` floats of `dtype`.
    /// A sequence's padding holds other positions' values: the caller masks it.
    pub fn gather_batch(&self, sequences: &[(&BlockTable, usize)], dtype: DType) -> Tensor<4> {
        let layout = self.layout;
        match &self.data {
            BlockData::Float { blocks } => {
                in_dtype(gathered_batch(blocks, layout, sequences), dtype)
            }
            BlockData::Int8 { values, scales } => dequantize_int8(
                gathered_batch(values, layout, sequences),
                gathered_batch(scales, layout, sequences),
                dtype,
            ),
        }
    }
}

/// How the tensor ops write a step's rows into a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TensorOpWrites {
    /// One assignment per write and block it touches.
    ByBlock,
    /// The writes of at most [`SCATTERED_ROWS`] rows in one scatter where there are two or
    /// more (vLLM's `reshape_and_cache`), the others by block.
    Scatter,
}

/// Rows of a step's sequence that go into the step's one scatter: a decoding step's row, a
/// continuation's few. Why a bound: a prompt's run of whole blocks is as well written by one
/// assignment per block, without its indices to upload.
const SCATTERED_ROWS: usize = 32;

/// The rows of `rows` (`[1, heads, step rows, dim]`) that `slots` name, in their order: the
/// tensor itself where they are all of its rows in order.
fn picked_rows(rows: &Tensor<4>, slots: &[Slot]) -> Tensor<4> {
    let first = slots[0].row;
    let in_a_run = slots
        .iter()
        .enumerate()
        .all(|(index, slot)| slot.row == first + index);
    if in_a_run && first == 0 && slots.len() == rows.dims()[2] {
        rows.clone()
    } else if in_a_run {
        rows.clone().narrow(2, first, slots.len())
    } else {
        let indices: Vec<i64> = slots.iter().map(|slot| slot.row as i64).collect();
        let indices =
            Tensor::<1, Int>::from_data(TensorData::new(indices, [slots.len()]), &rows.device());
        rows.clone().select(2, indices)
    }
}

/// The indices `[rows, heads, 3]` of a scatter of `slots`' rows of `heads` heads into a pool
/// seen position-major (`[blocks, heads, block_size, dim]`): a row's block, head and position,
/// its `dim` features one slice.
fn scatter_indices(slots: &[Slot], heads: usize) -> Vec<i64> {
    slots
        .iter()
        .flat_map(|slot| {
            (0..heads as i64).flat_map(|head| [slot.block as i64, head, slot.offset as i64])
        })
        .collect()
}

/// One sequence's rows of a step, and where they go.
pub(crate) struct RowsWrite<'a> {
    /// The sequence's table, with blocks for every position written.
    pub table: &'a BlockTable,
    /// Positions stored before the step: the first row goes to this one.
    pub past: usize,
    /// The step's rows that are the sequence's.
    pub rows: Range<usize>,
}

impl RowsWrite<'_> {
    /// The block and offset of each of the rows, blocks of `block_size` positions.
    fn slots(&self, block_size: usize) -> impl Iterator<Item = Slot> + '_ {
        self.rows.clone().enumerate().map(move |(index, row)| {
            let position = self.past + index;
            Slot {
                row,
                block: self.table.blocks[position / block_size],
                offset: position % block_size,
            }
        })
    }
}

/// Position-major rows or blocks (`[n, heads, positions, dim]`) in `layout`.
fn laid_out<T: BlockTensor>(rows: T, layout: BlockLayout) -> T {
    match layout {
        BlockLayout::PositionMajor => rows,
        BlockLayout::FeatureMajor => rows.swapped_last(),
    }
}

/// What [`BlockStore`] does to its float and int tensors alike. The pool is taken by value
/// and given back: assigning into a tensor held once writes in place (flex), where a clone
/// still alive would make the backend copy the whole pool.
pub(crate) trait BlockTensor: Clone + Sized {
    fn dims(&self) -> [usize; 4];
    fn device(&self) -> Device;
    fn block(&self, block: usize) -> Self;
    /// A copy in memory of its own (the same values to the bit), so that assigning it into
    /// the tensor it was read from finds that tensor held once.
    fn materialized(self) -> Self;
    /// `part` assigned into block `block` from offsets `[axis 2, axis 3]`.
    fn with_block(self, block: usize, offsets: [usize; 2], part: Self) -> Self;
    fn with_zeros(self, extra: usize) -> Self;
    fn select_blocks(&self, blocks: Tensor<1, Int>) -> Self;
    fn reshaped(self, shape: [usize; 4]) -> Self;
    fn swapped_first(self) -> Self;
    /// Axes 1 and 2 swapped.
    fn swapped_middle(self) -> Self;
    fn swapped_last(self) -> Self;
    fn narrowed(self, axis: usize, start: usize, len: usize) -> Self;
    /// Row `i` of `rows` (`[1, heads, slots, dim]`, position-major) assigned at `slots[i]` of
    /// the pool (laid out as `layout`), in one scatter: a feature-major pool through its
    /// position-major view (its last two axes swapped, no copy where the backend scatters
    /// into strided memory in place, as CubeCL's does), so that a row's features are one
    /// slice of three indices rather than `dim` elements of four.
    fn with_rows_scattered(self, layout: BlockLayout, slots: &[Slot], rows: Self) -> Self;
}

macro_rules! block_tensor {
    ($tensor:ty, $materialize:expr) => {
        impl BlockTensor for $tensor {
            fn dims(&self) -> [usize; 4] {
                Tensor::dims(self)
            }
            fn device(&self) -> Device {
                Tensor::device(self)
            }
            fn block(&self, block: usize) -> Self {
                self.clone().narrow(0, block, 1)
            }
            fn materialized(self) -> Self {
                $materialize(self)
            }
            fn with_block(self, block: usize, offsets: [usize; 2], part: Self) -> Self {
                let [_, heads, rows, columns] = Tensor::dims(&part);
                let [row, column] = offsets;
                self.slice_assign(
                    [
                        block..block + 1,
                        0..heads,
                        row..row + rows,
                        column..column + columns,
                    ],
                    part,
                )
            }
            fn with_zeros(self, extra: usize) -> Self {
                with_zeros_after(self, 0, extra)
            }
            fn select_blocks(&self, blocks: Tensor<1, Int>) -> Self {
                self.clone().select(0, blocks)
            }
            fn reshaped(self, shape: [usize; 4]) -> Self {
                self.reshape(shape)
            }
            fn swapped_first(self) -> Self {
                self.swap_dims(0, 1)
            }
            fn swapped_middle(self) -> Self {
                self.swap_dims(1, 2)
            }
            fn swapped_last(self) -> Self {
                self.swap_dims(2, 3)
            }
            fn narrowed(self, axis: usize, start: usize, len: usize) -> Self {
                self.narrow(axis, start, len)
            }
            fn with_rows_scattered(self, layout: BlockLayout, slots: &[Slot], rows: Self) -> Self {
                let [_, heads, count, dim] = Tensor::dims(&rows);
                let indices = TensorData::new(scatter_indices(slots, heads), [count, heads, 3]);
                let indices = Tensor::<3, Int>::from_data(indices, &Tensor::device(&self));
                let rows = rows.swap_dims(0, 2).reshape([count, heads, dim]);
                let update = IndexingUpdateOp::Assign;
                match layout {
                    BlockLayout::PositionMajor => self.scatter_nd(indices, rows, update),
                    BlockLayout::FeatureMajor => self
                        .swap_dims(2, 3)
                        .scatter_nd(indices, rows, update)
                        .swap_dims(2, 3),
                }
            }
        }
    };
}

// `x · 1` is `x` to the bit, -0 and NaN included (`x + 0` turns -0 into +0).
block_tensor!(Tensor<4>, |tensor: Tensor<4>| tensor.mul_scalar(1.0));
block_tensor!(Tensor<4, Int>, |tensor: Tensor<4, Int>| tensor.add_scalar(0));

/// `pool` with `rows` (`[1, heads, n, dim]` laid out as `layout`) written at positions
/// `past..past + n` of `table`, one assignment per block they touch.
fn write_rows<T: BlockTensor>(
    mut pool: T,
    layout: BlockLayout,
    table: &BlockTable,
    past: usize,
    rows: T,
) -> T {
    let axis = layout.position_axis();
    let block_size = pool.dims()[axis];
    let count = rows.dims()[axis];
    let mut written = 0;
    while written < count {
        let position = past + written;
        let offset = position % block_size;
        let chunk = (block_size - offset).min(count - written);
        let block = table.blocks[position / block_size];
        let part = if chunk == count {
            rows.clone()
        } else {
            rows.clone().narrowed(axis, written, chunk)
        };
        let offsets = match layout {
            BlockLayout::PositionMajor => [offset, 0],
            BlockLayout::FeatureMajor => [0, offset],
        };
        pool = pool.with_block(block, offsets, part);
        written += chunk;
    }
    pool
}

/// The positions of `table` from its first held one up to `len` in `pool`, `[1, heads,
/// positions, dim]` whatever the layout.
fn gathered<T: BlockTensor>(pool: &T, layout: BlockLayout, table: &BlockTable, len: usize) -> T {
    let block_size = pool.dims()[layout.position_axis()];
    let used = len.div_ceil(block_size) - table.released;
    let indices: Vec<i64> = table.blocks[table.released..][..used]
        .iter()
        .map(|&b| b as i64)
        .collect();
    let indices = Tensor::<1, Int>::from_data(TensorData::new(indices, [used]), &pool.device());
    let blocks = laid_out(pool.select_blocks(indices), layout);
    let [_, heads, _, dim] = blocks.dims();
    blocks
        .swapped_first()
        .reshaped([1, heads, used * block_size, dim])
        .narrowed(2, 0, len - table.first_held(block_size))
}

/// [`gathered`] for each of `sequences` at once, padded behind to the whole blocks of the
/// longest, `[sequences, heads, blocks · block_size, dim]`: one select of every sequence's held
/// blocks, as many per sequence (padded with block 0, whatever it holds).
fn gathered_batch<T: BlockTensor>(
    pool: &T,
    layout: BlockLayout,
    sequences: &[(&BlockTable, usize)],
) -> T {
    let block_size = pool.dims()[layout.position_axis()];
    let held = |(table, len): &(&BlockTable, usize)| -> Vec<usize> {
        table.blocks[table.released..len.div_ceil(block_size)].to_vec()
    };
    let held: Vec<Vec<usize>> = sequences.iter().map(held).collect();
    let most = held.iter().map(Vec::len).max().unwrap_or(0);
    assert!(
        most > 0,
        "gathered_batch: no sequence holds a stored position"
    );
    let indices: Vec<i64> = held
        .iter()
        .flat_map(|blocks| (0..most).map(|i| blocks.get(i).map_or(0, |&b| b as i64)))
        .collect();
    let count = sequences.len();
    let indices =
        Tensor::<1, Int>::from_data(TensorData::new(indices, [count * most]), &pool.device());
    let blocks = laid_out(pool.select_blocks(indices), layout);
    let [_, heads, _, dim] = blocks.dims();
    blocks
        .reshaped([count, most, heads, block_size * dim])
        .swapped_middle()
        .reshaped([count, heads, most * block_size, dim])
}

// The tests run on flex.
#[cfg(all(test, feature = "flex"))]
mod tests {
    use super::*;
    use crate::cpu::aligned::starts_on_a_line;

    #[test]
    fn a_grown_pool_starts_on_a_cache_line() {
        let device = Device::flex();
        for storage in [CacheStorage::Float, CacheStorage::Half, CacheStorage::Int8] {
            for layout in [BlockLayout::PositionMajor, BlockLayout::FeatureMajor] {
                let config = PagedKvCacheConfig::new(64).with_storage(storage);
                let store =
                    BlockStore::new(config, layout, (2, 64), (&device, DType::F32)).grown(40);
                assert_eq!(store.blocks(), 40);
                let buffers = match store.data {
                    BlockData::Float { blocks } => vec![starts_on_a_line(blocks)],
                    BlockData::Int8 { values, scales } => {
                        vec![starts_on_a_line(values), starts_on_a_line(scales)]
                    }
                };
                assert_eq!(buffers, vec![true; buffers.len()], "{storage:?} {layout:?}");
            }
        }
    }

    /// A store's tensors as f32 or i32 data, to compare two stores to the bit.
    fn contents(store: BlockStore) -> Vec<TensorData> {
        match store.data {
            BlockData::Float { blocks } => vec![blocks.into_data()],
            BlockData::Int8 { values, scales } => vec![values.into_data(), scales.into_data()],
        }
    }

    /// A step's short writes in one scatter leave the pool as one assignment per write and
    /// block does, in every storage and layout: the short writes' rows a run of the step's
    /// rows beside a prompt's long write, apart around it, and every row of the step.
    #[test]
    fn a_steps_short_writes_in_one_scatter_equal_block_writes() {
        let device = Device::flex();
        let (heads, dim, block_size) = (2, 3, 4);
        let table = |blocks: Vec<usize>, len: usize| BlockTable {
            blocks,
            len,
            released: 0,
        };
        // One row at position 5; three rows from 3, across a block's end; a prompt of 40.
        let one_row = table(vec![4, 0], 6);
        let three_rows = table(vec![2, 6], 6);
        let prompt = table((7..17).collect(), 40);
        let values: Vec<f32> = (0..heads * 44 * dim)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.173)
            .collect();
        let rows = Tensor::<4>::from_data(TensorData::new(values, [1, heads, 44, dim]), &device);
        let steps = [
            vec![
                (&one_row, 5, 0..1),
                (&three_rows, 3, 1..4),
                (&prompt, 0, 4..44),
            ],
            vec![
                (&one_row, 5, 0..1),
                (&prompt, 0, 1..41),
                (&three_rows, 3, 41..44),
            ],
            vec![(&one_row, 5, 0..1), (&three_rows, 3, 1..4)],
        ];
        for storage in [CacheStorage::Float, CacheStorage::Half, CacheStorage::Int8] {
            for layout in [BlockLayout::PositionMajor, BlockLayout::FeatureMajor] {
                let config = PagedKvCacheConfig::new(17)
                    .with_block_size(block_size)
                    .with_storage(storage);
                let options = (&device, DType::F32);
                for step in &steps {
                    let empty = BlockStore::new(config, layout, (heads, dim), options).grown(17);
                    let writes: Vec<RowsWrite> = step
                        .iter()
                        .map(|(table, past, rows)| RowsWrite {
                            table,
                            past: *past,
                            rows: rows.clone(),
                        })
                        .collect();
                    let step_rows = step.iter().map(|(_, _, rows)| rows.len()).sum();
                    let rows = rows.clone().narrow(2, 0, step_rows);
                    let write = |how| {
                        let store = empty.clone();
                        contents(store.written_by_tensor_ops(&writes, &rows, how))
                    };
                    assert_eq!(
                        write(TensorOpWrites::Scatter),
                        write(TensorOpWrites::ByBlock),
                        "{storage:?} {layout:?} {:?}",
                        step.iter().map(|(_, _, rows)| rows).collect::<Vec<_>>()
                    );
                }
            }
        }
    }
}
