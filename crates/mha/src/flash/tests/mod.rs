//! The flash op's bodies on the CPU backends against the explicit path: the native kernel
//! and the generic body, each run through [`Execution`] (fresh outputs poisoned with NaN, the
//! generic body forced, a probe that hears which body ran). The GPU kernels' cases are an
//! integration test of their own (`tests/gpu_kernels.rs`).

mod bodies;
mod registrations;

use std::sync::Arc;

use burn::tensor::{Distribution, TensorData};

use super::*;
use crate::execution::{Body, Event, FreshOutputs, Probe, Ran};
use crate::rules::{ScoreRules, Segments};

#[allow(deprecated)]
fn cpu_devices() -> [Device; 2] {
    [Device::flex(), Device::ndarray()]
}

fn normal<const D: usize>(shape: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
}

/// One configuration of masks, rules, soft cap and sinks.
struct Case {
    label: &'static str,
    masks: ScoreMasks,
    softcap: Option<f64>,
    sinks: bool,
}

/// The cases the kernels are compared on: what they are called and what they hold.
// Longer than most: a table, one case per entry; it grows by an entry per feature.
fn cases(device: &Device, [batch, n_heads, seq_q, seq_k]: [usize; 4]) -> Vec<Case> {
    // Key padding as the module passes it, `[batch, 1, 1, seq_k]`: broadcast query and head
    // axes; the second sequence's last keys padded, one query row fully masked by a bool
    // mask on top.
    let mut padding = vec![false; batch * seq_k];
    padding[seq_k + seq_k - 2..].fill(true);
    let padding =
        Tensor::<4, Bool>::from_data(TensorData::new(padding, [batch, 1, 1, seq_k]), device);
    let mut row = vec![false; seq_q * seq_k];
    row[seq_k..2 * seq_k].fill(true);
    let dead_row = Tensor::<4, Bool>::from_data(TensorData::new(row, [1, 1, seq_q, seq_k]), device);
    let none = || ScoreMasks::none(seq_k);
    let causal = ScoreRules {
        query_start: seq_k as i64 - seq_q as i64,
        causal: true,
        ..ScoreRules::none(seq_k)
    };
    // Two documents per row, split at a different place in each batch element.
    let split = |len: usize, b: usize| (0..len).map(move |i| i64::from(i >= len / 2 + b));
    let segments = Arc::new(Segments::new(
        (0..batch).flat_map(|b| split(seq_q, b)).collect(),
        (0..batch).flat_map(|b| split(seq_k, b)).collect(),
        seq_q,
        seq_k,
    ));
    let case = |label, masks, softcap, sinks| Case {
        label,
        masks,
        softcap,
        sinks,
    };
    vec![
        case("none", none(), None, false),
        case(
            "causal",
            ScoreMasks {
                rules: causal.clone(),
                ..none()
            },
            None,
            false,
        ),
        case(
            "padding + dead row + causal",
            ScoreMasks {
                forbid: Some(
                    padding
                        .expand([batch, 1, seq_q, seq_k])
                        .bool_or(dead_row.clone().expand([batch, 1, seq_q, seq_k])),
                ),
                rules: causal.clone(),
                ..none()
            },
            None,
            false,
        ),
        case(
            "broadcast padding",
            ScoreMasks {
                forbid: Some(Tensor::from_data(
                    TensorData::new(vec![false; batch * seq_k], [batch, 1, 1, seq_k]),
                    device,
                )),
                ..none()
            },
            None,
            false,
        ),
        case(
            "float bias",
            ScoreMasks {
                bias: Some(normal([batch, n_heads, seq_q, seq_k], device)),
                ..none()
            },
            None,
            false,
        ),
        case(
            "window 3, causal, ALiBi",
            ScoreMasks {
                rules: ScoreRules {
                    window: Some(3),
                    alibi: Some((0..n_heads).map(|h| 0.5 / (h + 1) as f32).collect()),
                    ..causal.clone()
                },
                ..none()
            },
            None,
            false,
        ),
        case(
            "segments, causal",
            ScoreMasks {
                rules: ScoreRules {
                    segments: Some(segments.clone()),
                    ..causal.clone()
                },
                ..none()
            },
            None,
            false,
        ),
        case(
            "two-sided window 2, segments",
            ScoreMasks {
                rules: ScoreRules {
                    window: Some(2),
                    segments: Some(segments),
                    ..ScoreRules::none(seq_k)
                },
                ..none()
            },
            None,
            false,
        ),
        case("soft cap 1.5", none(), Some(1.5), false),
        case(
            "sinks + dead row + causal",
            ScoreMasks {
                forbid: Some(dead_row.expand([batch, 1, seq_q, seq_k])),
                rules: causal,
                ..none()
            },
            None,
            true,
        ),
    ]
}

