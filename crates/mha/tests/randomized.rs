//! Randomized comparisons: random configurations and inputs through the flash, chunked and
//! explicit paths, outputs and every gradient, on the CPU backends; and random bad input,
//! which must be refused with a message, never crash or return a wrong shape.
//!
//! Every case comes from a seed; a failure prints it, and
//! `MHA_RANDOM_CASE=<seed> cargo test --release --workspace --test randomized` replays that
//! case alone. `MHA_RANDOM_CASES=<n>` sets how many cases each test draws.

mod common;

use burn::module::Param;
use burn::tensor::{Bool, Device, FloatDType, Gradients, Int, Tensor, TensorData};
use common::{Rng, test_devices};
use mha::{
    AttentionPath, BlockSizes, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig, NeedWeights,
    RopeConfig, RopeLayout, flash_attention_supported,
};

/// One random configuration and input.
#[derive(Debug, Clone)]
struct Case {
    seed: u64,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    batch: usize,
    seq_q: usize,
    seq_k: usize,
    self_attention: bool,
    causal: bool,
    padding: bool,
    float_mask: bool,
    rope: Option<RopeLayout>,
    alibi: bool,
    add_bias_kv: bool,
    window: Option<usize>,
    softcap: Option<f64>,
    sinks: bool,
    quiet_softmax: bool,
    /// Packed segments; `sorted`: ids never decrease along a row (else any ids).
    segments: Option<bool>,
    input_scale: f32,
    blocks: BlockSizes,
}

impl Case {
    fn random(seed: u64) -> Self {
        let mut rng = Rng(seed);
        let n_kv_heads = rng.pick(&[1, 1, 2, 3]);
        let n_heads = n_kv_heads * rng.pick(&[1, 2, 3]);
        let rope = rng
            .chance(0.25)
            .then(|| rng.pick(&[RopeLayout::Interleaved, RopeLayout::HalfSplit]));
        let head_dim = match rope {
            // RoPE rotates pairs.
            Some(_) => rng.pick(&[2, 4, 16, 34]),
            None => rng.pick(&[1, 3, 4, 17, 33]),
        };
        let self_attention = rng.chance(0.5);
        let long = rng.chance(0.15);
        let length = |rng: &mut Rng| {
            if long {
                100 + rng.below(200)
            } else {
                1 + rng.below(24)
            }
        };
        let seq_q = length(&mut rng);
        let seq_k = if self_attention {
            seq_q
        } else {
            length(&mut rng)
        };
        Self {
            seed,
            n_heads,
            n_kv_heads,
            head_dim,
            batch: 1 + rng.below(3),
            seq_q,
            seq_k,
            self_attention,
            causal: rng.chance(0.5),
            padding: rng.chance(0.5),
            float_mask: rng.chance(0.25),
            rope,
            alibi: rng.chance(0.25),
            add_bias_kv: rng.chance(0.2),
            window: rng.chance(0.25).then(|| 1 + rng.below(seq_k.max(seq_q))),
            softcap: rng.chance(0.2).then(|| rng.pick(&[0.5, 5.0, 30.0])),
            sinks: rng.chance(0.2),
            quiet_softmax: rng.chance(0.1),
            segments: rng.chance(0.2).then(|| rng.chance(0.7)),
            input_scale: rng.pick(&[0.1, 1.0, 1.0, 3.0, 30.0]),
            blocks: BlockSizes {
                query: 1 + rng.below(40),
                key: 1 + rng.below(40),
            },
        }
    }

    fn config(&self) -> MultiHeadAttentionConfig {
        MultiHeadAttentionConfig::new(self.n_heads * self.head_dim, self.n_heads)
            .with_n_kv_heads(Some(self.n_kv_heads))
            .with_rope(
                self.rope
                    .map(|layout| RopeConfig::new().with_layout(layout)),
            )
            .with_alibi(self.alibi)
            .with_add_bias_kv(self.add_bias_kv)
            .with_window(self.window)
            .with_softcap(self.softcap)
            .with_attention_sinks(self.sinks)
            .with_quiet_softmax(self.quiet_softmax && !self.sinks)
    }
}

