//! The paged step's attention on flex's and ndarray's f32 storage: every query reads its
//! sequence's keys and values through the block table, block by block, where they lie in the
//! pool (no gather into a contiguous copy), with an online softmax over the blocks. An int8
//! pool is read as it is stored, i8 and a scale per position (nothing dequantized into memory),
//! so that a step reads a quarter of the bytes; an f16 pool likewise, converted as it is read
//! (half the bytes).
//!
//! A task is a run of at most 16 consecutive rows of one sequence (a prompt's rows spread over
//! rayon's threads) and a part of the positions they see (a long sequence's spread too): each
//! tile of keys and values is read by all its rows, each key/value head's query heads share
//! every key and value row they read (GQA without copies), and the parts of a run of rows are
//! merged at the end (`plan`, `merge`).

use std::ops::Range;
use std::sync::Arc;

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::{DType, Int, Tensor, f16};
use rayon::prelude::*;

use super::cache::{PagedKvCache, SequenceStep};
use super::step::StepHeads;
use super::store::{BlockLayout, StoredBlocks};
use crate::alibi::alibi_slopes_f32;
use crate::cache::CompressedCache;
use crate::cpu::matrix::{HeadIndex, HeadsView, Matrix, transposed_copy};
use crate::cpu::storage::{CpuStorage, native_storage};
use crate::module::MultiHeadAttention;

mod merge;
mod plan;
mod sequence;
mod write;

use merge::PartialRows;
use plan::Task;
use sequence::task_softmaxes;
pub(crate) use write::{Int8Blocks, PoolWrite, Slot, native_write, native_write_int8};

/// One sequence of a paged step as the kernel reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PagedSequence {
    /// The step's rows (queries, new keys and values) that are this sequence's.
    pub rows: Range<usize>,
    /// Positions stored in the blocks before the step; the new ones come from the step's rows.
    pub past: usize,
    /// The sequence's block table: the blocks wholly before `hidden` are never read, and may
    /// be no block of the pool (one a paged sequence gave back,
    /// [`RELEASED`](super::cache::RELEASED)).
    pub blocks: Vec<usize>,
    /// Positions before this one are hidden from every row (a [`KvCache`](crate::KvCache)
    /// batch's evicted positions and left padding; a paged sequence's positions given back
    /// behind the window).
    pub hidden: usize,
}

/// What a paged attention call computes besides its tensors.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PagedParams {
    pub sequences: Arc<[PagedSequence]>,
    /// Multiplies `q · k`.
    pub scale: f32,
    /// Scores become `softcap · tanh(score / softcap)` after scaling, before ALiBi.
    pub softcap: Option<f32>,
    /// ALiBi's slope per query head.
    pub alibi: Option<Arc<[f32]>>,
    /// A key `window` or more positions before its query is hidden.
    pub window: Option<usize>,
    /// One more logit per query head in every softmax's denominator.
    pub sinks: Option<Arc<[f32]>>,
}

/// Backends whose storage the paged kernel reads in place.
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray")
)]
pub(crate) trait PagedAttentionBackend: Backend {
    /// Causal attention of each sequence's queries over its stored positions (through its
    /// block table) and its new ones.
    ///
    /// # Shapes
    ///
    /// - query: `[1, n_heads, rows, head_dim]`
    /// - key_blocks: `[blocks, n_kv_heads, head_dim, block_size]` (feature-major), f32 or f16
    /// - value_blocks: `[blocks, n_kv_heads, block_size, head_dim]`, as the keys
    /// - new_key, new_value: `[1, n_kv_heads, rows, head_dim]`
    /// - output: `[1, n_heads, rows, head_dim]`
    fn paged_attention(
        query: FloatTensor<Self>,
        key_blocks: FloatTensor<Self>,
        value_blocks: FloatTensor<Self>,
        new_key: FloatTensor<Self>,
        new_value: FloatTensor<Self>,
        params: PagedParams,
    ) -> FloatTensor<Self>;

