//! Serving a stream of requests with a small (untrained) encoder-decoder model, as a
//! translation or speech-recognition server does, three ways: continuous batching through a
//! `PagedTransformerDecoderCache`; static batches of a `TransformerDecoderCache`, what batching
//! takes without a paged cache; and one request at a time with a `TransformerDecoderCache`.
//!
//! Each request brings a source of its own length and a short forced start of its output (a
//! start token and up to seven tokens, as Whisper's task tokens), and wants some tokens back.
//! When it arrives the encoder reads its source alone; continuous batching then adds it to the
//! running batch with `add_paged_sequence` (every decoder layer's cross-attention projects the
//! encoder's output once) and feeds its forced start in the same step as the other requests'
//! next tokens, each request attending to its own source however long, none padded to another's.
//! A finished request's blocks and projected source go at once.
//!
//! A static batch is the requests that arrived while the last batch ran: their sources padded
//! to the longest and their forced starts padded in front, both masked (`memory_mask_pad`,
//! `target_mask_pad`, which the caches keep); a finished request leaves it (`select_batch`), but
//! none joins until the batch is done.
//!
//! A request joins while the pool's blocks not yet reserved hold its forced start and every
//! token it may want (its `max_tokens`): it never needs a block the pool lacks, and a pool too
//! small for the stream's peak (`--pool-blocks N`, 512 blocks of 16 per layer by default) makes
//! requests wait for others to finish instead. (`examples/serve.rs` shows the other way, vLLM's:
//! joining without a reservation, and preempting a request when the pool runs out.)
//!
//! Requests arrive one every 2 ms, or every `N` ms with `--arrival-ms N` (0: all at once, the
//! schedule then the same on every machine). Every request that has arrived joins at the next
//! step by default, its source encoded before the step: the running requests wait for those
//! encodings. `--joins-per-step N` lets at most `N` join a step, which shortens the longest
//! waits between the running requests' tokens and lengthens the joining requests' wait for
//! their first.
//!
//! With `--beams N` each request runs a beam search of `N` beams instead of greedy decoding
//! (Whisper's and translation's way): continuous batching feeds every beam's last token in the
//! step, a beam kept twice is forked (`PagedTransformerDecoderCache::fork`: its blocks and
//! projected source shared, a block copied when a beam first writes into a shared one) and a
//! beam not kept is removed; static batches and one at a time hold the beams as rows of a
//! batch, their caches keeping the survivors (`select_batch`, which copies them). A request
//! reserves blocks for each of its beams, and returns its best beam. With `--temperature T`
//! each token is sampled from the softmax of the logits over `T` instead, with a number drawn
//! for the request and the token's place in its answer (vLLM's seed per request), so that a
//! request's tokens do not depend on its batch.
//!
//! Every way chooses the same way, so each request must get the same tokens every way, unless
//! the first decision where two ways part was a near tie, its candidates' scores within
//! rounding of each other (reported): greedy decoding's token (its two largest logits), a
//! sampled token's (how near its draw fell to the next token's share), a beam step's set of
//! beams kept (the last kept against the best left out), or which beam is best (its lead over
//! the next). The example exits with status 1, naming the requests, if one parts
//! anywhere else. It prints tokens per second, time
//! to first token (its source's encoding included), time between tokens and peak cache memory
//! for each way: the bytes the requests in flight store (their decoder positions, each
//! sequence's last block whole, and every layer's projection of their sources; a static
//! batch's padding included) and what the
//! caches had allocated.
//!
//! ```sh
//! cargo run --release --example serve_encoder_decoder -- --device flex   # or ndarray; wgpu with `--features wgpu`
//! cargo run --release --example serve_encoder_decoder -- --pool-blocks 64
//! cargo run --release --example serve_encoder_decoder -- --joins-per-step 1
//! cargo run --release --example serve_encoder_decoder -- --beams 4
//! cargo run --release --example serve_encoder_decoder -- --temperature 0.7
//! cargo run --release --example serve_encoder_decoder -- --arrival-ms 0   # all at once
//! ```