/// The module, inputs and masks of a case, on `device` (autodiff).
struct Instance {
    module: MultiHeadAttention,
    query: Tensor<3>,
    memory: Tensor<3>,
    padding: Option<Tensor<2, Bool>>,
    float_mask: Option<Tensor<3>>,
    /// Query and key segment ids.
    segments: Option<(Tensor<2, Int>, Tensor<2, Int>)>,
}

impl Instance {
    fn new(case: &Case, device: &Device) -> Self {
        let mut rng = Rng(case.seed ^ 0xA5A5);
        // The parameters are drawn here, under the seed's guard: drawn at their first use,
        // after it drops, they took whatever state a concurrent test had seeded, and the case
        // no longer replayed from its seed (a saturated case's gradient then fell to ~1e-16,
        // below the rounding noise the test below holds the flash path to).
        let mut module = common::drawn(device, case.seed, || case.config().init(device));
        if module.sinks.is_some() {
            // Trained sinks, not the initial zeros: some above the scores, some below.
            module.sinks = Some(Param::from_tensor(rng.tensor([case.n_heads], 2.0, device)));
        }
        let d_model = case.n_heads * case.head_dim;
        let query = rng.tensor([case.batch, case.seq_q, d_model], case.input_scale, device);
        let memory = if case.self_attention {
            query.clone()
        } else {
            rng.tensor([case.batch, case.seq_k, d_model], case.input_scale, device)
        };
        // Padding at the ends of some sequences, a whole sequence padded now and then (its
        // queries then see no key).
        let padding = case.padding.then(|| {
            let mut values = vec![false; case.batch * case.seq_k];
            for row in values.chunks_mut(case.seq_k) {
                let padded = match rng.below(5) {
                    0 => case.seq_k,
                    _ => rng.below(case.seq_k),
                };
                row[case.seq_k - padded..].fill(true);
            }
            Tensor::from_data(TensorData::new(values, [case.batch, case.seq_k]), device)
        });
        let float_mask = case.float_mask.then(|| {
            let values: Vec<f32> = (0..case.batch * case.seq_q * case.seq_k)
                .map(|_| {
                    if rng.chance(0.1) {
                        f32::NEG_INFINITY
                    } else {
                        rng.normal()
                    }
                })
                .collect();
            Tensor::from_data(
                TensorData::new(values, [case.batch, case.seq_q, case.seq_k]),
                device,
            )
        });
        let segments = case.segments.map(|sorted| {
            let mut ids = |length: usize| -> Tensor<2, Int> {
                let mut values = Vec::with_capacity(case.batch * length);
                for _ in 0..case.batch {
                    let mut id = 0i64;
                    for _ in 0..length {
                        match sorted {
                            true if rng.chance(0.2) => id += 1,
                            true => {}
                            false => id = rng.below(3) as i64,
                        }
                        values.push(id);
                    }
                }
                Tensor::from_data(TensorData::new(values, [case.batch, length]), device)
            };
            let query_ids = ids(case.seq_q);
            let key_ids = if case.self_attention {
                query_ids.clone()
            } else {
                ids(case.seq_k)
            };
            (query_ids, key_ids)
        });
        Self {
            module,
            query,
            memory,
            padding,
            float_mask,
            segments,
        }
    }

    /// The module with every parameter cast to `dtype` (the same values, another float type).
    fn module_in(&self, dtype: FloatDType) -> MultiHeadAttention {
        let mut module = self.module.clone();
        for linear in [
            &mut module.query,
            &mut module.key,
            &mut module.value,
            &mut module.output,
        ] {
            linear.weight = Param::from_tensor(linear.weight.val().cast(dtype).detach());
            linear.bias = linear
                .bias
                .take()
                .map(|bias| Param::from_tensor(bias.val().cast(dtype).detach()));
        }
        for bias in [&mut module.bias_k, &mut module.bias_v, &mut module.sinks] {
            *bias = bias
                .take()
                .map(|bias| Param::from_tensor(bias.val().cast(dtype).detach()));
        }
        module
    }