    /// [`PagedAttentionBackend::paged_attention`] over an int8 pool: i8 blocks and their
    /// scales, dequantized as they are read.
    ///
    /// # Shapes
    ///
    /// - key_blocks: `[blocks, n_kv_heads, head_dim, block_size]` i8, key_scales
    ///   `[blocks, n_kv_heads, 1, block_size]`
    /// - value_blocks: `[blocks, n_kv_heads, block_size, head_dim]` i8, value_scales
    ///   `[blocks, n_kv_heads, block_size, 1]`
    /// - the others as in [`PagedAttentionBackend::paged_attention`]
    // The backend extension takes each tensor as an argument of its own.
    #[allow(clippy::too_many_arguments)]
    fn paged_attention_int8(
        query: FloatTensor<Self>,
        key_blocks: IntTensor<Self>,
        key_scales: FloatTensor<Self>,
        value_blocks: IntTensor<Self>,
        value_scales: FloatTensor<Self>,
        new_key: FloatTensor<Self>,
        new_value: FloatTensor<Self>,
        params: PagedParams,
    ) -> FloatTensor<Self>;
}

macro_rules! native_paged_attention_backend {
    ($backend:ty) => {
        impl PagedAttentionBackend for $backend {
            fn paged_attention(
                query: FloatTensor<Self>,
                key_blocks: FloatTensor<Self>,
                value_blocks: FloatTensor<Self>,
                new_key: FloatTensor<Self>,
                new_value: FloatTensor<Self>,
                params: PagedParams,
            ) -> FloatTensor<Self> {
                // An f16 pool is `CacheStorage::Half`'s; the others are in the module's type.
                let pool = if burn::backend::TensorMetadata::dtype(&key_blocks) == DType::F16 {
                    PoolTensors::Half {
                        keys: key_blocks,
                        values: value_blocks,
                    }
                } else {
                    PoolTensors::Float {
                        keys: key_blocks,
                        values: value_blocks,
                    }
                };
                paged_attention::<Self>(
                    PagedTensors {
                        query,
                        pool,
                        new_key,
                        new_value,
                    },
                    &params,
                )
            }

            fn paged_attention_int8(
                query: FloatTensor<Self>,
                key_blocks: IntTensor<Self>,
                key_scales: FloatTensor<Self>,
                value_blocks: IntTensor<Self>,
                value_scales: FloatTensor<Self>,
                new_key: FloatTensor<Self>,
                new_value: FloatTensor<Self>,
                params: PagedParams,
            ) -> FloatTensor<Self> {
                paged_attention::<Self>(
                    PagedTensors {
                        query,
                        pool: PoolTensors::Int8 {
                            keys: key_blocks,
                            key_scales,
                            values: value_blocks,
                            value_scales,
                        },
                        new_key,
                        new_value,
                    },
                    &params,
                )
            }
        }
    };
}

#[cfg(feature = "flex")]
native_paged_attention_backend!(burn::backend::Flex);
#[cfg(feature = "ndarray")]
native_paged_attention_backend!(burn::backend::NdArray);

/// The context heads `[1, n_heads, rows, head_dim]` of `sequences` (of the step's rows; the
/// other rows are zeros) computed through the block tables, where the native kernel takes the
/// step: flex or ndarray outside autodiff, f32, float, f16 or int8 storage, no appended key
/// positions. `None` elsewhere.
pub(crate) fn native_paged_attention(
    module: &MultiHeadAttention,
    heads: &StepHeads,
    sequences: &[&SequenceStep],
    cache: &PagedKvCache,
) -> Option<Tensor<4>> {
    if !native_kernel_runs(module, &heads.query) {
        return None;
    }
    let (key_store, value_store) = cache.stores()?;
    assert!(
        key_store.layout() == BlockLayout::FeatureMajor
            && value_store.layout() == BlockLayout::PositionMajor,
        "paged attention: keys are stored feature-major, values position-major"
    );
    let sequences = sequences
        .iter()
        .map(|sequence| PagedSequence {
            rows: sequence.rows.clone(),
            past: sequence.past,
            blocks: sequence.table.blocks.clone(),
            // The blocks given back, behind the window of every row of the step: hidden, so
            // that no row reads them.
            hidden: sequence.table.first_held(cache.block_size()),
        })
        .collect();
    let params = kernel_params(module, &heads.query, sequences, module.window)?;
    let pool = PoolRefs::of(key_store.stored(), value_store.stored())?;
    run_kernel(pool, heads.clone(), params)
}

