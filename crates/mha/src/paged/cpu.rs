//! The paged step's attention on flex's and ndarray's f32 storage: every query reads its
//! sequence's keys and values through the block table, block by block, where they lie in the
//! pool (no gather into a contiguous copy), with an online softmax over the blocks.
//!
//! A task is one sequence's rows: each key/value head's query heads share every key and value
//! row they read (GQA without copies), and tasks write disjoint outputs.

use std::ops::Range;
use std::sync::Arc;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::{DType, Tensor};
use rayon::prelude::*;

use super::cache::{PagedKvCache, SequenceStep};
use super::step::StepHeads;
use super::store::BlockLayout;
use crate::alibi::alibi_slopes;
use crate::cache::CacheStorage;
use crate::cpu::matrix::{HeadIndex, HeadsView};
use crate::cpu::simd;
use crate::cpu::storage::{CpuStorage, native_storage};
use crate::module::MultiHeadAttention;

/// One sequence of a paged step as the kernel reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PagedSequence {
    /// The step's rows (queries, new keys and values) that are this sequence's.
    pub rows: Range<usize>,
    /// Positions stored in the blocks before the step; the new ones come from the step's rows.
    pub past: usize,
    /// The sequence's block table.
    pub blocks: Vec<usize>,
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
    /// - key_blocks: `[blocks, n_kv_heads, head_dim, block_size]` (feature-major)
    /// - value_blocks: `[blocks, n_kv_heads, block_size, head_dim]`
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
                paged_attention::<Self>(
                    PagedTensors {
                        query,
                        key_blocks,
                        value_blocks,
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
/// step: flex or ndarray outside autodiff, f32, float storage, no appended key positions.
/// `None` elsewhere.
pub(crate) fn native_paged_attention(
    module: &MultiHeadAttention,
    heads: &StepHeads,
    sequences: &[&SequenceStep],
    cache: &PagedKvCache,
) -> Option<Tensor<4>> {
    let device = heads.query.device();
    let native = native_storage(&device)
        && !device.is_autodiff()
        && heads.query.dtype() == DType::F32
        && cache.config().storage == CacheStorage::Float
        && module.extra_keys() == 0;
    if !native {
        return None;
    }
    let (key_store, value_store) = cache.stores()?;
    let (key_blocks, value_blocks) = (key_store.float_blocks()?, value_store.float_blocks()?);
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
        })
        .collect();
    let sinks = module
        .softmax_options(&device)
        .sinks
        .map(|sinks| sinks.into_data().try_into_vec_as::<f32>())
        .transpose()
        .ok()?;
    let params = PagedParams {
        sequences,
        scale: module.scale as f32,
        softcap: module.softcap.map(|cap| cap as f32),
        alibi: module.alibi.then(|| {
            alibi_slopes(module.n_heads)
                .into_iter()
                .map(|slope| slope as f32)
                .collect()
        }),
        window: module.window,
        sinks: sinks.map(Arc::from),
    };
    let output = <Dispatch as PagedAttentionBackend>::paged_attention(
        heads.query.clone().into_dispatch(),
        key_blocks.clone().into_dispatch(),
        value_blocks.clone().into_dispatch(),
        heads.key.clone().into_dispatch(),
        heads.value.clone().into_dispatch(),
        params,
    );
    Some(Tensor::from_dispatch(output))
}

/// A call's tensors on the backend that computes it.
struct PagedTensors<B: Backend> {
    query: FloatTensor<B>,
    key_blocks: FloatTensor<B>,
    value_blocks: FloatTensor<B>,
    new_key: FloatTensor<B>,
    new_value: FloatTensor<B>,
}

/// The call's tensors read in place.
struct Views<'a> {
    query: HeadsView<'a>,
    key_blocks: HeadsView<'a>,
    value_blocks: HeadsView<'a>,
    new_key: HeadsView<'a>,
    new_value: HeadsView<'a>,
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
    let tensors = PagedTensors::<B> {
        query: readable(&tensors.query),
        key_blocks: readable(&tensors.key_blocks),
        value_blocks: readable(&tensors.value_blocks),
        new_key: readable(&tensors.new_key),
        new_value: readable(&tensors.new_value),
    };
    let view = |tensor| B::heads_view(tensor).expect("a readable layout");
    let views = Views {
        query: view(&tensors.query),
        key_blocks: view(&tensors.key_blocks),
        value_blocks: view(&tensors.value_blocks),
        new_key: view(&tensors.new_key),
        new_value: view(&tensors.new_value),
    };
    let [_, n_heads, rows, head_dim] = views.query.shape();
    let [pool_blocks, n_kv_heads, key_dim, block_size] = views.key_blocks.shape();
    let sizes = Sizes {
        rows,
        n_heads,
        n_kv_heads,
        head_dim,
        block_size,
    };
    check_inputs(&views, sizes, pool_blocks, key_dim, params);
    let results: Vec<Vec<f32>> = params
        .sequences
        .par_iter()
        .map(|sequence| sequence_output(&views, sizes, params, sequence))
        .collect();
    // `[1, rows, n_heads, head_dim]`: each sequence's rows, whole, in place.
    let width = n_heads * head_dim;
    let mut output = vec![0.0f32; rows * width];
    for (sequence, result) in params.sequences.iter().zip(&results) {
        let rows = &sequence.rows;
        output[rows.start * width..rows.end * width].copy_from_slice(result);
    }
    B::sequence_major(output, [1, n_heads, rows, head_dim])
}

