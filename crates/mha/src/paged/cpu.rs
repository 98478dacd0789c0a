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
use crate::cpu::matrix::{HeadIndex, HeadsView, Matrix};
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

/// Keys and values of consecutive positions `positions` of one key/value head; row `i` of
/// `values` is position `positions.start + i`.
struct KeyChunk<'a> {
    positions: Range<usize>,
    keys: ChunkKeys<'a>,
    values: Matrix<'a>,
}

/// A chunk's keys as they lie: a block's feature-major columns, or the step's new rows.
#[derive(Clone, Copy)]
enum ChunkKeys<'a> {
    /// `[head_dim, positions]`: column `i` is position `positions.start + i`.
    Columns(Matrix<'a>),
    /// `[positions, head_dim]`.
    Rows(Matrix<'a>),
}

impl ChunkKeys<'_> {
    /// `scores[q · score_stride + i]` ← query row `q` · key `i`.
    fn scores(self, scores: &mut [f32], score_stride: usize, queries: &[&[f32]]) {
        match self {
            Self::Columns(keys) => simd::query_key_column_dots(
                scores,
                score_stride,
                queries,
                keys.values,
                keys.row_stride,
                keys.columns,
            ),
            Self::Rows(keys) => simd::query_key_dots(
                scores,
                score_stride,
                queries,
                keys.values,
                keys.row_stride,
                keys.rows,
            ),
        }
    }
}

/// The key chunks query position `position` of `sequence` sees, in order: its stored
/// positions block by block, then the step's new ones up to its own.
fn key_chunks<'a>(
    views: &'a Views,
    sizes: Sizes,
    sequence: &'a PagedSequence,
    kv_head: usize,
    visible: Range<usize>,
) -> impl Iterator<Item = KeyChunk<'a>> + 'a {
    let block_size = sizes.block_size;
    let stored = visible.start..visible.end.min(sequence.past);
    let blocks = if stored.is_empty() {
        0..0
    } else {
        stored.start / block_size..stored.end.div_ceil(block_size)
    };
    let stored_chunks = blocks.map(move |index| {
        let first = (index * block_size).max(stored.start);
        let end = ((index + 1) * block_size).min(stored.end);
        let head = HeadIndex {
            batch: sequence.blocks[index],
            head: kv_head,
        };
        let offset = first - index * block_size;
        KeyChunk {
            positions: first..end,
            keys: ChunkKeys::Columns(views.key_blocks.head(head).columns(offset, end - first)),
            values: views.value_blocks.head(head).rows(offset, end - first),
        }
    });
    let new = visible.start.max(sequence.past)..visible.end;
    let new_chunk = (!new.is_empty()).then(|| {
        let head = HeadIndex {
            batch: 0,
            head: kv_head,
        };
        let row = sequence.rows.start + new.start - sequence.past;
        KeyChunk {
            positions: new.clone(),
            keys: ChunkKeys::Rows(views.new_key.head(head).rows(row, new.len())),
            values: views.new_value.head(head).rows(row, new.len()),
        }
    });
    stored_chunks.chain(new_chunk)
}

/// The online softmax of one query head: the running maximum and sum of its row's
/// exponentials (its weighted sum of values lives in the output).
struct RowState {
    max: f32,
    sum: f32,
}

/// Keys a query scores before its softmax statistics are updated (whole chunks, so a window is
/// at least a block).
///
/// Why one block of the default size: a task walks each block's key/value heads in turn,
/// which lie side by side in the pool, so its reads run on through memory block after block.
/// Windows of 256 keys (a rescale per 16 blocks instead of per block, but each head's 16
/// blocks read before the next head's) took 3.67-4.18 ms per step against 2.76-3.65 ms at
/// 32 sequences of 128-4096 positions (`decoding` bench, the two binaries alternated three
/// times, AMD EPYC Zen 5, 2 cores).
const WINDOW_KEYS: usize = 16;