/// The context heads `[batch, n_heads, new, head_dim]` of a decoding step over a compressed
/// [`KvCache`](crate::KvCache) read in place: each batch element is a sequence whose blocks
/// are its tiles of `cache`'s buffers, `cache.stored` positions stored after `cache.evicted`
/// evicted ones (hidden), its `new` rows causal among themselves, the first `hidden[element]`
/// stored positions hidden (left padding; none without `hidden`), `window` as the cache and
/// module combine it. `None` where the native kernel does not take the step (as
/// [`native_paged_attention`]).
///
/// `new` holds the query heads `[batch, n_heads, new, head_dim]` and the new key and value
/// heads `[batch, n_kv_heads, new, head_dim]`.
///
/// # Panics
///
/// If `hidden` does not have a count per batch element.
pub(crate) fn native_cached_attention(
    module: &MultiHeadAttention,
    new: StepHeads,
    cache: CompressedCache,
    window: Option<usize>,
    hidden: Option<&[usize]>,
) -> Option<Tensor<4>> {
    let [batch, n_heads, rows, head_dim] = new.query.dims();
    assert!(
        hidden.is_none_or(|hidden| hidden.len() == batch),
        "cached attention: {hidden:?} hidden positions for a batch of {batch}"
    );
    let sequences = (0..batch)
        .map(|element| PagedSequence {
            rows: element * rows..(element + 1) * rows,
            // Positions a window evicted are hidden as left padding is: the kernel's
            // causality, window and ALiBi distances are all relative to a row's position.
            past: cache.evicted + cache.stored,
            blocks: cache.blocks_of(element),
            hidden: cache.evicted + hidden.map_or(0, |hidden| hidden[element]),
        })
        .collect();
    let params = kernel_params(module, &new.query, sequences, window)?;
    let pool = PoolRefs::of(cache.keys, cache.values)?;
    // The batch's rows one after the other, as a paged step's are.
    let rows_of = |heads: Tensor<4>| {
        let [batch, heads_count, rows, dim] = heads.dims();
        heads
            .swap_dims(0, 1)
            .reshape([1, heads_count, batch * rows, dim])
    };
    let new = StepHeads {
        query: rows_of(new.query),
        key: rows_of(new.key),
        value: rows_of(new.value),
    };
    let output = run_kernel(pool, new, params)?;
    Some(
        output
            .reshape([n_heads, batch, rows, head_dim])
            .swap_dims(0, 1),
    )
}

/// Whether the native kernel takes `module`'s attention of `query`: flex or ndarray outside
/// autodiff, f32, no appended key positions.
pub(crate) fn native_kernel_runs(module: &MultiHeadAttention, query: &Tensor<4>) -> bool {
    let device = query.device();
    native_storage(&device)
        && !device.is_autodiff()
        && query.dtype() == DType::F32
        && module.extra_keys() == 0
}

/// A call's parameters for `module`'s attention over `sequences`; `None` where the native
/// kernel does not run ([`native_kernel_runs`]).
fn kernel_params(
    module: &MultiHeadAttention,
    query: &Tensor<4>,
    sequences: Arc<[PagedSequence]>,
    window: Option<usize>,
) -> Option<PagedParams> {
    if !native_kernel_runs(module, query) {
        return None;
    }
    let device = query.device();
    let sinks = module
        .softmax_options(&device)
        .sinks
        .map(|sinks| sinks.into_data().try_into_vec_as::<f32>())
        .transpose()
        .ok()?;
    Some(PagedParams {
        sequences,
        scale: module.scale as f32,
        softcap: module.softcap.map(|cap| cap as f32),
        alibi: module
            .alibi
            .then(|| alibi_slopes_f32(module.n_heads).into()),
        window,
        sinks: sinks.map(Arc::from),
    })
}

/// The blocks a call reads, as tensors.
enum PoolRefs<'a> {
    /// f32 or f16 blocks.
    Float {
        keys: &'a Tensor<4>,
        values: &'a Tensor<4>,
    },
    Int8 {
        keys: &'a Tensor<4, Int>,
        key_scales: &'a Tensor<4>,
        values: &'a Tensor<4, Int>,
        value_scales: &'a Tensor<4>,
    },
}

