//! Cutting a [`KvCache`] back to its first positions: speculative decoding's rejected draft
//! tokens, or a reply regenerated from some point (Hugging Face's `DynamicCache::crop`,
//! llama.cpp's `seq_rm`).

use super::undo::UndoLog;
use super::{CacheError, KvCache};

impl KvCache {
    /// Cuts the cache back to its first `len` positions fed, as if only those had been fed:
    /// the next step's first token is at position `len`. The buffers keep their room (nothing
    /// is copied); a `len` at or past [`len`](Self::len) changes nothing, as with
    /// `Vec::truncate`, and a `len` of 0 empties the cache as [`reset`](Self::reset) does.
    ///
    /// Under a window ([`CacheLimit::SlidingWindow`](crate::CacheLimit::SlidingWindow),
    /// [`CacheLimit::StreamingWindow`](crate::CacheLimit::StreamingWindow)) the
    /// cache holds only the positions its next query sees: once the window has evicted some,
    /// a cut would leave the query without positions it sees, and is refused (a streaming
    /// window's cache may still be cut back to its sinks). Keep a clone of the cache from
    /// before the positions to reject instead: the two share their buffers until one appends,
    /// which then copies them.
    ///
    /// # Errors
    ///
    /// [`CacheError::Evicted`] if the window evicted positions that the query at `len` sees;
    /// the cache is then unchanged.
    pub fn truncate(&mut self, len: usize) -> Result<(), CacheError> {
        if !self.cut_changes(len)? {
            return Ok(());
        }
        if len == 0 {
            self.reset();
            return Ok(());
        }
        // A stack's layer keeps its last step to take it back; a cut forgets it.
        if let UndoLog::On(_) = self.undo {
            self.undo = UndoLog::On(None);
        }
        // A cut the window allows keeps the first `len` positions held: none before `len` was
        // evicted (a cut into a streaming window's sinks keeps that many of them), or, under a
        // window of 1, the positions it holds, its sinks or none.
        let kept = len.min(self.stored());
        self.seen = len;
        self.key = self.key.take().map(|stored| stored.truncated(kept));
        self.value = self.value.take().map(|stored| stored.truncated(kept));
        self.padding = self
            .padding
            .take()
            .map(|padding| padding.narrow(1, 0, kept));
        Ok(())
    }

    /// [`truncate`](Self::truncate) of every cache of `caches` (a stack's layers), all checked
    /// before any is cut.
    ///
    /// # Errors
    ///
    /// As [`truncate`](Self::truncate), from the first cache that refuses; none is then changed.
    pub(crate) fn truncate_all(caches: &mut [KvCache], len: usize) -> Result<(), CacheError> {
        for cache in caches.iter() {
            cache.cut_changes(len)?;
        }
        caches.iter_mut().try_for_each(|cache| cache.truncate(len))
    }

    /// Whether a cut to `len` changes the cache.
    ///
    /// # Errors
    ///
    /// As [`truncate`](Self::truncate).
    fn cut_changes(&self, len: usize) -> Result<bool, CacheError> {
        if len >= self.seen {
            return Ok(false);
        }
        let window = self.limit.window();
        let stored = self.stored();
        // The sinks held, then the latest positions from `held_from` on.
        let pinned = self.pinned(stored);
        let held_from = self.seen - (stored - pinned);
        // The query at `len` sees the sinks and its window's positions up to its own.
        let sees_from = window
            .map_or(0, |window| (len + 1).saturating_sub(window))
            .max(pinned);
        if sees_from < len.min(held_from) {
            return Err(CacheError::Evicted {
                len,
                sees_from,
                held_from,
            });
        }
        Ok(true)
    }
}