/// The outputs of `sequence`'s rows, `[rows, n_heads, head_dim]`: row by row, window by
/// window of its keys, every key/value head in turn within a window, so that the task reads
/// each block's heads (adjacent in the pool) one after the other.
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
    // Room for a window of whole chunks: a chunk is at most a block or the step's rows.
    let window = WINDOW_KEYS.max(block_size).max(sequence.rows.len());
    let mut works: Vec<WindowWork> = (0..n_kv_heads)
        .map(|kv_head| WindowWork {
            scores: vec![0.0f32; group * window],
            chunk_sums: vec![0.0f32; group * head_dim],
            window,
            head_dim,
            heads: (0..group).map(|g| kv_head * group + g).collect(),
            queries: vec![0.0f32; group * head_dim],
        })
        .collect();
    for (local, row) in sequence.rows.clone().enumerate() {
        let position = sequence.past + local;
        let first = params
            .window
            .map_or(0, |window| (position + 1).saturating_sub(window));
        let visible = first..position + 1;
        let mut chunks = Vec::with_capacity(n_kv_heads);
        for (kv_head, work) in works.iter_mut().enumerate() {
            // The queries scaled once, so that the dot products are the scores.
            for (g, &head) in work.heads.iter().enumerate() {
                let query = views.query.row(HeadIndex { batch: 0, head }, row);
                let scaled = &mut work.queries[g * head_dim..][..head_dim];
                simd::scaled_copy(scaled, query, params.scale);
            }
            let head_chunks: Vec<KeyChunk> =
                key_chunks(views, sizes, sequence, kv_head, visible.clone()).collect();
            chunks.push(head_chunks);
        }
        // Every head's chunks cover the same positions: one set of windows for all.
        let windows = windows_of(&chunks[0], window);
        let mut states: Vec<RowState> = (0..n_heads)
            .map(|_| RowState {
                max: f32::NEG_INFINITY,
                sum: 0.0,
            })
            .collect();
        let accumulators = &mut output[local * width..][..width];
        for chunk_range in &windows {
            let head_parts = accumulators
                .chunks_exact_mut(group * head_dim)
                .zip(states.chunks_exact_mut(group));
            for ((work, head_chunks), (head_accumulators, head_states)) in
                works.iter_mut().zip(&chunks).zip(head_parts)
            {
                let row = QueryRow {
                    position,
                    accumulators: head_accumulators,
                    states: head_states,
                };
                work.attend(&head_chunks[chunk_range.clone()], row, params);
            }
        }
        let head_parts = accumulators
            .chunks_exact_mut(group * head_dim)
            .zip(states.chunks_exact_mut(group));
        for (work, (head_accumulators, head_states)) in works.iter().zip(head_parts) {
            work.normalize(head_accumulators, head_states, params);
        }
    }
    output
}

/// One query row of a task: its position, its heads' outputs (`group × head_dim`, the running
/// weighted sums of values until normalised) and softmax statistics.
struct QueryRow<'a> {
    position: usize,
    accumulators: &'a mut [f32],
    states: &'a mut [RowState],
}

/// A task's buffers and its query heads.
struct WindowWork {
    /// `group` rows of `window` scores.
    scores: Vec<f32>,
    /// One chunk's weighted sums of values, `group × head_dim`.
    chunk_sums: Vec<f32>,
    window: usize,
    head_dim: usize,
    /// The query heads of the task's key/value head.
    heads: Vec<usize>,
    /// The current row's queries, scaled, `group × head_dim`.
    queries: Vec<f32>,
}

impl WindowWork {
    /// Adds one window of key chunks (consecutive positions) to `row`: their scores, the
    /// online softmax's rescale once for the window, the values weighted by the exponentials.
    fn attend(&mut self, chunks: &[KeyChunk], row: QueryRow, params: &PagedParams) {
        let (window, head_dim, group) = (self.window, self.head_dim, self.heads.len());
        let mut filled = 0;
        with_rows(&self.queries, head_dim, group, |query_rows| {
            for chunk in chunks {
                let scores = &mut self.scores[filled..];
                chunk.keys.scores(scores, window, query_rows);
                filled += chunk.positions.len();
            }
        });
        let first_distance = row.position - chunks[0].positions.start;
        for (g, state) in row.states.iter_mut().enumerate() {
            let row_scores = &mut self.scores[g * window..][..filled];
            finish_scores(row_scores, params, self.heads[g], first_distance);
            let max = state.max.max(simd::max(row_scores));
            let correction = (state.max - max).exp();
            state.sum = state.sum * correction + simd::exp_shifted(row_scores, max);
            state.max = max;
            if correction != 1.0 {
                row.accumulators[g * head_dim..][..head_dim]
                    .iter_mut()
                    .for_each(|a| *a *= correction);
            }
        }
        let mut offset = 0;
        for chunk in chunks {
            let count = chunk.positions.len();
            let values = chunk.values;
            let scores = &self.scores[offset..];
            with_rows(scores, window, group, |weights| {
                let weights = weights.iter().map(|row| &row[..count]);
                with_collected(weights, group, |weights| {
                    simd::weighted_row_sums(
                        &mut self.chunk_sums,
                        weights,
                        values.values,
                        values.row_stride,
                    );
                });
            });
            row.accumulators
                .iter_mut()
                .zip(&self.chunk_sums)
                .for_each(|(a, s)| *a += s);
            offset += count;
        }
    }