impl<'a> PoolRefs<'a> {
    /// The pool of `keys` and `values` stored alike (float or f16, or int8); `None` for a mix.
    fn of(keys: StoredBlocks<'a>, values: StoredBlocks<'a>) -> Option<Self> {
        Some(match (keys, values) {
            (StoredBlocks::Float(keys), StoredBlocks::Float(values)) => {
                Self::Float { keys, values }
            }
            (
                StoredBlocks::Int8 {
                    values: keys,
                    scales: key_scales,
                },
                StoredBlocks::Int8 {
                    values,
                    scales: value_scales,
                },
            ) => Self::Int8 {
                keys,
                key_scales,
                values,
                value_scales,
            },
            _ => return None,
        })
    }
}

/// The kernel on `pool` and the step's rows `new` (`[1, heads, rows, head_dim]` each);
/// `None` for int8 scales that are not f32.
fn run_kernel(pool: PoolRefs, new: StepHeads, params: PagedParams) -> Option<Tensor<4>> {
    let StepHeads { query, key, value } = new;
    let (query, new_key, new_value) = (
        query.into_dispatch(),
        key.into_dispatch(),
        value.into_dispatch(),
    );
    let output = match pool {
        PoolRefs::Float { keys, values } => <Dispatch as PagedAttentionBackend>::paged_attention(
            query,
            keys.clone().into_dispatch(),
            values.clone().into_dispatch(),
            new_key,
            new_value,
            params,
        ),
        PoolRefs::Int8 {
            keys,
            key_scales,
            values,
            value_scales,
        } if key_scales.dtype() == DType::F32 && value_scales.dtype() == DType::F32 => {
            <Dispatch as PagedAttentionBackend>::paged_attention_int8(
                query,
                keys.clone().into_dispatch(),
                key_scales.clone().into_dispatch(),
                values.clone().into_dispatch(),
                value_scales.clone().into_dispatch(),
                new_key,
                new_value,
                params,
            )
        }
        PoolRefs::Int8 { .. } => return None,
    };
    Some(Tensor::from_dispatch(output))
}

/// A call's tensors on the backend that computes it.
struct PagedTensors<B: Backend> {
    query: FloatTensor<B>,
    pool: PoolTensors<B>,
    new_key: FloatTensor<B>,
    new_value: FloatTensor<B>,
}

/// The pool's blocks of keys (feature-major) and values (position-major).
enum PoolTensors<B: Backend> {
    Float {
        keys: FloatTensor<B>,
        values: FloatTensor<B>,
    },
    /// f16 blocks (`CacheStorage::Half`).
    Half {
        keys: FloatTensor<B>,
        values: FloatTensor<B>,
    },
    /// i8 blocks and their scales (`[blocks, n_kv_heads, 1, block_size]` for the keys,
    /// `[blocks, n_kv_heads, block_size, 1]` for the values).
    Int8 {
        keys: IntTensor<B>,
        key_scales: FloatTensor<B>,
        values: IntTensor<B>,
        value_scales: FloatTensor<B>,
    },
}

/// The call's tensors read in place.
struct Views<'a> {
    query: HeadsView<'a>,
    pool: PoolViews<'a>,
    new_key_columns: NewKeyColumns<'a>,
    new_value: HeadsView<'a>,
}

/// The step's new keys feature-major, a `[head_dim, rows]` matrix per key/value head (copied
/// once per step): the layout of the blocks' keys, the one the tile kernel reads (its vector
/// path 16 positions of a feature at a time).
struct NewKeyColumns<'a> {
    heads: Vec<Matrix<'a>>,
}

impl<'a> NewKeyColumns<'a> {
    /// Each key/value head of `new_key` (`[1, n_kv_heads, rows, head_dim]`) transposed into
    /// its buffer of `buffers` (one per head).
    fn copy(buffers: &'a mut Vec<Vec<f32>>, new_key: &HeadsView) -> Self {
        let n_kv_heads = new_key.shape()[1];
        buffers.resize_with(n_kv_heads, Vec::new);
        let heads = buffers
            .iter_mut()
            .enumerate()
            .map(|(head, buffer)| {
                transposed_copy(buffer, new_key.head(HeadIndex { batch: 0, head }))
            })
            .collect();
        Self { heads }
    }

