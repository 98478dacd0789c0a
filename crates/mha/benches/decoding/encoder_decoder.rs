//! An encoder-decoder model's decoder serving many sequences at once, each over its own memory
//! (an encoder's output of its own length, as in translation or speech recognition): one
//! `TransformerDecoder::forward_paged` step for all of them over a
//! `PagedTransformerDecoderCache`; one `forward_cached` step of a batch whose targets are
//! left-padded to the longest and whose memories are padded to the longest (`target_mask_pad`,
//! `memory_mask_pad`); and one `forward_cached` step per sequence with a
//! `TransformerDecoderCache` each. The ways take turns round by round; beside the others'
//! medians the table gives the median of the per-round ratios to the paged step.

use std::time::Instant;

use burn::tensor::{Bool, Device, Distribution, Tensor};
use mha::transformer::{
    PagedTransformerDecoderCache, TransformerDecoder, TransformerDecoderCache,
    TransformerDecoderConfig, TransformerDecoderInput,
};
use mha::{PagedKvCacheConfig, SequenceId};

/// Memory lengths, cycled through by the sequences: 64 to 1024 positions.
const MEMORY_LENGTHS: [usize; 8] = [256, 64, 1024, 128, 512, 192, 768, 384];
/// Target positions each sequence holds before the timed rounds, cycled likewise.
const TARGET_LENGTHS: [usize; 8] = [32, 128, 16, 64, 96, 8, 48, 24];
const LAYERS: usize = 2;

/// The table: for each number of sequences in `concurrency`, ms per round each way over
/// `rounds` rounds, through a decoder of [`LAYERS`] layers of `d_model` with `heads` query and
/// `kv_heads` key/value heads.
pub fn table(
    [d_model, heads, kv_heads]: [usize; 3],
    concurrency: &[usize],
    rounds: usize,
    device: &Device,
) {
    let decoder = TransformerDecoderConfig::new(d_model, 4 * d_model, heads, LAYERS)
        .with_n_kv_heads(Some(kv_heads))
        .with_dropout(0.0)
        .with_norm_first(true)
        .init(device);
    println!(
        "\nan encoder-decoder's decoder, {LAYERS} layers (self-attention, cross-attention over \
         each sequence's own memory, feed-forward of {}), f32, median of {rounds} rounds\n",
        4 * d_model
    );
    println!(
        "| sequences | memory positions (sum, longest) | target positions (sum) | paged: ms per round | padded batch: ms (÷ paged) | one at a time: ms (÷ paged) |"
    );
    println!("|---|---|---|---|---|---|");
    for &sequences in concurrency {
        let mut served = Served::new(&decoder, d_model, sequences, rounds, device);
        // Each way's ms per round, and the padded and one-at-a-time ways' over the paged.
        let [mut paged, mut padded, mut alone] = [(); 3].map(|_| Vec::new());
        let [mut padded_ratios, mut alone_ratios] = [(); 2].map(|_| Vec::new());
        for _ in 0..rounds {
            let tokens = Tensor::<2>::random([sequences, d_model], Distribution::Default, device);
            let paged_ms = served.paged_round(tokens.clone());
            let padded_ms = served.padded_round(tokens.clone());
            let alone_ms = served.one_at_a_time_round(tokens);
            padded_ratios.push(padded_ms / paged_ms);
            alone_ratios.push(alone_ms / paged_ms);
            paged.push(paged_ms);
            padded.push(padded_ms);
            alone.push(alone_ms);
        }
        let memory: Vec<usize> = (0..sequences).map(memory_len).collect();
        let target: usize = (0..sequences).map(target_len).sum();
        println!(
            "| {sequences} | {}, {} | {target} | {:.2} | {:.2} ({:.2}) | {:.2} ({:.2}) |",
            memory.iter().sum::<usize>(),
            memory.iter().max().expect("sequences"),
            median(paged),
            median(padded),
            median(padded_ratios),
            median(alone),
            median(alone_ratios)
        );
    }
}

fn memory_len(sequence: usize) -> usize {
    MEMORY_LENGTHS[sequence % MEMORY_LENGTHS.len()]
}

fn target_len(sequence: usize) -> usize {
    TARGET_LENGTHS[sequence % TARGET_LENGTHS.len()]
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The sequences every way: the paged cache and its ids, the padded batch's cache and padded
/// memories (`[sequences, longest memory, d_model]`), and each sequence's own cache and memory
/// (`[1, seq_memory, d_model]`).
struct Served<'a> {
    decoder: &'a TransformerDecoder,
    d_model: usize,
    paged: PagedTransformerDecoderCache,
    ids: Vec<SequenceId>,
    padded: (TransformerDecoderCache, Tensor<3>),
    alone: Vec<(TransformerDecoderCache, Tensor<3>)>,
}

