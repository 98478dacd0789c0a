//! Choosing a cache's batch elements: beam search's surviving beams (reordered, repeated), a
//! finished sequence leaving a batch, one prefilled prompt repeated for parallel samples
//! (Hugging Face's `Cache.reorder_cache` and `batch_select_indices`).

use burn::tensor::{Bool, Int, Tensor, TensorData};

use super::undo::UndoLog;
use super::{CrossAttentionCache, KvCache};

impl KvCache {
    /// Keeps the batch elements `elements` of the cache, in that order, each as many times as
    /// it is named: element `i` of the next step continues the sequence that was element
    /// `elements[i]`, with its positions, padding and window. The buffers are copied once
    /// (their room kept); the next step's batch is `elements.len()`.
    ///
    /// For beam search, the beams kept after a step (`select_batch(&parents)`); for a batch
    /// whose finished sequences leave it; for several samples of one prompt, prefilled once
    /// (`select_batch(&[0; 4])`).
    ///
    /// # Panics
    ///
    /// If `elements` is empty or names an element past the cache's batch, or if no step was
    /// taken (the cache has no batch yet).
    pub fn select_batch(&mut self, elements: &[usize]) {
        let batch = self
            .batch
            .expect("KvCache::select_batch: no step was taken, so the cache has no batch yet");
        check_elements(elements, batch, "KvCache::select_batch");
        // A stack's layer keeps its last step to take it back; a new batch forgets it.
        if let UndoLog::On(_) = self.undo {
            self.undo = UndoLog::On(None);
        }
        self.key = self.key.take().map(|key| key.with_batch_elements(elements));
        self.value = self
            .value
            .take()
            .map(|value| value.with_batch_elements(elements));
        self.padding = self
            .padding
            .take()
            .map(|padding| mask_rows(padding, elements));
        self.batch = Some(elements.len());
    }
}

impl CrossAttentionCache {
    /// Keeps the batch elements `elements` of the projected memory, in that order, each as many
    /// times as it is named ([`KvCache::select_batch`], for a decoder's beams).
    ///
    /// # Panics
    ///
    /// If `elements` is empty or names an element past the memory's batch.
    pub fn select_batch(&mut self, elements: &[usize]) {
        check_elements(elements, self.batch(), "CrossAttentionCache::select_batch");
        let index = index_tensor(elements, &self.key.device());
        self.key = self.key.clone().select(0, index.clone());
        self.value = self.value.clone().select(0, index);
        self.key_padding_mask = self
            .key_padding_mask
            .take()
            .map(|mask| mask_rows(mask, elements));
    }
}

/// Panics unless `elements` names at least one element, each below `batch`.
fn check_elements(elements: &[usize], batch: usize, caller: &str) {
    assert!(
        !elements.is_empty(),
        "{caller}: `elements` is empty; a batch keeps at least one element (remove the cache \
         to drop them all)"
    );
    if let Some(&past) = elements.iter().find(|&&element| element >= batch) {
        panic!("{caller}: `elements` names element {past} of a batch of {batch}");
    }
}

/// `indices` as an index tensor on `device`.
pub(super) fn index_tensor(indices: &[usize], device: &burn::tensor::Device) -> Tensor<1, Int> {
    let values: Vec<i64> = indices.iter().map(|&index| index as i64).collect();
    Tensor::from_data(TensorData::new(values, [indices.len()]), device)
}

/// Rows `elements` of `mask`, in order. Why not `select`: flex's (burn 0.22.1) gives a bool
/// tensor's selected rows the dtype U8, which the next step's `cat` with bool masks refuses.
fn mask_rows(mask: Tensor<2, Bool>, elements: &[usize]) -> Tensor<2, Bool> {
    let rows = elements
        .iter()
        .map(|&element| mask.clone().narrow(0, element, 1))
        .collect();
    Tensor::cat(rows, 0)
}