    /// The keys of rows `row..row + count` of key/value head `kv_head`, feature `f` of row
    /// `row + i` at `f · stride + i`, and the stride.
    ///
    /// # Panics
    ///
    /// If they are not rows of the step.
    fn keys(&self, kv_head: usize, row: usize, count: usize) -> (&'a [f32], usize) {
        let columns = self.heads[kv_head].columns(row, count);
        (columns.values, columns.row_stride)
    }
}

/// [`PoolTensors`] read in place.
enum PoolViews<'a> {
    Float {
        keys: HeadsView<'a>,
        values: HeadsView<'a>,
    },
    Half {
        keys: HeadsView<'a, f16>,
        values: HeadsView<'a, f16>,
    },
    Int8 {
        keys: HeadsView<'a, i8>,
        key_scales: HeadsView<'a>,
        values: HeadsView<'a, i8>,
        value_scales: HeadsView<'a>,
    },
}

impl PoolViews<'_> {
    /// `[blocks, n_kv_heads, head_dim, block_size]`.
    fn key_shape(&self) -> [usize; 4] {
        match self {
            Self::Float { keys, .. } => keys.shape(),
            Self::Half { keys, .. } => keys.shape(),
            Self::Int8 { keys, .. } => keys.shape(),
        }
    }

    /// `[blocks, n_kv_heads, block_size, head_dim]`.
    fn value_shape(&self) -> [usize; 4] {
        match self {
            Self::Float { values, .. } => values.shape(),
            Self::Half { values, .. } => values.shape(),
            Self::Int8 { values, .. } => values.shape(),
        }
    }

    /// Bytes per stored key or value (an int8 pool's scales aside).
    fn element_bytes(&self) -> usize {
        match self {
            Self::Float { .. } => 4,
            Self::Half { .. } => 2,
            Self::Int8 { .. } => 1,
        }
    }
}

/// Sizes of a call.
#[derive(Clone, Copy)]
struct Sizes {
    rows: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
}

/// [`PagedAttentionBackend::paged_attention`] on a CPU backend's storage.
///
/// # Panics
///
/// If the tensors are not f32 of the documented shapes, a sequence's rows or blocks lie outside
/// them, or `n_heads` is not a multiple of `n_kv_heads`.
fn paged_attention<B: CpuStorage>(
    tensors: PagedTensors<B>,
    params: &PagedParams,
) -> FloatTensor<B> {
    let readable = |tensor: &FloatTensor<B>| B::readable(tensor).expect("f32 tensors");
    let half_readable = |tensor: &FloatTensor<B>| B::half_readable(tensor).expect("f16 blocks");
    let int8_readable = |tensor: &IntTensor<B>| B::int8_readable(tensor).expect("i8 blocks");
    let tensors = PagedTensors::<B> {
        query: readable(&tensors.query),
        pool: match &tensors.pool {
            PoolTensors::Float { keys, values } => PoolTensors::Float {
                keys: readable(keys),
                values: readable(values),
            },
            PoolTensors::Half { keys, values } => PoolTensors::Half {
                keys: half_readable(keys),
                values: half_readable(values),
            },
            PoolTensors::Int8 {
                keys,
                key_scales,
                values,
                value_scales,
            } => PoolTensors::Int8 {
                keys: int8_readable(keys),
                key_scales: readable(key_scales),
                values: int8_readable(values),
                value_scales: readable(value_scales),
            },
        },
        new_key: readable(&tensors.new_key),
        new_value: readable(&tensors.new_value),
    };
    let view = |tensor| B::heads_view(tensor).expect("a readable layout");
    let new_key = view(&tensors.new_key);
    let mut new_key_columns = Vec::new();
    let half_view = |tensor| B::half_heads_view(tensor).expect("a readable layout");
    let int8_view = |tensor| B::int8_heads_view(tensor).expect("a readable layout");
    let views = Views {
        query: view(&tensors.query),
        pool: match &tensors.pool {
            PoolTensors::Float { keys, values } => PoolViews::Float {
                keys: view(keys),
                values: view(values),
            },
            PoolTensors::Half { keys, values } => PoolViews::Half {
                keys: half_view(keys),
                values: half_view(values),
            },
            PoolTensors::Int8 {
                keys,
                key_scales,
                values,
                value_scales,
            } => PoolViews::Int8 {
                keys: int8_view(keys),
                key_scales: view(key_scales),
                values: int8_view(values),
                value_scales: view(value_scales),
            },
        },
        new_key_columns: NewKeyColumns::copy(&mut new_key_columns, &new_key),
        new_value: view(&tensors.new_value),
    };
    let [_, n_heads, rows, head_dim] = views.query.shape();
    let [pool_blocks, n_kv_heads, key_dim, block_size] = views.pool.key_shape();
    let sizes = Sizes {
        rows,
        n_heads,
        n_kv_heads,
        head_dim,
        block_size,
    };
    check_inputs(&views, new_key.shape(), sizes, pool_blocks, key_dim, params);
    let tasks = plan::tasks(&params.sequences, block_size, params.window);
    let softmaxes = |task: &Task| task_softmaxes(&views, sizes, params, task);
    // One task (a short sequence's decoding step) runs on the calling thread: handing it to
    // rayon's would only add the handover.
    let partials: Vec<PartialRows> = if tasks.len() == 1 {
        vec![softmaxes(&tasks[0])]
    } else {
        tasks.par_iter().map(softmaxes).collect()
    };
    // `[1, rows, n_heads, head_dim]`: each run of rows, whole, in place.
    let width = n_heads * head_dim;
    let mut output = vec![0.0f32; rows * width];
    for (rows, result) in merge::merged_outputs(&tasks, partials, params, head_dim) {
        output[rows.start * width..rows.end * width].copy_from_slice(&result);
    }
    B::sequence_major(output, [1, n_heads, rows, head_dim])
}

