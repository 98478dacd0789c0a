//! Taking a [`KvCache`] step back, for the layers of a Transformer stack: a later layer may
//! refuse a step ([`CacheError::BeyondHalfRange`](super::CacheError::BeyondHalfRange)) after
//! the layers before it stored it, and those then return to where they were, so that every
//! layer holds the same positions.
//!
//! A cache that keeps every position (or up to a capacity) appends in place, so the step is
//! taken back by shortening what it holds to the positions before it: the buffer's positions
//! past them are spare room again. A window evicts positions (and now and then moves what it
//! keeps), so the tensors before the step are kept until the next one: shared, which makes the
//! step write into copies of them rather than into them.

use burn::tensor::{Bool, Tensor};

use super::stored::Stored;
use super::{CacheLimit, CacheOwner, KvCache};

/// Whether a cache keeps what its last step changed, and that record.
#[derive(Debug, Clone, Default)]
pub(super) enum UndoLog {
    /// Nothing is kept (a cache of one module).
    #[default]
    Off,
    /// Kept; `None` before the first step and once taken back.
    On(Option<Box<StepUndo>>),
}

/// What a [`KvCache`] held before its last step.
#[derive(Debug, Clone)]
pub(super) struct StepUndo {
    stored: StoredBefore,
    padding: Option<Tensor<2, Bool>>,
    seen: usize,
    owner: Option<CacheOwner>,
    batch: Option<usize>,
}

/// The keys and values before a step.
#[derive(Debug, Clone)]
// Lives in a boxed `StepUndo`, one per layer.
#[allow(clippy::large_enum_variant)]
enum StoredBefore {
    /// This many positions of the buffers the step appended to.
    Len(usize),
    /// These tensors (a window's, or none before the first step).
    Whole {
        key: Option<Stored>,
        value: Option<Stored>,
    },
}

impl StepUndo {
    /// What `cache` holds before a step.
    pub fn before(cache: &KvCache) -> StepUndo {
        let in_place = matches!(cache.limit, CacheLimit::Unbounded | CacheLimit::Fixed(_));
        let stored = match (&cache.key, in_place) {
            (Some(key), true) => StoredBefore::Len(key.len()),
            _ => StoredBefore::Whole {
                key: cache.key.clone(),
                value: cache.value.clone(),
            },
        };
        StepUndo {
            stored,
            padding: cache.padding.clone(),
            seen: cache.seen,
            owner: cache.owner,
            batch: cache.batch,
        }
    }
}

impl KvCache {
    /// Keeps what each step changes from now on, for [`undo_last_step`](Self::undo_last_step):
    /// the length before it, or, under a window, the window's tensors until the next step.
    pub(crate) fn keep_undo(&mut self) {
        if let UndoLog::Off = self.undo {
            self.undo = UndoLog::On(None);
        }
    }

    /// Takes back the last step: the cache holds what it held before it.
    ///
    /// # Panics
    ///
    /// If the cache does not keep its steps ([`keep_undo`](Self::keep_undo)) or has no step to
    /// take back.
    pub(crate) fn undo_last_step(&mut self) {
        let UndoLog::On(Some(undo)) = core::mem::take(&mut self.undo) else {
            panic!("KvCache::undo_last_step: no kept step to take back");
        };
        self.undo = UndoLog::On(None);
        let undo = *undo;
        match undo.stored {
            StoredBefore::Len(len) => {
                self.key = self.key.take().map(|stored| stored.truncated(len));
                self.value = self.value.take().map(|stored| stored.truncated(len));
            }
            StoredBefore::Whole { key, value } => (self.key, self.value) = (key, value),
        }
        self.padding = undo.padding;
        self.seen = undo.seen;
        self.owner = undo.owner;
        self.batch = undo.batch;
    }
}