/// Panics unless the call's shapes and tables agree.
fn check_inputs(
    views: &Views,
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
    let expected = [
        (views.new_key.shape(), [1, n_kv_heads, rows, head_dim]),
        (views.new_value.shape(), [1, n_kv_heads, rows, head_dim]),
        (
            views.value_blocks.shape(),
            [pool_blocks, n_kv_heads, block_size, head_dim],
        ),
    ];
    assert!(
        key_dim == head_dim
            && n_kv_heads > 0
            && n_heads.is_multiple_of(n_kv_heads)
            && expected.iter().all(|(shape, wanted)| shape == wanted),
        "paged attention: the key blocks {:?}, new keys {:?} and values {:?} do not fit queries \
         {:?}",
        views.key_blocks.shape(),
        views.new_key.shape(),
        views.new_value.shape(),
        views.query.shape()
    );
    for sequence in params.sequences.iter() {
        assert!(
            sequence.rows.end <= rows
                && sequence.past.div_ceil(block_size) <= sequence.blocks.len()
                && sequence.blocks.iter().all(|&block| block < pool_blocks),
            "paged attention: {sequence:?} lies outside {rows} rows and {pool_blocks} blocks"
        );
    }
    let per_head = |values: &Option<Arc<[f32]>>| values.as_ref().is_none_or(|v| v.len() == n_heads);
    assert!(
        per_head(&params.alibi) && per_head(&params.sinks),
        "paged attention: ALiBi slopes and sinks need one value per query head ({n_heads})"
    );
}

/// Consecutive positions of a sequence that one tile covers, for every key/value head: a
/// stored block's (or part of one), or the step's new rows.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Chunk {
    positions: Range<usize>,
    source: ChunkSource,
}

/// Where a chunk's keys and values lie.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkSource {
    /// Index `index` of the block table, from `offset` positions into the block.
    Stored { index: usize, offset: usize },
    /// The step's rows from `row` on.
    New { row: usize },
}

/// The chunks a query of `sequence` that sees positions `visible` reads, in order: its stored
/// positions block by block, then the step's new ones up to its own.
fn chunks(
    sequence: &PagedSequence,
    block_size: usize,
    visible: Range<usize>,
) -> impl Iterator<Item = Chunk> + '_ {
    let stored = visible.start..visible.end.min(sequence.past);
    let blocks = if stored.is_empty() {
        0..0
    } else {
        stored.start / block_size..stored.end.div_ceil(block_size)
    };
    let stored_chunks = blocks.map(move |index| {
        let first = (index * block_size).max(stored.start);
        let end = ((index + 1) * block_size).min(stored.end);
        Chunk {
            positions: first..end,
            source: ChunkSource::Stored {
                index,
                offset: first - index * block_size,
            },
        }
    });
    let new = visible.start.max(sequence.past)..visible.end;
    let new_chunk = (!new.is_empty()).then(|| Chunk {
        source: ChunkSource::New {
            row: sequence.rows.start + new.start - sequence.past,
        },
        positions: new,
    });
    stored_chunks.chain(new_chunk)
}

/// `chunk`'s keys and values of key/value head `kv_head`, where they lie.
fn tile<'a>(
    views: &Views<'a>,
    sequence: &PagedSequence,
    kv_head: usize,
    chunk: &Chunk,
) -> simd::KeyTile<'a> {
    let count = chunk.positions.len();
    let (keys, layout, values) = match chunk.source {
        ChunkSource::Stored { index, offset } => {
            let head = HeadIndex {
                batch: sequence.blocks[index],
                head: kv_head,
            };
            (
                views.key_blocks.head(head).columns(offset, count),
                simd::KeyLayout::Columns,
                views.value_blocks.head(head).rows(offset, count),
            )
        }
        ChunkSource::New { row } => {
            let head = HeadIndex {
                batch: 0,
                head: kv_head,
            };
            (
                views.new_key.head(head).rows(row, count),
                simd::KeyLayout::Rows,
                views.new_value.head(head).rows(row, count),
            )
        }
    };
    simd::KeyTile {
        keys: keys.values,
        key_stride: keys.row_stride,
        layout,
        values: values.values,
        value_stride: values.row_stride,
        count,
    }
}