    /// The context and every gradient through `path`, computed in `dtype` by `module`,
    /// flattened (as f32) and named.
    fn run(
        &self,
        case: &Case,
        module: &MultiHeadAttention,
        dtype: FloatDType,
        path: AttentionPath,
    ) -> Vec<(String, Vec<f32>)> {
        let query = self.query.clone().cast(dtype).detach().require_grad();
        let memory =
            (!case.self_attention).then(|| self.memory.clone().cast(dtype).detach().require_grad());
        let input = self.input(case, query.clone(), memory.clone());
        let context = module.forward(input.path(path)).context;
        let weights = Rng(case.seed ^ 0x5A5A).tensor(context.dims(), 1.0, &context.device());
        let grads = (context.clone() * weights.cast(dtype)).sum().backward();
        let vector = |tensor: Tensor<3>| tensor.into_data().try_into_vec_as::<f32>().unwrap();
        let mut named = vec![
            ("context".to_string(), vector(context.inner())),
            ("d query".to_string(), vector(gradient(&query, &grads))),
        ];
        if let Some(memory) = &memory {
            named.push(("d memory".to_string(), vector(gradient(memory, &grads))));
        }
        named.extend(self.parameter_gradients(module, &grads));
        named
    }

    /// The exact answer [`Instance::run`] holds the f32 paths to: the explicit path in f64.
    fn exact(&self, case: &Case) -> Vec<(String, Vec<f32>)> {
        self.run(
            case,
            &self.module_in(FloatDType::F64),
            FloatDType::F64,
            AttentionPath::Explicit,
        )
    }

    /// The context and the weights (per head, then averaged) of an inference forward through
    /// `path`, computed in `dtype` by `module`, flattened (as f32) and named.
    fn run_inference(
        &self,
        case: &Case,
        module: &MultiHeadAttention,
        dtype: FloatDType,
        path: AttentionPath,
    ) -> Vec<(String, Vec<f32>)> {
        let query = self.query.clone().cast(dtype);
        let memory = (!case.self_attention).then(|| self.memory.clone().cast(dtype));
        let input = self.input(case, query, memory).path(path);
        let flat = |tensor: Tensor<3>| tensor.into_data().try_into_vec_as::<f32>().unwrap();
        let per_head = module.forward(input.clone().need_weights(NeedWeights::PerHead));
        let averaged = module.forward(input.need_weights(NeedWeights::Averaged));
        let weights = |output: mha::MhaOutput| output.weights.expect("weights were asked for");
        vec![
            ("context".to_string(), flat(per_head.context.clone())),
            (
                "weights per head".to_string(),
                weights(per_head)
                    .per_head()
                    .unwrap()
                    .into_data()
                    .try_into_vec_as::<f32>()
                    .unwrap(),
            ),
            (
                "averaged weights".to_string(),
                flat(weights(averaged).averaged()),
            ),
        ]
    }

    /// The case's input over `query` and `memory` (self-attention without one).
    fn input(&self, case: &Case, query: Tensor<3>, memory: Option<Tensor<3>>) -> MhaInput {
        let mut input = match memory {
            Some(memory) => MhaInput::new(query, memory.clone(), memory),
            None => MhaInput::self_attn(query),
        };
        if let Some(padding) = &self.padding {
            input = input.key_padding_mask(padding.clone());
        }
        if let Some(mask) = &self.float_mask {
            input = input.attn_mask(mask.clone());
        }
        if case.causal {
            input = input.causal();
        }
        if let Some((query_ids, key_ids)) = &self.segments {
            input = if case.self_attention {
                input.segment_ids(query_ids.clone())
            } else {
                input.segment_ids_cross(query_ids.clone(), key_ids.clone())
            };
        }
        input
    }