mod continuous;
mod model;
mod one_at_a_time;
mod search;
mod static_batches;

use std::time::Duration;

use burn_mha::serving::{
    Decoding, Served, TABLE_HEADER, check_same_tokens, report, space_arrivals,
};
use burn_mha::{ProgramOptions, device_and_options};

use continuous::{Admission, ContinuousBatching, Schedule};
use model::{BLOCK_SIZE, D_MODEL, LAYERS, Model, REQUESTS, Request, requests};
use one_at_a_time::serve_one_at_a_time;
use static_batches::{Batches, StaticBatching};

/// A request arrives every this many milliseconds unless `--arrival-ms` says otherwise.
const ARRIVAL_INTERVAL_MS: u64 = 2;
/// The pool's bound per layer unless `--pool-blocks` says otherwise: 8192 positions.
const POOL_BLOCKS: usize = 512;

/// What the command line asks for beside the device.
#[derive(Debug, Clone, Copy)]
struct Settings {
    pool_blocks: usize,
    /// The most requests that join in a step, if bounded.
    joins_per_step: Option<usize>,
    /// Beams of each request's search (1: greedy decoding).
    beams: usize,
    /// Milliseconds between two requests' arrivals (0: all at once).
    arrival_ms: u64,
    /// Greedy (or beam search), or each token sampled (with one beam).
    decoding: Decoding,
}

/// The most beams `--beams` takes.
const MOST_BEAMS: usize = 16;
/// The seed of `--temperature`'s draws, mixed with each request's index.
const SAMPLING_SEED: u64 = 0x5eed;

/// Reads `--beams N`, `--pool-blocks N` (at least the blocks of the longest request's beams,
/// which must fit alone), `--joins-per-step N`, `--arrival-ms N` and `--temperature T` (not
/// with more than one beam: a beam search keeps its best continuations); a bad value exits
/// with the usage.
fn settings(options: &ProgramOptions, requests: &[Request]) -> Settings {
    let number = |flag: &str, least: usize, what: &str| options.number(flag, least, what);
    let beams = number("--beams", 1, "a number of beams (1 to 16)").unwrap_or(1);
    if beams > MOST_BEAMS {
        options.fail(&format!(
            "`--beams` takes a number of beams (1 to {MOST_BEAMS}), not `{beams}`"
        ));
    }
    let decoding = Decoding::from_options(options, SAMPLING_SEED);
    if beams > 1 && decoding != Decoding::Greedy {
        options.fail("`--temperature` samples one beam: leave out `--beams` or give it 1");
    }
    let longest = beams
        * requests
            .iter()
            .map(Request::blocks)
            .max()
            .expect("requests");
    Settings {
        pool_blocks: number(
            "--pool-blocks",
            longest,
            &format!("a number of blocks that holds the longest request (at least {longest})"),
        )
        .unwrap_or(POOL_BLOCKS),
        joins_per_step: number("--joins-per-step", 1, "a number of requests (at least 1)"),
        beams,
        arrival_ms: number("--arrival-ms", 0, "a number of milliseconds")
            .map_or(ARRIVAL_INTERVAL_MS, |ms| ms as u64),
        decoding,
    }
}