/// Chunks a task asks the CPU for ahead of the one it computes: a block's keys and values
/// are a few KiB each, and the hardware prefetchers do not follow the block table from one to
/// the next (at 32 sequences of 128-4096 positions the step took about 40% longer without).
const PREFETCH_CHUNKS: usize = 2;

/// The outputs of `sequence`'s rows, `[rows, n_heads, head_dim]`: row by row, chunk by chunk
/// of its keys (a block at most), every key/value head in turn within a chunk, so that the task
/// reads each block's heads (adjacent in the pool) one after the other; each (chunk, key/value
/// head) is one [`simd::attend_tile`] for the query heads that share it.
fn sequence_output(
    views: &Views,
    sizes: Sizes,
    params: &PagedParams,
    sequence: &PagedSequence,
) -> Vec<f32> {
    let Sizes {
        n_heads,
        n_kv_heads,
        head_dim,
        block_size,
        ..
    } = sizes;
    let group = n_heads / n_kv_heads;
    let width = n_heads * head_dim;
    let mut output = vec![0.0f32; sequence.rows.len() * width];
    let mut queries = vec![0.0f32; width];
    let mut maxima = vec![f32::NEG_INFINITY; n_heads];
    let mut sums = vec![0.0f32; n_heads];
    let mut row_chunks = Vec::new();
    for (local, row) in sequence.rows.clone().enumerate() {
        let position = sequence.past + local;
        let first = params
            .window
            .map_or(0, |window| (position + 1).saturating_sub(window));
        // The queries scaled once, so that the dot products are the scores.
        for head in 0..n_heads {
            let query = views.query.row(HeadIndex { batch: 0, head }, row);
            simd::scaled_copy(
                &mut queries[head * head_dim..][..head_dim],
                query,
                params.scale,
            );
        }
        maxima.fill(f32::NEG_INFINITY);
        sums.fill(0.0);
        let outputs = &mut output[local * width..][..width];
        row_chunks.clear();
        row_chunks.extend(chunks(sequence, block_size, first..position + 1));
        for (index, chunk) in row_chunks.iter().enumerate() {
            if let Some(ahead) = row_chunks.get(index + PREFETCH_CHUNKS) {
                for kv_head in 0..n_kv_heads {
                    prefetch(&tile(views, sequence, kv_head, ahead), head_dim);
                }
            }
            for kv_head in 0..n_kv_heads {
                let heads = kv_head * group..(kv_head + 1) * group;
                let features = heads.start * head_dim..heads.end * head_dim;
                let mut online = simd::OnlineRow {
                    queries: &queries[features.clone()],
                    outputs: &mut outputs[features],
                    maxima: &mut maxima[heads.clone()],
                    sums: &mut sums[heads.clone()],
                };
                let rule = simd::LogitRule {
                    softcap: params.softcap,
                    alibi: params.alibi.as_ref().map(|slopes| &slopes[heads.clone()]),
                    first_distance: position - chunk.positions.start,
                };
                simd::attend_tile(&mut online, tile(views, sequence, kv_head, chunk), rule);
            }
        }
        normalize(outputs, &maxima, &sums, params, head_dim);
    }
    output
}

/// Asks the CPU for `tile`'s keys (of `dim` features) and values.
fn prefetch(tile: &simd::KeyTile, dim: usize) {
    let keys = match tile.layout {
        simd::KeyLayout::Columns => dim * tile.key_stride,
        simd::KeyLayout::Rows => tile.count * tile.key_stride,
    };
    simd::prefetch(tile.keys, keys);
    simd::prefetch(tile.values, tile.count * tile.value_stride);
}

/// Divides each head's output by its softmax sum, the sink's term (if any) added first.
fn normalize(
    outputs: &mut [f32],
    maxima: &[f32],
    sums: &[f32],
    params: &PagedParams,
    head_dim: usize,
) {
    for (head, output) in outputs.chunks_exact_mut(head_dim).enumerate() {
        let (mut max, mut sum) = (maxima[head], sums[head]);
        let mut scale = 1.0;
        if let Some(sinks) = &params.sinks {
            let sink = sinks[head];
            let with_sink = max.max(sink);
            scale = (max - with_sink).exp();
            sum = sum * scale + (sink - with_sink).exp();
            max = with_sink;
        }
        debug_assert!(max > f32::NEG_INFINITY, "a query sees at least itself");
        let factor = scale / sum;
        output.iter_mut().for_each(|value| *value *= factor);
    }
}
