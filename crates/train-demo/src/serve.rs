//! `train-demo serve`: a trained run's held-out examples as a stream of requests to its
//! decoder, served two ways: continuous batching over paged KV caches (every request in flight
//! advances in one ragged step; a request joins at the step after it arrives, its prompt fed in
//! the same step as the others' next tokens, and leaves when its answer is complete, its blocks
//! free at once), and one request at a time with a `KvCache` each. Each way's answers are
//! scored against the task's targets, and the two ways' answers against each other.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use burn::tensor::{Device, Tensor};
use mha::{PagedKvCacheConfig, SequenceId};

use crate::model::{StepRun, Transformer, token_row};
use crate::tasks::{Example, IGNORE};

/// How the requests come and what the paged pool holds.
#[derive(Debug, Clone, Copy)]
pub struct ServeSettings {
    /// Time between two requests' arrivals (zero: all at once).
    pub arrival: Duration,
    /// Blocks in each layer's pool.
    pub pool_blocks: usize,
    /// Positions per block.
    pub block_size: usize,
}

/// One request: a held-out example's prompt (and source), and the answer the task expects.
#[derive(Debug, Clone)]
pub struct Request {
    source: Vec<usize>,
    prompt: Vec<usize>,
    /// The scored targets: the answer's tokens.
    expected: Vec<usize>,
}

impl Request {
    /// The request of `example`: its decoder input up to the first scored position (as the
    /// held-out evaluation's greedy generation prompts it), then `expected`'s tokens.
    pub fn of(example: &Example) -> Self {
        let first_scored = example
            .target
            .iter()
            .position(|&target| target != IGNORE)
            .expect("a generative example has scored positions");
        Self {
            source: example.source.clone(),
            prompt: example.decoder_input[..=first_scored].to_vec(),
            expected: example
                .target
                .iter()
                .filter(|&&target| target != IGNORE)
                .map(|&target| target as usize)
                .collect(),
        }
    }

    /// Positions a request stores: its prompt, and every answer token but the last (which is
    /// never fed back).
    fn positions(&self) -> usize {
        self.prompt.len() + self.expected.len() - 1
    }
}

/// A request's answer and how it came.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Answer {
    pub tokens: Vec<usize>,
    /// At each token, the lead of the chosen logit over the next one.
    pub margins: Vec<f32>,
    /// From the request's arrival to its first token.
    pub first_token: Duration,
}

/// What a way of serving did.
#[derive(Debug, Clone, Default)]
pub struct Served {
    pub answers: Vec<Answer>,
    /// From the first arrival to the last answer.
    pub wall: Duration,
    /// Continuous batching only: the most sequences in one step, the most blocks a layer's
    /// pool held, and how many requests arrived to find too few free blocks.
    pub most_in_step: usize,
    pub peak_blocks: usize,
    pub waited: usize,
}

/// A request being served by continuous batching.
struct InFlight {
    request: usize,
    id: SequenceId,
    /// The tokens the next step feeds: the prompt, then the last answer token.
    next: Vec<usize>,
    answer: Answer,
}

/// The blocks `request` takes from a pool of `block_size` blocks by its last step.
fn blocks_needed(request: &Request, block_size: usize) -> usize {
    request.positions().div_ceil(block_size)
}

/// The requests still to join, in order of arrival, and the blocks reserved for those in
/// flight: each request reserves the blocks its whole answer takes when it joins, so no step
/// is refused and nothing is preempted.
struct Admissions {
    arrival: Duration,
    pool_blocks: usize,
    /// Each request's blocks.
    needs: Vec<usize>,
    waiting: VecDeque<usize>,
    reserved: usize,
    /// Whether each request found too few free blocks once it had arrived.
    waited: Vec<bool>,
}

impl Admissions {
    /// # Errors
    ///
    /// If one request alone needs more blocks than the pool has.
    fn new(requests: &[Request], settings: ServeSettings) -> Result<Self, String> {
        let needs: Vec<usize> = requests
            .iter()
            .map(|request| blocks_needed(request, settings.block_size))
            .collect();
        if let Some(&most) = needs
            .iter()
            .filter(|&&need| need > settings.pool_blocks)
            .max()
        {
            return Err(format!(
                "--pool-blocks {}: a request needs {most} blocks of {} positions",
                settings.pool_blocks, settings.block_size
            ));
        }
        Ok(Self {
            arrival: settings.arrival,
            pool_blocks: settings.pool_blocks,
            waiting: (0..needs.len()).collect(),
            waited: vec![false; needs.len()],
            needs,
            reserved: 0,
        })
    }