    /// The gradient of every parameter of `module`, flattened (as f32) and named.
    fn parameter_gradients(
        &self,
        module: &MultiHeadAttention,
        grads: &Gradients,
    ) -> Vec<(String, Vec<f32>)> {
        let flat = |tensor: Tensor<2>| tensor.into_data().try_into_vec_as::<f32>().unwrap();
        let mut named = Vec::new();
        for (name, linear) in [
            ("q", &module.query),
            ("k", &module.key),
            ("v", &module.value),
            ("o", &module.output),
        ] {
            named.push((
                format!("d W_{name}"),
                flat(gradient(&linear.weight.val(), grads)),
            ));
            let bias = gradient(&linear.bias.as_ref().unwrap().val(), grads);
            named.push((
                format!("d b_{name}"),
                bias.into_data().try_into_vec_as().unwrap(),
            ));
        }
        for (name, parameter) in [
            ("bias_k", &module.bias_k),
            ("bias_v", &module.bias_v),
            ("sinks", &module.sinks),
        ] {
            if let Some(parameter) = parameter {
                let grad = gradient(&parameter.val(), grads);
                named.push((
                    format!("d {name}"),
                    grad.into_data().try_into_vec_as().unwrap(),
                ));
            }
        }
        named
    }
}

/// The gradient of `tensor`; zeros when nothing it feeds reaches the loss (every query's keys
/// masked: the output is the output projection's bias alone).
fn gradient<const D: usize>(tensor: &Tensor<D>, grads: &Gradients) -> Tensor<D> {
    tensor
        .grad(grads)
        .unwrap_or_else(|| tensor.clone().inner().zeros_like())
}

/// How many cases a test draws: `MHA_RANDOM_CASES`, or `default`; or the one seed
/// `MHA_RANDOM_CASE` names.
fn seeds(default: u64, salt: u64) -> Vec<u64> {
    if let Ok(seed) = std::env::var("MHA_RANDOM_CASE") {
        return vec![seed.parse().expect("MHA_RANDOM_CASE=<seed>")];
    }
    let count = std::env::var("MHA_RANDOM_CASES")
        .ok()
        .and_then(|count| count.parse().ok())
        .unwrap_or(default);
    (0..count).map(|index| salt * 1_000_003 + index).collect()
}

/// The largest absolute difference of two flattened tensors.
fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// The rule for a path under test, after FlashAttention's tests: against the exact answer
/// (the explicit path in f64), its error may be at most 4 times the f32 explicit path's, or
/// a floor relative to the tensor's natural scale, whichever is larger. A wrong term costs an
/// error of the order of that scale, far past either.
///
/// FlashAttention allows twice the reference's error. Over hundreds of random cases the ratio
/// of two rounding errors, each the maximum over a tensor, strays past that now and then, most
/// in saturated softmaxes, where every path's error is rounding noise: there the floor
/// decides. It is 2e-4 of the natural scale at inputs of unit scale, and grows with the square
/// of the input scale, as the scores do and with them the rounding of every probability (an
/// ulp of the score): 4.5e-2 at inputs scaled by 30, where scores reach the thousands and a
/// gradient's terms cancel to a small fraction of their size (seen: 3.5e-2 of the result).
/// There the suite checks that every path stays finite and roughly right; the tight bound
/// holds for the inputs of ordinary scale, four cases in five.
fn compare(
    what: &str,
    actual: &[f32],
    explicit: &[f32],
    exact: &[f32],
    natural_scale: f32,
    input_scale: f32,
) -> Result<(), String> {
    if actual.len() != exact.len() {
        return Err(format!(
            "{what}: {} values, expected {}",
            actual.len(),
            exact.len()
        ));
    }
    if let Some(index) = actual.iter().position(|x| !x.is_finite()) {
        return Err(format!(
            "{what}[{index}]: {} where the exact value is {}",
            actual[index], exact[index]
        ));
    }
    let (error, yardstick) = (
        max_difference(actual, exact),
        max_difference(explicit, exact),
    );
    let floor = 2e-4 * (input_scale * input_scale / 4.0).max(1.0);
    let bound = (4.0 * yardstick).max(floor * natural_scale);
    match error <= bound {
        true => Ok(()),
        false => Err(format!(
            "{what}: error {error:e} > max(4 × the f32 explicit path's {yardstick:e}, {floor:e} × \
             natural scale {natural_scale:e})"
        )),
    }
}

