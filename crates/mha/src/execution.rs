//! How the crate's ops run, beside what they compute: which body computes a call, what a
//! kernel's fresh output buffers hold before it writes them, and a probe that hears what ran.
//!
//! The module always runs its ops with [`Execution::default`]. Tests set the fields from outside
//! (to compare the bodies, to see an output element a kernel forgets to write, to count the
//! gradients a backward registers) instead of flipping switches inside the kernels.

use std::sync::{Arc, Mutex};

/// The choices a caller makes about how an op runs; [`Default`] for ordinary calls.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Execution {
    /// Which body computes the call.
    pub body: Body,
    /// What a CPU kernel's fresh output buffers hold before it writes them.
    pub fresh_outputs: FreshOutputs,
    /// Hears which body computed each pass and what each backward registered.
    pub probe: Option<Probe>,
}

impl Execution {
    /// Tells the probe, if there is one, that `body` computed `pass`.
    pub fn note_computed(&self, pass: Pass, body: Ran) {
        if let Some(probe) = &self.probe {
            probe.record(Event::Computed { pass, body });
        }
    }

    /// Tells the probe, if there is one, which parents an autodiff node's backward registered
    /// a gradient for (`registered`), of the parent slots the tape counts for it (`declared`).
    pub fn note_registered(&self, declared: Vec<u64>, registered: Vec<u64>) {
        if let Some(probe) = &self.probe {
            probe.record(Event::Registered {
                declared,
                registered,
            });
        }
    }
}

/// Which body computes a call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Body {
    /// The backend's own kernel where it takes the call (the CPU kernels on flex's and
    /// ndarray's f32 storage, the CubeCL kernels on the GPU backends), the generic body in
    /// backend primitives for the rest.
    #[default]
    Native,
    /// The generic body, even where a native kernel would take the call (which would otherwise
    /// leave the generic body untested on f32).
    // A seam: set by the tests, never by the module.
    #[cfg_attr(not(test), allow(dead_code))]
    Generic,
}

/// What a fresh output buffer of a CPU kernel holds before the kernel writes it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum FreshOutputs {
    /// Unspecified values: a reused buffer's earlier ones, or zeros. Every kernel writes every
    /// element of its outputs, so this is never seen.
    #[default]
    Unspecified,
    /// NaN in every element, and never a reused buffer: an element a kernel forgets to write
    /// shows in its result.
    #[cfg_attr(not(any(feature = "flex", feature = "ndarray")), allow(dead_code))]
    Nan,
}

/// One thing an op did, as a [`Probe`] hears it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Event {
    /// `body` computed `pass` of a call.
    Computed { pass: Pass, body: Ran },
    /// An autodiff node's backward ran: the ids of the parent slots the tape counts for it
    /// (data-parallel training's gradient sync waits for exactly that many registrations of
    /// each parameter), and the ids it registered a gradient for.
    Registered {
        declared: Vec<u64>,
        registered: Vec<u64>,
    },
}

/// A pass of an op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    Forward,
    /// The forward with the attention weights, for inference.
    Weights,
    Backward,
}

/// The body that computed a pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ran {
    /// The native kernel on CPU storage.
    #[cfg_attr(not(any(feature = "flex", feature = "ndarray")), allow(dead_code))]
    Cpu,
    /// The native CubeCL kernels.
    // Made by the CubeCL kernels only, compiled with a GPU backend's feature.
    #[cfg_attr(not(feature = "cube"), allow(dead_code))]
    Cube,
    /// The generic body in backend primitives.
    Generic,
}

/// A log of [`Event`]s shared by the caller that reads it and the ops that write it (the ops'
/// parameters carry clones).
#[derive(Debug, Clone, Default)]
pub(crate) struct Probe(Arc<Mutex<Vec<Event>>>);

// A seam: read by the tests, which attach probes; the module attaches none.
#[cfg_attr(not(test), allow(dead_code))]
impl Probe {
    fn record(&self, event: Event) {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(event);
    }

    /// Every event since the last call, oldest first; the log is empty afterwards.
    pub fn take(&self) -> Vec<Event> {
        std::mem::take(
            &mut *self
                .0
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        )
    }

    /// How many passes `body` computed since the last [`Probe::take`], which empties the log.
    pub fn take_computed_by(&self, body: Ran) -> usize {
        self.take()
            .iter()
            .filter(|event| matches!(event, Event::Computed { body: ran, .. } if *ran == body))
            .count()
    }
}

/// Two probes are equal when they are one log.
impl PartialEq for Probe {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_hears_what_an_execution_notes_and_nothing_without_one() {
        let probe = Probe::default();
        let heard = Execution {
            probe: Some(probe.clone()),
            ..Execution::default()
        };
        heard.note_computed(Pass::Forward, Ran::Cpu);
        heard.note_registered(vec![1, 2], vec![2]);
        Execution::default().note_computed(Pass::Backward, Ran::Generic);
        assert_eq!(
            probe.take(),
            [
                Event::Computed {
                    pass: Pass::Forward,
                    body: Ran::Cpu
                },
                Event::Registered {
                    declared: vec![1, 2],
                    registered: vec![2]
                }
            ]
        );
        assert!(probe.take().is_empty(), "taken");
        heard.note_computed(Pass::Weights, Ran::Cube);
        heard.note_computed(Pass::Backward, Ran::Generic);
        assert_eq!(probe.take_computed_by(Ran::Cube), 1);
        assert_ne!(probe, Probe::default(), "another log");
    }
}