    fn arrival(&self, request: usize) -> Duration {
        self.arrival * request as u32
    }

    /// The requests that join at `now`: those arrived by then, in order, while the pool has
    /// their blocks (the blocks are reserved).
    fn admit(&mut self, now: Duration) -> Vec<usize> {
        let mut joining = Vec::new();
        while let Some(&request) = self.waiting.front() {
            if self.arrival(request) > now {
                break;
            }
            if self.reserved + self.needs[request] > self.pool_blocks {
                // This request and every other that has arrived wait for blocks.
                for &later in &self.waiting {
                    if self.arrival(later) > now {
                        break;
                    }
                    self.waited[later] = true;
                }
                break;
            }
            self.waiting.pop_front();
            self.reserved += self.needs[request];
            joining.push(request);
        }
        joining
    }

    /// `request` finished: its blocks are free.
    fn release(&mut self, request: usize) {
        self.reserved -= self.needs[request];
    }
}

/// Serves `requests` by continuous batching over paged caches of `settings`' pool. A request
/// joins at the first step after it arrived once the blocks its whole answer takes are free.
///
/// # Errors
///
/// If one request alone needs more blocks than the pool has, or the model has no decoder to
/// serve.
pub fn continuously(
    model: &Transformer,
    requests: &[Request],
    settings: ServeSettings,
    device: &Device,
) -> Result<Served, String> {
    let config = PagedKvCacheConfig::new(settings.pool_blocks).with_block_size(settings.block_size);
    let mut state = model.start_paged(config)?;
    let mut admissions = Admissions::new(requests, settings)?;
    let mut served = Served {
        answers: vec![Answer::default(); requests.len()],
        ..Served::default()
    };
    let mut in_flight: Vec<InFlight> = Vec::new();
    let start = Instant::now();
    while !(admissions.waiting.is_empty() && in_flight.is_empty()) {
        if in_flight.is_empty() {
            let next = admissions.arrival(admissions.waiting[0]);
            std::thread::sleep(next.saturating_sub(start.elapsed()));
        }
        // Those arrived by now join this step; one arriving while a source is encoded joins
        // the next, so that a burst does not hold back the requests in flight.
        for request in admissions.admit(start.elapsed()) {
            in_flight.push(InFlight {
                request,
                id: model.join_paged(&mut state, &requests[request].source, device),
                next: requests[request].prompt.clone(),
                answer: Answer::default(),
            });
        }
        let runs: Vec<StepRun> = in_flight
            .iter()
            .map(|flight| StepRun {
                id: flight.id,
                tokens: flight.next.clone(),
            })
            .collect();
        let logits = model
            .paged_step(&mut state, &runs, device)
            .map_err(|error| format!("a reserved step was refused: {error}"))?;
        served.most_in_step = served.most_in_step.max(runs.len());
        served.peak_blocks = served.peak_blocks.max(state.blocks_in_use());
        let now = start.elapsed();
        for (flight, (token, margin)) in in_flight.iter_mut().zip(choices(logits)) {
            if flight.answer.tokens.is_empty() {
                flight.answer.first_token = now - admissions.arrival(flight.request);
            }
            flight.answer.tokens.push(token);
            flight.answer.margins.push(margin);
            flight.next = vec![token];
        }
        // Finished requests leave; their blocks are free for the next step's arrivals.
        let (finished, going_on) = std::mem::take(&mut in_flight)
            .into_iter()
            .partition(|flight| {
                flight.answer.tokens.len() == requests[flight.request].expected.len()
            });
        in_flight = going_on;
        for flight in finished {
            state
                .remove(flight.id)
                .map_err(|error| format!("a finished request: {error}"))?;
            admissions.release(flight.request);
            served.answers[flight.request] = flight.answer;
        }
    }
    served.wall = start.elapsed();
    served.waited = admissions.waited.iter().filter(|&&waited| waited).count();
    Ok(served)
}

/// Serves `requests` one after the other, each with the model's `KvCache`s of its own (its
/// held-out evaluation's greedy decoding, a batch of one), arriving as
/// [`continuously`] has them arrive.
pub fn one_at_a_time(
    model: &Transformer,
    requests: &[Request],
    settings: ServeSettings,
    device: &Device,
) -> Served {
    let mut served = Served::default();
    let start = Instant::now();
    for (index, request) in requests.iter().enumerate() {
        let arrival = settings.arrival * index as u32;
        std::thread::sleep(arrival.saturating_sub(start.elapsed()));
        let source = (!request.source.is_empty()).then(|| token_row(&request.source, device));
        let mut state = model.start_decoding(source);
        let mut input = token_row(&request.prompt, device);
        let mut answer = Answer::default();
        while answer.tokens.len() < request.expected.len() {
            let logits = model.decode_step(input, &mut state);
            let (token, margin) = choices(logits)[0];
            if answer.tokens.is_empty() {
                answer.first_token = start.elapsed() - arrival;
            }
            answer.tokens.push(token);
            answer.margins.push(margin);
            input = token_row(&[token], device);
        }
        served.answers.push(answer);
    }
    served.wall = start.elapsed();
    served
}