fn main() {
    let (name, device, options) = device_and_options(
        "serve_encoder_decoder",
        &[
            ("--beams", "N"),
            ("--pool-blocks", "N"),
            ("--joins-per-step", "N"),
            ("--arrival-ms", "N"),
            ("--temperature", "T"),
        ],
    );
    let mut requests = requests();
    let settings = settings(&options, &requests);
    let arriving = space_arrivals(
        requests.iter_mut().map(|request| &mut request.arrival),
        settings.arrival_ms,
    );
    device.seed(7);
    let model = Model::new(&device);
    let wanted: usize = requests.iter().map(|r| r.max_tokens).sum();
    let sources: usize = requests.iter().map(|r| r.source.len()).sum();
    let decoding = match (settings.beams, settings.decoding) {
        (1, Decoding::Greedy) => "greedy decoding".to_string(),
        (1, Decoding::Sampled { temperature, .. }) => {
            format!("tokens sampled at temperature {temperature}, a seed per request")
        }
        (beams, _) => format!("beam search of {beams} beams"),
    };
    println!(
        "{REQUESTS} requests on {name}, {arriving}: sources of 16-320 tokens ({sources} in all), \
         forced starts of 1-8 tokens, {wanted} tokens wanted in all; a {LAYERS}-layer encoder \
         and a {LAYERS}-layer decoder, d_model {D_MODEL}, 8 query / 2 key-value heads, \
         {decoding}\n"
    );
    // A short warm-up, so that no way pays for first-use costs (allocator, threads).
    let (beams, decoding) = (settings.beams, settings.decoding);
    serve_one_at_a_time(&model, &requests[..1], beams, decoding, &device);
    let (batched, schedule) = ContinuousBatching::new(&model, &requests, settings, &device).serve();
    let (in_batches, batches) =
        StaticBatching::new(&model, &requests, beams, decoding, &device).serve();
    let (alone, encoding_alone) = serve_one_at_a_time(&model, &requests, beams, decoding, &device);
    report_ways(&settings, &batched, &in_batches, &alone);
    report_schedule(&settings, &schedule, &batches, encoding_alone);
    check_same_tokens("continuously batched as alone", &batched, &alone);
    check_same_tokens("in static batches as alone", &in_batches, &alone);
    let first = &batched.tokens[0];
    println!(
        "request 0's first tokens: {:?}",
        &first[..first.len().min(16)]
    );
}

/// The table: a row for each way.
fn report_ways(settings: &Settings, batched: &Served, in_batches: &Served, alone: &Served) {
    println!("{TABLE_HEADER}");
    let joins = settings.joins_per_step.map_or(String::new(), |joins| {
        format!(", at most {joins} joining a step")
    });
    let forks = if settings.beams > 1 {
        ", beams forked"
    } else {
        ""
    };
    report(
        &format!(
            "continuous batching (paged, {} blocks of {BLOCK_SIZE} per layer, each source \
             projected once{forks}{joins})",
            settings.pool_blocks
        ),
        batched,
    );
    let rows = if settings.beams > 1 {
        ", a row per beam"
    } else {
        ""
    };
    report(
        &format!(
            "static batches (TransformerDecoderCache, sources and forced starts padded to the \
             longest{rows})"
        ),
        in_batches,
    );
    let batch = if settings.beams > 1 {
        ", beams a batch"
    } else {
        ""
    };
    report(
        &format!("one at a time (TransformerDecoderCache{batch})"),
        alone,
    );
}

/// What continuous batching's scheduler did, the static batches, and the encoder's time each
/// way.
fn report_schedule(
    settings: &Settings,
    schedule: &Schedule,
    batches: &Batches,
    encoding_alone: Duration,
) {
    let Schedule {
        admission:
            Admission {
                encoding,
                most_in_flight,
                most_reserved,
                steps_with_a_request_waiting,
                most_joined_in_a_step,
            },
        fullest_pool,
    } = schedule;
    println!(
        "\ncontinuous batching held at most {most_in_flight} requests at once, reserving at most \
         {most_reserved} of {} blocks; a request waited for blocks in \
         {steps_with_a_request_waiting} steps; the most requests to join in a step: \
         {most_joined_in_a_step}",
        settings.pool_blocks
    );
    println!(
        "at its fullest the pool held {} blocks per layer, where sequences sharing no blocks would \
         hold {}",
        fullest_pool.blocks_in_use, fullest_pool.unshared
    );
    println!(
        "static batching ran {} {}, the largest of {} requests",
        batches.count,
        if batches.count == 1 {
            "batch"
        } else {
            "batches"
        },
        batches.largest
    );
    println!(
        "the encoder took {:.2} s of continuous batching's wall time, {:.2} s of static \
         batching's and {:.2} s of one at a time's",
        encoding.as_secs_f64(),
        batches.encoding.as_secs_f64(),
        encoding_alone.as_secs_f64()
    );
}
