//! One request at a time through a `TransformerDecoderCache`.

use std::time::{Duration, Instant};

use burn::tensor::Device;
use burn_mha::serving::{CacheBytes, Decoding, Served};

use crate::model::{LAYERS, Model, POSITION_BYTES, Request};
use crate::search::Search;

/// One request at a time, in arrival order, each with its own `TransformerDecoderCache` (its
/// beams a batch, the survivors kept after each step with `select_batch`); and the time the
/// encoder took over the sources.
pub(crate) fn serve_one_at_a_time(
    model: &Model,
    requests: &[Request],
    beams: usize,
    decoding: Decoding,
    device: &Device,
) -> (Served, Duration) {
    let mut encoding = Duration::ZERO;
    let mut served = Served::nothing_yet(requests.iter().map(|request| request.arrival).collect());
    let started = Instant::now();
    for (index, request) in requests.iter().enumerate() {
        std::thread::sleep(request.arrival.saturating_sub(started.elapsed()));
        let encoding_started = Instant::now();
        let memory = model.encode(&request.source, device);
        encoding += encoding_started.elapsed();
        let mut cache = model.decoder.new_cache();
        let mut search = Search::new(index, beams, decoding);
        let mut times = Vec::new();
        let mut log_probs =
            model.step_cached(&request.forced, 1, &memory, None, &mut cache, device);
        loop {
            let parents = search.step(&log_probs);
            times.push(started.elapsed());
            if search.generated() == request.max_tokens {
                break;
            }
            // Each survivor continues its parent's caches (the forced start's, repeated, at
            // first); a step that kept every beam in place copies nothing.
            if !parents.iter().copied().eq(0..parents.len()) {
                cache.select_batch(&parents);
            }
            let last: Vec<i64> = search
                .beams
                .iter()
                .map(|beam| *beam.tokens.last().expect("a token"))
                .collect();
            log_probs = model.step_cached(&last, last.len(), &memory, None, &mut cache, device);
        }
        let summed_over_layers = |bytes: fn(&mha::KvCache) -> usize| -> usize {
            cache.self_attention.iter().map(bytes).sum()
        };
        // Every beam holds its own positions and its own copy of the projected source.
        let projected = request.source.len() * LAYERS * POSITION_BYTES * beams;
        served.peak_cache = served.peak_cache.peak(CacheBytes {
            stored: summed_over_layers(|layer| layer.stored()) * POSITION_BYTES * beams + projected,
            allocated: summed_over_layers(|layer| layer.bytes()) + projected,
        });
        (served.tokens[index], served.decisions[index]) = search.result();
        served.token_times[index] = times;
    }
    served.wall = started.elapsed();
    (served, encoding)
}