/// The scale each gradient's terms have: its own largest value, and for a bias also its
/// weight's divided by the input scale. (A bias gradient sums the terms its weight's gradient
/// weighs by the inputs; the key bias's cancels exactly — softmax ignores a shift shared by
/// every key — so its own values say nothing of the terms' size.)
fn natural_scales(exact: &[(String, Vec<f32>)], input_scale: f32) -> Vec<f32> {
    let largest = |values: &[f32]| values.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    exact
        .iter()
        .map(|(what, values)| {
            let own = largest(values);
            let weight = what
                .strip_prefix("d b_")
                .and_then(|part| {
                    exact
                        .iter()
                        .find(|(name, _)| *name == format!("d W_{part}"))
                })
                .map_or(0.0, |(_, weight)| largest(weight) / input_scale);
            own.max(weight).max(1e-2)
        })
        .collect()
}

/// Flash, chunked and explicit paths agree in the output and every gradient, on random
/// configurations: head widths 1 to 34 (odd ones too), GQA and MQA, sequences of 1 to 300,
/// batches of 1 to 3, causal, padding with fully padded rows, float masks with `-inf`, RoPE,
/// ALiBi, `add_bias_kv`, sliding windows, soft-capping, attention sinks, the quiet softmax,
/// packed segments (sorted and not), inputs scaled up to 30. Each f32 path is held to the exact answer
/// (the explicit path in f64) by FlashAttention's rule, no more than a few times the error of
/// the explicit path in f32 (see [`compare`]).
#[test]
fn flash_chunked_and_explicit_paths_agree_on_random_cases() {
    let cases = seeds(200, 1);
    for (name, device) in test_devices() {
        if name == "wgpu" {
            // Every case is a new set of kernels to compile on lavapipe (and f64 is not every
            // GPU's); the GPU paths are held to these answers by the fixed cases of
            // paths.rs.
            continue;
        }
        let device = device.autodiff();
        let mut failures = Vec::new();
        for &seed in &cases {
            let case = Case::random(seed);
            let instance = Instance::new(&case, &device);
            let exact = instance.exact(&case);
            let f32 = |path| instance.run(&case, &instance.module, FloatDType::F32, path);
            let explicit = f32(AttentionPath::Explicit);
            let mut paths = vec![AttentionPath::Chunked(case.blocks)];
            if flash_attention_supported(&device) {
                paths.push(AttentionPath::Flash(case.blocks));
            }
            let scales = natural_scales(&exact, case.input_scale);
            for path in paths {
                let actual = f32(path);
                let compared = exact.iter().zip(&explicit).zip(&actual).zip(&scales);
                for ((((what, exact), (_, explicit)), (_, actual)), &scale) in compared {
                    let checked = compare(what, actual, explicit, exact, scale, case.input_scale);
                    if let Err(error) = checked {
                        failures.push(format!("{name} {path:?} seed {seed}: {error}\n  {case:?}"));
                    }
                }
            }
        }
        assert!(
            failures.is_empty(),
            "{} failures over {} cases (replay one with MHA_RANDOM_CASE=<seed>):\n{}",
            failures.len(),
            cases.len(),
            failures.join("\n")
        );
    }
}