/// Each row's greedy token of `logits` (`[rows, vocab]`) and its lead over the runner-up.
fn choices(logits: Tensor<2>) -> Vec<(usize, f32)> {
    let [_, vocab] = logits.dims();
    let values = logits.into_data().try_to_vec::<f32>().expect("f32 logits");
    values.chunks_exact(vocab).map(greedy).collect()
}

/// The first largest logit's index and its lead over the largest of the others.
pub fn greedy(row: &[f32]) -> (usize, f32) {
    let mut best = 0;
    for (index, &logit) in row.iter().enumerate() {
        if logit > row[best] {
            best = index;
        }
    }
    let runner_up = row
        .iter()
        .enumerate()
        .filter(|&(index, _)| index != best)
        .map(|(_, &logit)| logit)
        .fold(f32::NEG_INFINITY, f32::max);
    (best, row[best] - runner_up)
}

/// How two ways' answers to the same requests compare.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Agreement {
    /// Requests answered alike.
    pub same: usize,
    /// Requests whose answers part where both ways' chosen logits led by less than
    /// [`NEAR_TIE`]: rounding may pick either.
    pub near_ties: usize,
    /// Requests whose answers part at a clear choice: `(request, token index, smaller lead)`.
    pub apart: Vec<(usize, usize, f32)>,
}

/// A lead below which two ways of computing the same logits may choose differently.
pub const NEAR_TIE: f32 = 1e-3;

/// Compares `a` and `b` request by request, at the first token where they part.
pub fn agreement(a: &[Answer], b: &[Answer]) -> Agreement {
    let mut agreement = Agreement::default();
    for (request, (a, b)) in a.iter().zip(b).enumerate() {
        let parting = a.tokens.iter().zip(&b.tokens).position(|(x, y)| x != y);
        match parting {
            None if a.tokens.len() == b.tokens.len() => agreement.same += 1,
            None => agreement
                .apart
                .push((request, a.tokens.len().min(b.tokens.len()), 0.0)),
            Some(at) => {
                let lead = a.margins[at].min(b.margins[at]);
                if lead < NEAR_TIE {
                    agreement.near_ties += 1;
                } else {
                    agreement.apart.push((request, at, lead));
                }
            }
        }
    }
    agreement
}

/// Requests answered exactly as the task expects, and answer tokens right.
pub fn correct(requests: &[Request], answers: &[Answer]) -> (usize, usize) {
    let mut exact = 0;
    let mut tokens = 0;
    for (request, answer) in requests.iter().zip(answers) {
        exact += usize::from(answer.tokens == request.expected);
        tokens += request
            .expected
            .iter()
            .zip(&answer.tokens)
            .filter(|(expected, got)| expected == got)
            .count();
    }
    (exact, tokens)
}

/// Prints a way's row of the table: tokens/s, wall time, time to first token, and how many
/// answers are right.
fn table_row(way: &str, requests: &[Request], served: &Served) {
    let answered: usize = requests.iter().map(|request| request.expected.len()).sum();
    let (exact, right) = correct(requests, &served.answers);
    let mut firsts: Vec<f64> = served
        .answers
        .iter()
        .map(|answer| answer.first_token.as_secs_f64() * 1e3)
        .collect();
    firsts.sort_by(f64::total_cmp);
    let at = |fraction: f64| firsts[((firsts.len() - 1) as f64 * fraction).round() as usize];
    println!(
        "| {way} | {:.0} | {:.2} s | {:.1} ms, {:.1} ms | {exact}/{} | {right}/{answered} |",
        answered as f64 / served.wall.as_secs_f64(),
        served.wall.as_secs_f64(),
        at(0.5),
        at(0.9),
        requests.len()
    );
}

