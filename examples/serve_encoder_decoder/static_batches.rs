//! Static batches through a `TransformerDecoderCache`: how many requests are served at once
//! without a paged cache.

use std::time::{Duration, Instant};

use burn::tensor::{Bool, Device, Tensor};
use burn_mha::serving::{CacheBytes, Decoding, Served, next_static_batch};
use mha::transformer::TransformerDecoderCache;

use crate::model::{D_MODEL, LAYERS, Model, POSITION_BYTES, Padding, Request, VOCAB};
use crate::search::Search;

/// What static batching did: the batches it ran, the most requests in one, and the time the
/// encoder took over the sources.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Batches {
    /// Batches run.
    pub(crate) count: usize,
    /// The most requests in one.
    pub(crate) largest: usize,
    /// The encoder's time over the sources.
    pub(crate) encoding: Duration,
}

/// A request of the batch still decoding: its rows of the cache are its search's beams, in
/// order, after those of the requests before it.
struct Member {
    request: usize,
    search: Search,
}

/// Static batching with a `TransformerDecoderCache`: the requests that arrived while the last
/// batch ran (at least the next one) form a batch and decode together until the last of them
/// is done; none joins before, since the cache's rows share one length.
///
/// Each source is encoded alone, as the other ways do; the encoder's outputs are padded behind
/// to the longest and the padding masked out of every cross-attention (`memory_mask_pad`,
/// kept with the projected memory), the forced starts padded in front to the longest and
/// masked out of the self-attention (`target_mask_pad`, kept by its `KvCache`). Neither
/// padding changes a request's tokens but by rounding: the cross-attention has no positions,
/// and RoPE's scores depend on the distance between positions only. Every beam of every
/// request is a row: after each step one `select_batch` keeps each request's survivors (a
/// copy) and lets the finished requests' rows go.
pub(crate) struct StaticBatching<'a> {
    model: &'a Model,
    requests: &'a [Request],
    beams: usize,
    decoding: Decoding,
    device: &'a Device,
    started: Instant,
    served: Served,
    batches: Batches,
}

impl<'a> StaticBatching<'a> {
    /// Nothing served yet, the clock started; each request's search of `beams` beams,
    /// choosing by `decoding`.
    pub(crate) fn new(
        model: &'a Model,
        requests: &'a [Request],
        beams: usize,
        decoding: Decoding,
        device: &'a Device,
    ) -> Self {
        Self {
            model,
            requests,
            beams,
            decoding,
            device,
            started: Instant::now(),
            served: Served::nothing_yet(requests.iter().map(|request| request.arrival).collect()),
            batches: Batches::default(),
        }
    }

    /// Serves every request; returns what each got and when, and what the batches were.
    pub(crate) fn serve(mut self) -> (Served, Batches) {
        let mut next = 0;
        while next < self.requests.len() {
            let batch = next_static_batch(&self.served.arrivals, next, self.started);
            next = batch.end;
            self.batches.count += 1;
            self.batches.largest = self.batches.largest.max(batch.len());
            self.serve_batch(&batch.collect::<Vec<_>>());
        }
        self.served.wall = self.started.elapsed();
        (self.served, self.batches)
    }