    /// Divides each head's output by its softmax sum, the sink's term (if any) added first.
    fn normalize(&self, accumulators: &mut [f32], states: &mut [RowState], params: &PagedParams) {
        let head_dim = self.head_dim;
        for (g, state) in states.iter_mut().enumerate() {
            let accumulator = &mut accumulators[g * head_dim..][..head_dim];
            if let Some(sinks) = &params.sinks {
                let sink = sinks[self.heads[g]];
                let max = state.max.max(sink);
                let correction = (state.max - max).exp();
                state.sum = state.sum * correction + (sink - max).exp();
                accumulator.iter_mut().for_each(|a| *a *= correction);
            }
            let inverse = 1.0 / state.sum;
            accumulator.iter_mut().for_each(|a| *a *= inverse);
        }
    }
}

/// Query heads per key/value head that [`with_rows`] and [`with_collected`] hold on the stack;
/// larger groups go through a `Vec` (an allocation per call, on a path no common model takes).
const STACK_ROWS: usize = 16;

/// `run` on the `count` rows of `stride` elements at the start of `values` (the last may be
/// shorter), without allocating for up to [`STACK_ROWS`] of them: the kernel calls this per
/// block and head, where a `Vec` per call cost as much as the arithmetic.
fn with_rows<'v, R>(
    values: &'v [f32],
    stride: usize,
    count: usize,
    run: impl FnOnce(&[&'v [f32]]) -> R,
) -> R {
    let rows = (0..count).map(|row| {
        let start = row * stride;
        &values[start..values.len().min(start + stride)]
    });
    with_collected(rows, count, run)
}

/// `run` on the `count` slices of `rows`, on the stack for up to [`STACK_ROWS`].
fn with_collected<'v, R>(
    rows: impl Iterator<Item = &'v [f32]>,
    count: usize,
    run: impl FnOnce(&[&'v [f32]]) -> R,
) -> R {
    if count <= STACK_ROWS {
        let mut stack: [&[f32]; STACK_ROWS] = [&[]; STACK_ROWS];
        for (slot, row) in stack.iter_mut().zip(rows) {
            *slot = row;
        }
        run(&stack[..count])
    } else {
        run(&rows.collect::<Vec<_>>())
    }
}

/// `chunks` cut into consecutive runs of at most `window` keys (a chunk longer than that on its
/// own), as ranges of chunk indices.
fn windows_of(chunks: &[KeyChunk], window: usize) -> Vec<Range<usize>> {
    let mut windows = Vec::new();
    let (mut start, mut filled) = (0, 0);
    for (index, chunk) in chunks.iter().enumerate() {
        let count = chunk.positions.len();
        if index > start && filled + count > window {
            windows.push(start..index);
            (start, filled) = (index, 0);
        }
        filled += count;
    }
    if start < chunks.len() {
        windows.push(start..chunks.len());
    }
    windows
}

/// `scores` (already `scale · q · k`) ← `cap(scores) + ALiBi` of query head `head` over
/// consecutive keys, the first `first_distance` positions before the query.
fn finish_scores(scores: &mut [f32], params: &PagedParams, head: usize, first_distance: usize) {
    if let Some(cap) = params.softcap {
        simd::soft_cap(scores, cap);
    }
    if let Some(slopes) = &params.alibi {
        simd::add_distance_penalty(scores, first_distance as f32, -slopes[head]);
    }
}