/// Panics unless the call's shapes and tables agree.
fn check_inputs(
    views: &Views,
    new_key_shape: [usize; 4],
    sizes: Sizes,
    pool_blocks: usize,
    key_dim: usize,
    params: &PagedParams,
) {
    let Sizes {
        rows,
        n_heads,
        n_kv_heads,
        head_dim,
        block_size,
    } = sizes;
    let mut expected = vec![
        (new_key_shape, [1, n_kv_heads, rows, head_dim]),
        (views.new_value.shape(), [1, n_kv_heads, rows, head_dim]),
        (
            views.pool.value_shape(),
            [pool_blocks, n_kv_heads, block_size, head_dim],
        ),
    ];
    if let PoolViews::Int8 {
        key_scales,
        value_scales,
        ..
    } = &views.pool
    {
        expected.push((key_scales.shape(), [pool_blocks, n_kv_heads, 1, block_size]));
        expected.push((
            value_scales.shape(),
            [pool_blocks, n_kv_heads, block_size, 1],
        ));
    }
    assert!(
        key_dim == head_dim
            && n_kv_heads > 0
            && n_heads.is_multiple_of(n_kv_heads)
            && expected.iter().all(|(shape, wanted)| shape == wanted),
        "paged attention: the key blocks {:?}, new keys {:?} and values {:?} (or the blocks' \
         scales) do not fit queries {:?}",
        views.pool.key_shape(),
        new_key_shape,
        views.new_value.shape(),
        views.query.shape()
    );
    for sequence in params.sequences.iter() {
        assert!(
            sequence.rows.end <= rows
                && sequence.past.div_ceil(block_size) <= sequence.blocks.len()
                && sequence.blocks[(sequence.hidden / block_size).min(sequence.blocks.len())..]
                    .iter()
                    .all(|&block| block < pool_blocks),
            "paged attention: {sequence:?} lies outside {rows} rows and {pool_blocks} blocks"
        );
    }
    let per_head = |values: &Option<Arc<[f32]>>| values.as_ref().is_none_or(|v| v.len() == n_heads);
    assert!(
        per_head(&params.alibi) && per_head(&params.sinks),
        "paged attention: ALiBi slopes and sinks need one value per query head ({n_heads})"
    );
}