/// The output and the gradients of q, k, v (and the sinks) of `loss = Σ o · sin(o)`.
fn outputs_and_grads(
    [query, key, value]: [&Tensor<4>; 3],
    sinks: Option<&Tensor<1>>,
    attend: impl Fn(Tensor<4>, Tensor<4>, Tensor<4>, Option<Tensor<1>>) -> Tensor<4>,
) -> Vec<Tensor<4>> {
    let [query, key, value] = [query, key, value].map(|t| t.clone().detach().require_grad());
    let sinks = sinks.map(|s| s.clone().detach().require_grad());
    let output = attend(query.clone(), key.clone(), value.clone(), sinks.clone());
    let grads = (output.clone() * output.clone().sin()).sum().backward();
    let mut all = vec![
        output.inner(),
        query.grad(&grads).unwrap(),
        key.grad(&grads).unwrap(),
        value.grad(&grads).unwrap(),
    ];
    if let Some(sinks) = sinks {
        all.push(sinks.grad(&grads).unwrap().reshape([1, 1, 1, -1]));
    }
    all
}

/// The largest `|a - b|` over two tensors of one shape, in f32; infinite where either holds a
/// value that is not finite (Burn's `max` passes NaN over, which would hide an output element a
/// kernel did not write).
fn max_difference<const D: usize>(a: &Tensor<D>, b: &Tensor<D>) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let values = |t: &Tensor<D>| {
        t.clone()
            .cast(burn::tensor::FloatDType::F32)
            .into_data()
            .to_vec::<f32>()
            .expect("f32 values")
    };
    values(a)
        .iter()
        .zip(&values(b))
        .map(|(x, y)| {
            if x.is_finite() && y.is_finite() {
                (x - y).abs()
            } else {
                f32::INFINITY
            }
        })
        .fold(0.0, f32::max)
}

/// Asserts that each of [`outputs_and_grads`]'s tensors in `actual` is within `tolerance`
/// of `expected`'s, naming `label` and the tensor where one is not.
fn assert_outputs_and_grads_close(
    actual: Vec<Tensor<4>>,
    expected: &[Tensor<4>],
    tolerance: f32,
    label: &str,
) {
    assert_eq!(actual.len(), expected.len(), "{label}: tensors");
    for (index, (actual, expected)) in actual.into_iter().zip(expected).enumerate() {
        let what = ["output", "d query", "d key", "d value", "d sinks"][index];
        let difference = max_difference(&actual, expected);
        assert!(
            difference <= tolerance,
            "{label}: {what} differs by {difference}"
        );
    }
}

/// Random q `[2, 4, seq_q, 6]`, k `[2, 2, seq_k, 6]`, v `[2, 2, seq_k, 3]` (two query heads
/// per key/value head) and sinks `[4]`.
fn grouped_heads(device: &Device, seq_q: usize, seq_k: usize) -> ([Tensor<4>; 3], Tensor<1>) {
    grouped_heads_with_values(device, seq_q, seq_k, 3)
}

/// [`grouped_heads`] with value heads `value_dim` wide.
fn grouped_heads_with_values(
    device: &Device,
    seq_q: usize,
    seq_k: usize,
    value_dim: usize,
) -> ([Tensor<4>; 3], Tensor<1>) {
    let heads = [
        normal([2, 4, seq_q, 6], device),
        normal([2, 2, seq_k, 6], device),
        normal([2, 2, seq_k, value_dim], device),
    ];
    (heads, normal([4], device))
}

fn options(case: &Case, sinks: Option<Tensor<1>>) -> SoftmaxOptions {
    SoftmaxOptions {
        scale: 0.35,
        custom_scale: true,
        softcap: case.softcap,
        sinks,
    }
}

/// One of the two bodies a CPU device runs, with fresh output buffers NaN (an element the
/// native kernel does not write shows: recycled buffers hold an earlier call's values) and a
/// probe that hears which body computed each pass.
struct BodyRun {
    label: &'static str,
    execution: Execution,
    probe: Probe,
    expected: Ran,
}

impl BodyRun {
    fn new(label: &'static str, body: Body, expected: Ran) -> Self {
        let probe = Probe::default();
        let execution = Execution {
            body,
            fresh_outputs: FreshOutputs::Nan,
            probe: Some(probe.clone()),
        };
        Self {
            label,
            execution,
            probe,
            expected,
        }
    }

    /// The native kernel, and the generic body forced where the native kernel would run.
    fn both() -> [Self; 2] {
        [
            Self::new("native", Body::Native, Ran::Cpu),
            Self::new("generic", Body::Generic, Ran::Generic),
        ]
    }

    /// Asserts that the expected body, and no other, computed every pass since the last call.
    fn assert_ran(&self, label: &str) {
        let computed: Vec<Ran> = self
            .probe
            .take()
            .into_iter()
            .filter_map(|event| match event {
                Event::Computed { body, .. } => Some(body),
                Event::Registered { .. } => None,
            })
            .collect();
        assert!(
            !computed.is_empty() && computed.iter().all(|&body| body == self.expected),
            "{label} {}: computed by {computed:?}",
            self.label
        );
    }
}