    /// One batch: `batch`'s requests' forced starts fed together, then a token for every beam
    /// a step until the last request is done.
    fn serve_batch(&mut self, batch: &[usize]) {
        let encoding = Instant::now();
        let (memory, memory_padding) = self.encoded_sources(batch);
        self.batches.encoding += encoding.elapsed();
        let memory_len = memory.dims()[1];
        let (tokens, target_padding) = self.forced_starts(batch);
        let padding = Padding {
            target: target_padding,
            memory: memory_padding,
        };
        let mut cache = self.model.decoder.new_cache();
        let mut members: Vec<Member> = batch
            .iter()
            .map(|&request| Member {
                request,
                search: Search::new(request, self.beams, self.decoding),
            })
            .collect();
        let mut log_probs = self.model.step_cached(
            &tokens,
            batch.len(),
            &memory,
            Some(padding),
            &mut cache,
            self.device,
        );
        loop {
            let now = self.started.elapsed();
            let rows: usize = members.iter().map(|member| member.search.beams.len()).sum();
            let bytes = cache_bytes(&cache, rows, memory_len);
            self.served.peak_cache = self.served.peak_cache.peak(bytes);
            // The rows each request's survivors continue, as rows of the cache.
            let mut kept = Vec::new();
            let mut first_row = 0;
            let mut own_rows = log_probs.chunks_exact(VOCAB);
            let (served, requests) = (&mut self.served, self.requests);
            members.retain_mut(|member| {
                let beams = member.search.beams.len();
                let own: Vec<f32> = own_rows.by_ref().take(beams).flatten().copied().collect();
                let parents = member.search.step(&own);
                served.token_times[member.request].push(now);
                let done = member.search.generated() == requests[member.request].max_tokens;
                if done {
                    let request = member.request;
                    (served.tokens[request], served.decisions[request]) = member.search.result();
                } else {
                    kept.extend(parents.iter().map(|&parent| first_row + parent));
                }
                first_row += beams;
                !done
            });
            if members.is_empty() {
                return;
            }
            // A step that kept every row in place copies nothing.
            if !kept.iter().copied().eq(0..rows) {
                cache.select_batch(&kept);
            }
            let last: Vec<i64> = members
                .iter()
                .flat_map(|member| &member.search.beams)
                .map(|beam| *beam.tokens.last().expect("a token"))
                .collect();
            // The memory is projected at the first step; later steps do not read it.
            log_probs =
                self.model
                    .step_cached(&last, last.len(), &memory, None, &mut cache, self.device);
        }
    }

    /// The encoder's outputs for `batch`'s sources, each encoded alone and padded behind to the
    /// longest (`[batch, longest, d_model]`), and their padding (`[batch, longest]`).
    fn encoded_sources(&self, batch: &[usize]) -> (Tensor<3>, Tensor<2, Bool>) {
        let sources: Vec<&[i64]> = batch
            .iter()
            .map(|&request| self.requests[request].source.as_slice())
            .collect();
        let longest = sources.iter().map(|source| source.len()).max();
        let longest = longest.expect("a request");
        let memories = sources
            .iter()
            .map(|source| {
                let encoded = self.model.encode(source, self.device);
                if source.len() == longest {
                    return encoded;
                }
                let pad = Tensor::<3>::zeros([1, longest - source.len(), D_MODEL], self.device);
                Tensor::cat(vec![encoded, pad], 1)
            })
            .collect();
        let padding = sources
            .iter()
            .flat_map(|source| (0..longest).map(move |position| position >= source.len()));
        (
            Tensor::cat(memories, 0),
            bool_matrix(padding.collect(), batch.len(), self.device),
        )
    }

    /// `batch`'s forced starts padded in front to the longest, row by row, and their padding
    /// (`[batch, longest]`).
    fn forced_starts(&self, batch: &[usize]) -> (Vec<i64>, Tensor<2, Bool>) {
        let starts: Vec<&[i64]> = batch
            .iter()
            .map(|&request| self.requests[request].forced.as_slice())
            .collect();
        let longest = starts.iter().map(|start| start.len()).max();
        let longest = longest.expect("a request");
        // The padding's token is never attended to; any will do.
        let tokens = starts
            .iter()
            .flat_map(|start| std::iter::repeat_n(0, longest - start.len()).chain(start.to_vec()))
            .collect();
        let padding = starts
            .iter()
            .flat_map(|start| (0..longest).map(move |position| position < longest - start.len()));
        (
            tokens,
            bool_matrix(padding.collect(), batch.len(), self.device),
        )
    }
}

/// `values` as a `[rows, values / rows]` mask.
fn bool_matrix(values: Vec<bool>, rows: usize, device: &Device) -> Tensor<2, Bool> {
    let columns = values.len() / rows;
    Tensor::<1, Bool>::from_data(values.as_slice(), device).reshape([rows, columns])
}

/// What a static batch's caches hold for `rows` rows over memories of `memory_len` positions:
/// every row's decoder positions and projected memory (the padding of both included, each
/// beam its own copy), and the self-attention's buffers with the room they keep to grow beside
/// the projected memory.
fn cache_bytes(cache: &TransformerDecoderCache, rows: usize, memory_len: usize) -> CacheBytes {
    let projected = rows * memory_len * LAYERS * POSITION_BYTES;
    let layers = &cache.self_attention;
    CacheBytes {
        stored: layers.iter().map(|layer| layer.stored()).sum::<usize>() * POSITION_BYTES * rows
            + projected,
        allocated: layers.iter().map(|layer| layer.bytes()).sum::<usize>() + projected,
    }
}