/// Prints both ways' figures and how their answers compare.
///
/// # Errors
///
/// If the two ways' answers to a request part at a clear choice (a lead of [`NEAR_TIE`] or
/// more): the paged step and the `KvCache` compute the same logits to rounding.
pub fn report(
    task: String,
    requests: &[Request],
    settings: ServeSettings,
    batched: &Served,
    alone: &Served,
) -> Result<(), String> {
    let span = |lengths: Vec<usize>| {
        let (least, most) = (lengths.iter().min(), lengths.iter().max());
        match (least, most) {
            (Some(least), Some(most)) if least != most => format!("{least}-{most}"),
            (Some(least), _) => least.to_string(),
            _ => "0".into(),
        }
    };
    let arriving = if settings.arrival.is_zero() {
        "all arriving at once".to_string()
    } else {
        format!(
            "one arriving every {} ms",
            settings.arrival.as_secs_f64() * 1e3
        )
    };
    println!(
        "serving {} held-out requests ({task}): prompts of {} tokens, answers of {}, \
         {arriving}; a pool of {} blocks of {} positions per layer",
        requests.len(),
        span(
            requests
                .iter()
                .map(|request| request.prompt.len())
                .collect()
        ),
        span(
            requests
                .iter()
                .map(|request| request.expected.len())
                .collect()
        ),
        settings.pool_blocks,
        settings.block_size
    );
    println!(
        "| way | tokens/s | wall | time to first token (median, 90th percentile) | exact \
         match | answer tokens right |"
    );
    println!("|---|---|---|---|---|---|");
    table_row("continuous batching (paged)", requests, batched);
    table_row("one at a time (`KvCache`)", requests, alone);
    let reserved: usize = requests
        .iter()
        .map(|request| blocks_needed(request, settings.block_size))
        .sum();
    println!(
        "continuous batching: up to {} requests in a step; the pool at its fullest held {} of \
         {} blocks ({reserved} if every request were in flight at once); {} requests waited \
         for blocks",
        batched.most_in_step, batched.peak_blocks, settings.pool_blocks, batched.waited
    );
    let agreement = agreement(&batched.answers, &alone.answers);
    println!(
        "the same answers both ways: {} of {} ({} more part at a near tie, a lead under \
         {NEAR_TIE})",
        agreement.same,
        requests.len(),
        agreement.near_ties
    );
    match agreement.apart.first() {
        None => Ok(()),
        Some(&(request, at, lead)) => Err(format!(
            "{} requests got other answers by continuous batching than one at a time; the \
             first, request {request}, at token {at}, where both ways led by {lead} or more",
            agreement.apart.len()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(tokens: &[usize], margins: &[f32]) -> Answer {
        Answer {
            tokens: tokens.to_vec(),
            margins: margins.to_vec(),
            first_token: Duration::ZERO,
        }
    }

    #[test]
    fn greedy_takes_the_first_largest_and_its_lead_over_the_next() {
        assert_eq!(greedy(&[0.5, 2.0, 1.5, 2.0]), (1, 0.0));
        assert_eq!(greedy(&[3.0, 1.0, 2.5]), (0, 0.5));
    }

    #[test]
    fn answers_that_part_at_a_near_tie_are_excused_and_at_a_clear_choice_are_not() {
        let a = [
            answer(&[1, 2, 3], &[1.0, 1.0, 1.0]),
            answer(&[1, 2, 3], &[1.0, 1e-4, 1.0]),
            answer(&[1, 2, 3], &[1.0, 0.5, 1.0]),
            answer(&[1, 2], &[1.0, 1.0]),
        ];
        let b = [
            answer(&[1, 2, 3], &[1.0, 1.0, 1.0]),
            answer(&[1, 4, 3], &[1.0, 2e-4, 1.0]),
            answer(&[1, 4, 3], &[1.0, 0.4, 1.0]),
            answer(&[1, 2, 3], &[1.0, 1.0, 1.0]),
        ];
        let agreement = agreement(&a, &b);
        assert_eq!(agreement.same, 1);
        assert_eq!(agreement.near_ties, 1);
        assert_eq!(agreement.apart, vec![(2, 1, 0.4), (3, 2, 0.0)]);
    }

    #[test]
    fn a_request_stores_its_prompt_and_all_but_its_last_answer_token() {
        let request = Request {
            source: Vec::new(),
            prompt: vec![1, 2, 3, 4, 5, 6],
            expected: vec![1, 2, 3, 4, 5, 6],
        };
        assert_eq!(request.positions(), 11);
        assert_eq!(blocks_needed(&request, 16), 1);
        assert_eq!(blocks_needed(&request, 4), 3);
        let answers = [answer(&[1, 2, 3, 4, 5, 0], &[1.0; 6])];
        assert_eq!(correct(std::slice::from_ref(&request), &answers), (0, 5));
    }
}