/// A nearly saturated softmax: inputs scaled by 30 put the scores in the hundreds, one key's
/// probability within an ulp of 1, and the query's gradient is then a sum of tiny terms (the
/// other keys' probabilities times their score gradients' differences from the top key's).
/// The flash kernel once computed it off by half, where the explicit path in f32 was off by 3%:
/// its rows' `D` summed unshifted, whose rounding, an ulp of the top key's score gradient,
/// outweighed the result. Found by seed 1000211 of the test above at `MHA_RANDOM_CASES=1000`;
/// held here to the tight rule alone (4 times the explicit path's error, no floor).
#[test]
fn a_saturated_softmax_keeps_its_query_and_key_gradients() {
    let case = Case::random(1000211);
    assert!(
        case.input_scale == 30.0 && case.causal && !case.self_attention,
        "the case this test describes: {case:?}"
    );
    for (name, device) in test_devices() {
        let device = device.autodiff();
        if name == "wgpu" || !flash_attention_supported(&device) {
            // On wgpu the fixed cases of paths.rs hold the GPU paths.
            continue;
        }
        let instance = Instance::new(&case, &device);
        let exact = instance.exact(&case);
        let f32 = |path| instance.run(&case, &instance.module, FloatDType::F32, path);
        let (explicit, flash) = (
            f32(AttentionPath::Explicit),
            f32(AttentionPath::Flash(case.blocks)),
        );
        for (((what, exact), (_, explicit)), (_, flash)) in exact.iter().zip(&explicit).zip(&flash)
        {
            if ["d query", "d W_q", "d W_k"].contains(&what.as_str()) {
                let (error, yardstick) = (
                    max_difference(flash, exact),
                    max_difference(explicit, exact),
                );
                assert!(
                    error <= 4.0 * yardstick,
                    "{name} {what}: flash error {error:e}, the explicit path's {yardstick:e}"
                );
            }
        }
    }
}