impl<'a> Served<'a> {
    /// `sequences` sequences over their memories, each holding its target prompt every way, in
    /// a pool with room for `rounds` more tokens each.
    fn new(
        decoder: &'a TransformerDecoder,
        d_model: usize,
        sequences: usize,
        rounds: usize,
        device: &Device,
    ) -> Self {
        let block_size = 16;
        let blocks: usize = (0..sequences)
            .map(|sequence| (target_len(sequence) + rounds).div_ceil(block_size))
            .sum();
        let config = PagedKvCacheConfig::new(blocks).with_block_size(block_size);
        let mut served = Self {
            decoder,
            d_model,
            paged: decoder.new_paged_cache(config),
            ids: Vec::new(),
            padded: padded_batch(decoder, d_model, sequences, device),
            alone: Vec::new(),
        };
        for sequence in 0..sequences {
            let (memory_len, target_len) = (memory_len(sequence), target_len(sequence));
            let memory = Tensor::<2>::random([memory_len, d_model], Distribution::Default, device);
            let id = decoder.add_paged_sequence(&mut served.paged, memory.clone());
            let prompt = Tensor::<2>::random([target_len, d_model], Distribution::Default, device);
            decoder
                .forward_paged(prompt.clone(), &mut served.paged, &vec![id; target_len])
                .expect("the pool holds every prompt");
            let memory = memory.reshape([1, memory_len, d_model]);
            let mut cache = decoder.new_cache();
            let input = TransformerDecoderInput::new(
                prompt.reshape([1, target_len, d_model]),
                memory.clone(),
            );
            decoder
                .forward_cached(input, &mut cache)
                .expect("an unbounded cache");
            served.ids.push(id);
            served.alone.push((cache, memory));
        }
        served
    }

    /// ms of one paged step of `tokens`, a row per sequence.
    fn paged_round(&mut self, tokens: Tensor<2>) -> f64 {
        let started = Instant::now();
        let output = self
            .decoder
            .forward_paged(tokens, &mut self.paged, &self.ids)
            .expect("the pool has room for every round");
        output.into_data();
        started.elapsed().as_secs_f64() * 1e3
    }

    /// ms of one `forward_cached` step of the padded batch, row `i` of `tokens` for sequence `i`.
    fn padded_round(&mut self, tokens: Tensor<2>) -> f64 {
        let started = Instant::now();
        let (cache, memory) = &mut self.padded;
        let tokens = tokens.unsqueeze_dim(1);
        let output = self
            .decoder
            .forward_cached(TransformerDecoderInput::new(tokens, memory.clone()), cache)
            .expect("an unbounded cache");
        output.into_data();
        started.elapsed().as_secs_f64() * 1e3
    }

    /// ms of one `forward_cached` step per sequence, row `i` of `tokens` for sequence `i`.
    fn one_at_a_time_round(&mut self, tokens: Tensor<2>) -> f64 {
        let started = Instant::now();
        for (index, (cache, memory)) in self.alone.iter_mut().enumerate() {
            let token = tokens
                .clone()
                .narrow(0, index, 1)
                .reshape([1, 1, self.d_model]);
            let output = self
                .decoder
                .forward_cached(TransformerDecoderInput::new(token, memory.clone()), cache)
                .expect("an unbounded cache");
            output.into_data();
        }
        started.elapsed().as_secs_f64() * 1e3
    }
}

/// The padded batch's cache after its prompts, and its memories: each sequence's target prompt
/// at the end of the longest's rows (left padding, so that every row's next token follows its
/// own prompt), each memory at the start of the longest's (right padding), both masked.
fn padded_batch(
    decoder: &TransformerDecoder,
    d_model: usize,
    sequences: usize,
    device: &Device,
) -> (TransformerDecoderCache, Tensor<3>) {
    let mask = |hidden: Vec<bool>, longest: usize| {
        Tensor::<1, Bool>::from_data(hidden.as_slice(), device).reshape([sequences, longest])
    };
    let longest_target = (0..sequences).map(target_len).max().expect("sequences");
    let target_padding = (0..sequences)
        .flat_map(|sequence| {
            (0..longest_target).map(move |at| at < longest_target - target_len(sequence))
        })
        .collect();
    let longest_memory = (0..sequences).map(memory_len).max().expect("sequences");
    let memory_padding = (0..sequences)
        .flat_map(|sequence| (0..longest_memory).map(move |at| at >= memory_len(sequence)))
        .collect();
    let shape = |len| [sequences, len, d_model];
    let memory = Tensor::<3>::random(shape(longest_memory), Distribution::Default, device);
    let prompts = Tensor::<3>::random(shape(longest_target), Distribution::Default, device);
    let input = TransformerDecoderInput::new(prompts, memory.clone())
        .target_mask_pad(mask(target_padding, longest_target))
        .memory_mask_pad(mask(memory_padding, longest_memory));
    let mut cache = decoder.new_cache();
    decoder
        .forward_cached(input, &mut cache)
        .expect("an unbounded cache");
    (cache, memory)
}