/// A case replays from its seed alone: its parameters are drawn in [`Instance::new`], under the
/// seed's lock, not at their first use, by when a test on another thread may have seeded the
/// backend's generator again (which once made the test above fail now and then).
#[test]
fn a_case_keeps_its_parameters_when_the_generator_is_seeded_again_before_their_use() {
    let case = Case::random(1000211);
    let device = Device::flex();
    let parameters = |seeded_again: bool| {
        let instance = Instance::new(&case, &device);
        if seeded_again {
            let _another_test = common::seed(&device, case.seed + 1);
        }
        let module = &instance.module;
        [&module.query, &module.key, &module.value, &module.output]
            .iter()
            .flat_map(|linear| {
                let bias = linear
                    .bias
                    .as_ref()
                    .expect("the case's projections have biases");
                [linear.weight.val().into_data(), bias.val().into_data()]
            })
            .map(|data| data.try_to_vec::<f32>().unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(parameters(false), parameters(true));
}

/// For inference, the weights `Auto` returns (the native flash kernel writes them on flex and
/// ndarray), per head and averaged, and the context beside them, agree with the explicit path's
/// on the random configurations, held to the exact answer (the explicit path in f64) by the
/// same rule as the gradients.
#[test]
fn inference_weights_agree_with_the_explicit_path_on_random_cases() {
    let cases = seeds(200, 3);
    for (name, device) in test_devices() {
        if name == "wgpu" {
            // As above; on wgpu `Auto` takes the explicit path for weights anyway.
            continue;
        }
        let mut failures = Vec::new();
        for &seed in &cases {
            let case = Case::random(seed);
            let instance = Instance::new(&case, &device);
            let exact = instance.run_inference(
                &case,
                &instance.module_in(FloatDType::F64),
                FloatDType::F64,
                AttentionPath::Explicit,
            );
            let f32 = |path| instance.run_inference(&case, &instance.module, FloatDType::F32, path);
            let explicit = f32(AttentionPath::Explicit);
            let actual = f32(AttentionPath::Auto);
            let scales = natural_scales(&exact, case.input_scale);
            let compared = exact.iter().zip(&explicit).zip(&actual).zip(&scales);
            for ((((what, exact), (_, explicit)), (_, actual)), &scale) in compared {
                let checked = compare(what, actual, explicit, exact, scale, case.input_scale);
                if let Err(error) = checked {
                    failures.push(format!("{name} seed {seed}: {error}\n  {case:?}"));
                }
            }
        }
        assert!(
            failures.is_empty(),
            "{} failures over {} cases (replay one with MHA_RANDOM_CASE=<seed>):\n{}",
            failures.len(),
            cases.len(),
            failures.join("\n")
        );
    }
}

/// Random wrong shapes of every argument, wrong mask ranks, empty batches and sequences: each
/// is refused with a panic whose message names the argument (or the empty axis), never a
/// crash in a kernel and never an output of a wrong shape.
// Longer than most: one table of ways an input can be wrong, drawn from at random.
#[test]
fn random_bad_input_is_refused_with_a_message() {
    let device = Device::flex();
    // Drawn under the seed's guard, so that these draws never interleave with a seeded case's.
    let module = common::drawn(&device, 2, || {
        MultiHeadAttentionConfig::new(8, 2)
            .with_d_key_input(Some(6))
            .with_d_value_input(Some(5))
            .init(&device)
    });
    let (batch, seq_q, seq_k) = (2, 3, 4);
    let zeros3 = |shape: [usize; 3]| Tensor::<3>::zeros(shape, &device);
    let good = [[batch, seq_q, 8], [batch, seq_k, 6], [batch, seq_k, 5]];
    let mut failures = Vec::new();
    for seed in seeds(300, 2) {
        let mut rng = Rng(seed);
        let mut shapes = good;
        // Break one thing, or more.
        let breaks = 1 + rng.below(2);
        let mut broken = Vec::new();
        for _ in 0..breaks {
            let (argument, axis) = (rng.below(3), rng.below(3));
            let wrong = loop {
                let size = rng.pick(&[0, 1, 2, 3, 4, 5, 6, 7, 9]);
                if size != good[argument][axis] {
                    break size;
                }
            };
            shapes[argument][axis] = wrong;
            broken.push(["query", "key", "value"][argument]);
        }
        let padding_shape = [
            rng.pick(&[batch, batch, 1, 3]),
            rng.pick(&[seq_k, seq_k, 3, 5]),
        ];
        let mask_rank = rng.pick(&[1, 2, 3, 4, 5]);
        let use_padding = rng.chance(0.3);
        let use_mask = rng.chance(0.3);
        let [q, k, v] = shapes;
        let shapes_fit = q[0] == k[0]
            && k[0] == v[0]
            && k[1] == v[1]
            && q[2] == 8
            && k[2] == 6
            && v[2] == 5
            && q[0] > 0
            && q[1] > 0
            && k[1] > 0;
        let padding_fits = !use_padding || padding_shape == [q[0], k[1]];
        let mask_fits = !use_mask || mask_rank == 2;
        let outcome = common::outcome(|| {
            let mut input =
                MhaInput::new(zeros3(q), zeros3(k), zeros3(v)).need_weights(if rng.chance(0.5) {
                    NeedWeights::PerHead
                } else {
                    NeedWeights::No
                });
            if use_padding {
                input = input.key_padding_mask(Tensor::<2, Bool>::zeros(padding_shape, &device));
            }
            if use_mask {
                input = match mask_rank {
                    1 => input.attn_mask(Tensor::<1, Bool>::zeros([k[1]], &device)),
                    2 => input.attn_mask(Tensor::<2, Bool>::zeros([q[1], k[1]], &device)),
                    3 => input.attn_mask(Tensor::<3, Bool>::zeros([q[0], q[1] + 1, k[1]], &device)),
                    4 => input.attn_mask(Tensor::<4, Bool>::zeros([q[0], 3, q[1], k[1]], &device)),
                    _ => input.attn_mask(Tensor::<5>::zeros([1, q[0], 2, q[1], k[1]], &device)),
                };
            }
            Some(module.forward(input).context.dims())
        });
        match outcome {
            Err(message) => {
                let named = [
                    "`query`",
                    "`key`",
                    "`value`",
                    "`key_padding_mask`",
                    "`attn_mask`",
                    "non-empty",
                ]
                .iter()
                .any(|name| message.contains(name));
                if !named || !message.starts_with("MultiHeadAttention") {
                    failures.push(format!(
                        "seed {seed} ({broken:?}): unclear message {message:?}"
                    ));
                }
            }
            Ok(output) => {
                // Only a call whose every shape fits may run, and then with the right output.
                let right =
                    shapes_fit && padding_fits && mask_fits && output == Some([q[0], q[1], 8]);
                if !right {
                    failures.push(format!(
                        "seed {seed} ({broken:?}): accepted with output {output:?} for query \
                         {q:?}, key {k:?}, value {v:?}"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
