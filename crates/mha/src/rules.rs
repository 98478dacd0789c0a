//! [`ScoreRules`]: what follows from positions — causal masking, a sliding window, packed
//! segments, ALiBi. Every kernel applies them to the block of scores it holds (the native
//! kernel row by row, the others from [`ScoreRules::block_forbid`] and
//! [`ScoreRules::block_bias`]), so that none needs a `[.., seq_q, seq_k]` tensor for them.

use std::ops::Range;
use std::sync::Arc;

use crate::geometry::Geometry;

/// The rules of one call, over the kernel's keys: the caller's (`positional_keys`, which have
/// positions) followed by any the module appended (`add_bias_kv`, `add_zero_attn`), which have
/// none: always visible, never biased.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ScoreRules {
    /// Absolute position of query 0 (negative when a causal cross-attention has more queries
    /// than keys: bottom-right alignment).
    pub query_start: i64,
    /// Absolute position of the first key after the pinned ones.
    pub key_start: i64,
    /// The first keys sit at positions `0..pinned_keys`, whatever `key_start` says: a
    /// streaming cache's sink positions, which no window hides.
    pub pinned_keys: usize,
    /// Keys with positions; those after them are appended.
    pub positional_keys: usize,
    /// A key after the query is hidden.
    pub causal: bool,
    /// A key `window` or more positions before the query is hidden (and, without `causal`, one
    /// as far after it): each query sees `window` positions up to itself.
    pub window: Option<usize>,
    /// A query sees only the keys of its own segment.
    pub segments: Option<Arc<Segments>>,
    /// ALiBi: `-slope[h] · |query position - key position|` is added to head `h`'s scores.
    pub alibi: Option<Arc<[f32]>>,
}

/// Segment ids of the queries and keys of every batch element (packed sequences).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Segments {
    /// `[batch, seq_q]`, row-major.
    pub query: Vec<i64>,
    /// `[batch, seq_k]` over the caller's keys, row-major.
    pub key: Vec<i64>,
    pub seq_q: usize,
    pub seq_k: usize,
    /// Every key row is non-decreasing (documents packed one after another): a segment is then
    /// a contiguous run of keys, and blocks outside it are skipped.
    pub sorted: bool,
}

impl Segments {
    pub fn new(query: Vec<i64>, key: Vec<i64>, seq_q: usize, seq_k: usize) -> Self {
        let sorted = key
            .chunks(seq_k.max(1))
            .all(|row| row.windows(2).all(|pair| pair[0] <= pair[1]));
        Self {
            query,
            key,
            seq_q,
            seq_k,
            sorted,
        }
    }

    /// The keys of query `query`'s segment in batch element `batch`, as a range, when the keys
    /// are sorted.
    fn key_run(&self, batch: usize, query: usize) -> Option<Range<usize>> {
        if !self.sorted {
            return None;
        }
        let id = self.query[batch * self.seq_q + query];
        let row = &self.key[batch * self.seq_k..(batch + 1) * self.seq_k];
        let start = row.partition_point(|&key| key < id);
        let end = row.partition_point(|&key| key <= id);
        Some(start..end)
    }

    fn same(&self, batch: usize, query: usize, key: usize) -> bool {
        self.query[batch * self.seq_q + query] == self.key[batch * self.seq_k + key]
    }
}

impl ScoreRules {
    /// No rule: every key visible, nothing added.
    #[cfg(test)]
    pub fn none(positional_keys: usize) -> Self {
        Self {
            query_start: 0,
            key_start: 0,
            pinned_keys: 0,
            positional_keys,
            causal: false,
            window: None,
            segments: None,
            alibi: None,
        }
    }

    /// Whether the rules fit a call of these sizes: no more positional keys than keys, one
    /// ALiBi slope per query head, one segment id per query and per positional key.
    pub fn fit(&self, geometry: &Geometry) -> bool {
        let Geometry {
            batch,
            n_heads,
            seq_q,
            seq_k,
            ..
        } = *geometry;
        self.positional_keys <= seq_k
            && self
                .alibi
                .as_ref()
                .is_none_or(|slopes| slopes.len() == n_heads)
            && self.segments.as_ref().is_none_or(|segments| {
                segments.seq_q == seq_q
                    && segments.seq_k == self.positional_keys
                    && segments.query.len() == batch * seq_q
                    && segments.key.len() == batch * self.positional_keys
            })
    }

    /// Whether some rule hides keys.
    pub fn hides_keys(&self) -> bool {
        self.causal || self.window.is_some() || self.segments.is_some()
    }

    /// Whether the rules are plain bottom-right causal masking over every key of a call with
    /// `seq_q` queries and `seq_k` keys, which a kernel may be told as one flag.
    pub fn is_plain_causal(&self, seq_q: usize, seq_k: usize) -> bool {
        self.causal
            && self.window.is_none()
            && self.segments.is_none()
            && self.pinned_keys == 0
            && self.positional_keys == seq_k
            && self.query_start - self.key_start == seq_k as i64 - seq_q as i64
    }

    fn query_position(&self, query: usize) -> i64 {
        self.query_start + query as i64
    }

    fn key_position(&self, key: usize) -> i64 {
        if key < self.pinned_keys {
            key as i64
        } else {
            self.key_start + (key - self.pinned_keys) as i64
        }
    }

    /// The positional keys query `query` may see, as far as causality and the window say:
    /// `lo..hi` (plus the pinned keys, which the window never hides).
    fn position_range(&self, query: usize) -> Range<usize> {
        let keys = self.positional_keys;
        let position = self.query_position(query);
        // The index of the first unpinned key at or after absolute position `p`.
        let index_of = |p: i64| -> usize {
            let index = p - self.key_start + self.pinned_keys as i64;
            index.clamp(self.pinned_keys as i64, keys as i64) as usize
        };
        let mut hi = keys;
        let mut lo = self.pinned_keys;
        if self.causal {
            hi = index_of(position + 1);
        }
        if let Some(window) = self.window {
            lo = index_of(position - window as i64 + 1);
            if !self.causal {
                hi = hi.min(index_of(position + window as i64));
            }
        }
        let pinned_visible = if self.causal {
            (0..self.pinned_keys)
                .filter(|&key| self.key_position(key) <= position)
                .count()
        } else {
            self.pinned_keys
        };
        // The unpinned range, with the pinned keys before it when any is visible.
        match pinned_visible {
            0 => lo..hi.max(lo),
            _ => 0..hi.max(lo),
        }
    }

    /// Query `query`'s visible positional keys as one range, when they form one (no pinned
    /// key is visible apart from it, and segments are sorted); the appended keys are visible
    /// besides. `None` when the visible keys must be told one by one ([`Self::visible`]).
    #[cfg_attr(not(any(feature = "flex", feature = "ndarray")), allow(dead_code))]
    pub fn contiguous_range(&self, batch: usize, query: usize) -> Option<Range<usize>> {
        if self.pinned_keys > 0 && self.window.is_some() {
            return None;
        }
        let mut range = self.position_range(query);
        if let Some(segments) = &self.segments {
            let run = segments.key_run(batch, query)?;
            range = range.start.max(run.start)..range.end.min(run.end);
        }
        Some(if range.is_empty() { 0..0 } else { range })
    }

    /// Whether query `query` of batch element `batch` may see key `key`.
    pub fn visible(&self, batch: usize, query: usize, key: usize) -> bool {
        if key >= self.positional_keys {
            return true;
        }
        let position = self.query_position(query);
        let key_position = self.key_position(key);
        if self.causal && key_position > position {
            return false;
        }
        if let Some(window) = self.window
            && key >= self.pinned_keys
        {
            let distance = position - key_position;
            if distance >= window as i64 || (!self.causal && -distance >= window as i64) {
                return false;
            }
        }
        match &self.segments {
            Some(segments) => segments.same(batch, query, key),
            None => true,
        }
    }

    /// The keys queries `queries` of batch element `batch` may see, as one range (keys
    /// outside it are hidden from every one of them; inside it some may still be). The
    /// appended keys are always in it.
    pub fn key_range(
        &self,
        batch: usize,
        queries: Range<usize>,
        total_keys: usize,
    ) -> Range<usize> {
        if queries.is_empty() {
            return 0..0;
        }
        let mut lo = usize::MAX;
        let mut hi = 0;
        for query in queries {
            let mut range = self.position_range(query);
            if let Some(run) = self.segments.as_ref().and_then(|s| s.key_run(batch, query)) {
                range = range.start.max(run.start)..range.end.min(run.end);
            }
            if !range.is_empty() {
                lo = lo.min(range.start);
                hi = hi.max(range.end);
            }
        }
        if total_keys > self.positional_keys {
            // Appended keys: always visible.
            return lo.min(self.positional_keys)..total_keys;
        }
        if lo >= hi { 0..0 } else { lo..hi }
    }

    /// The ALiBi bias of query `query` against key `key` in head `head` (0 for appended keys).
    pub fn bias(&self, head: usize, query: usize, key: usize) -> f32 {
        match &self.alibi {
            Some(slopes) if key < self.positional_keys => {
                let distance = (self.query_position(query) - self.key_position(key)).abs();
                -slopes[head] * distance as f32
            }
            _ => 0.0,
        }
    }

    /// The positional keys among `keys`, in the runs along which query `query`'s signed
    /// distance (query position − key position) falls by one per key: `(run, distance to the
    /// run's first key)`, the pinned keys' run then the others'; appended keys are in neither.
    /// The ALiBi bias of key `k` of a run is then `-slope · |distance - (k - run.start)|`, what
    /// [`Self::bias`] gives, as one vectorised pass per run.
    #[cfg_attr(not(any(feature = "flex", feature = "ndarray")), allow(dead_code))]
    pub fn distance_runs(&self, query: usize, keys: &Range<usize>) -> [(Range<usize>, i64); 2] {
        let positional_end = keys.end.min(self.positional_keys).max(keys.start);
        let pinned_end = self.pinned_keys.clamp(keys.start, positional_end);
        let position = self.query_position(query);
        [keys.start..pinned_end, pinned_end..positional_end]
            .map(|run| (run.clone(), position - self.key_position(run.start)))
    }

    /// `[batch | 1, 1, q_len, k_len]` flags of the keys `keys` hidden from queries `queries`
    /// (batch-wide only with segments), or `None` when none is.
    pub fn block_forbid(
        &self,
        batch: usize,
        queries: Range<usize>,
        keys: Range<usize>,
    ) -> Option<(Vec<bool>, [usize; 4])> {
        if !self.hides_keys() {
            return None;
        }
        let batches = if self.segments.is_some() { batch } else { 1 };
        let mut hidden = false;
        let values: Vec<bool> = (0..batches)
            .flat_map(|b| {
                let keys = keys.clone();
                queries
                    .clone()
                    .flat_map(move |q| keys.clone().map(move |k| (b, q, k)))
            })
            .map(|(b, q, k)| {
                let forbidden = !self.visible(b, q, k);
                hidden |= forbidden;
                forbidden
            })
            .collect();
        hidden.then_some((values, [batches, 1, queries.len(), keys.len()]))
    }

    /// `[1, n_heads, q_len, k_len]` ALiBi bias of queries `queries` against keys `keys`, or
    /// `None` without ALiBi.
    pub fn block_bias(
        &self,
        n_heads: usize,
        queries: Range<usize>,
        keys: Range<usize>,
    ) -> Option<(Vec<f32>, [usize; 4])> {
        self.alibi.as_ref()?;
        let values = (0..n_heads)
            .flat_map(|h| {
                let keys = keys.clone();
                queries
                    .clone()
                    .flat_map(move |q| keys.clone().map(move |k| (h, q, k)))
            })
            .map(|(h, q, k)| self.bias(h, q, k))
            .collect();
        Some((values, [1, n_heads, queries.len(), keys.len()]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn visible_keys(rules: &ScoreRules, batch: usize, query: usize, keys: usize) -> Vec<usize> {
        (0..keys)
            .filter(|&key| rules.visible(batch, query, key))
            .collect()
    }

    /// Every rule's `key_range` covers exactly the visible keys' span, and `visible` agrees
    /// with the direct definitions.
    #[test]
    fn key_ranges_cover_exactly_the_visible_keys() {
        let segments = Arc::new(Segments::new(
            vec![0, 0, 1, 1, 1, 2, 0, 0, 0, 0, 0, 0],
            vec![0, 0, 1, 1, 1, 2, 0, 0, 0, 0, 0, 0],
            6,
            6,
        ));
        let cases = [
            ScoreRules {
                causal: true,
                ..ScoreRules::none(6)
            },
            ScoreRules {
                window: Some(2),
                causal: true,
                ..ScoreRules::none(6)
            },
            ScoreRules {
                window: Some(2),
                ..ScoreRules::none(6)
            },
            ScoreRules {
                segments: Some(segments.clone()),
                causal: true,
                ..ScoreRules::none(6)
            },
            ScoreRules {
                query_start: -2,
                causal: true,
                ..ScoreRules::none(6)
            },
            // A streaming cache: 2 pinned keys at 0, 1, then positions 10.. ; queries at 13..
            ScoreRules {
                query_start: 13,
                key_start: 10,
                pinned_keys: 2,
                causal: true,
                window: Some(3),
                ..ScoreRules::none(6)
            },
        ];
        for rules in cases {
            for batch in 0..2 {
                for query in 0..6 {
                    let visible = visible_keys(&rules, batch, query, 7);
                    let range = rules.key_range(batch, query..query + 1, 7);
                    for key in &visible {
                        assert!(
                            range.contains(key),
                            "{rules:?} b{batch} q{query}: {key} in {range:?}"
                        );
                    }
                }
            }
        }
        let window = ScoreRules {
            window: Some(2),
            causal: true,
            ..ScoreRules::none(6)
        };
        assert_eq!(visible_keys(&window, 0, 4, 6), [3, 4]);
        let streaming = ScoreRules {
            query_start: 13,
            key_start: 10,
            pinned_keys: 2,
            causal: true,
            window: Some(3),
            ..ScoreRules::none(6)
        };
        // Query at 13 sees the pinned keys and positions 11, 12, 13 (keys 3, 4, 5).
        assert_eq!(visible_keys(&streaming, 0, 0, 6), [0, 1, 3, 4, 5]);
        let packed = ScoreRules {
            segments: Some(segments),
            causal: true,
            ..ScoreRules::none(6)
        };
        assert_eq!(visible_keys(&packed, 0, 4, 6), [2, 3, 4]);
        assert_eq!(packed.key_range(0, 2..5, 6), 2..5);
    }

    /// The rules' causality is the bottom-right alignment of `causal_mask` for any lengths.
    #[test]
    fn causal_rules_are_bottom_right_aligned() {
        use crate::geometry::causal_offset;
        for (seq_q, seq_k) in [(3, 3), (2, 5), (5, 2), (1, 7), (7, 1)] {
            let rules = ScoreRules {
                query_start: seq_k as i64 - seq_q as i64,
                causal: true,
                ..ScoreRules::none(seq_k)
            };
            for query in 0..seq_q {
                for key in 0..seq_k {
                    let visible = key as i64 <= query as i64 + causal_offset(seq_q, seq_k);
                    assert_eq!(
                        rules.visible(0, query, key),
                        visible,
                        "{seq_q}x{seq_k} q{query} k{key}"
                    );
                }
            }
        }
    }

    #[test]
    fn distance_runs_give_the_alibi_bias_of_every_key() {
        // A streaming cache's layout: 2 pinned keys at 0 and 1, positions 10.. after them, then
        // 2 appended keys; queries at 13...
        let rules = ScoreRules {
            query_start: 13,
            key_start: 10,
            pinned_keys: 2,
            positional_keys: 8,
            alibi: Some(Arc::from([0.5f32, 0.25])),
            ..ScoreRules::none(8)
        };
        let total_keys = 10;
        for head in 0..2 {
            let slope = [0.5f32, 0.25][head];
            for query in 0..4 {
                for start in 0..total_keys {
                    for end in start..=total_keys {
                        let keys = start..end;
                        let mut biases = vec![0.0f32; keys.len()];
                        for (run, distance) in rules.distance_runs(query, &keys) {
                            assert!(keys.start <= run.start && run.end <= keys.end);
                            for key in run.clone() {
                                let distance = distance - (key - run.start) as i64;
                                biases[key - start] += -slope * distance.abs() as f32;
                            }
                        }
                        let expected: Vec<f32> = keys
                            .clone()
                            .map(|key| rules.bias(head, query, key))
                            .collect();
                        assert_eq!(
                            biases, expected,
                            "head {head}, query {query}, keys {keys:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn alibi_penalises_distance_and_spares_appended_keys() {
        let rules = ScoreRules {
            query_start: 3,
            alibi: Some(Arc::from([0.5f32, 0.25])),
            ..ScoreRules::none(4)
        };
        assert_eq!(rules.bias(0, 0, 0), -1.5);
        assert_eq!(rules.bias(1, 0, 1), -0.5);
        assert_eq!(rules.bias(1, 0, 4), 0.0, "appended key");
        let (values, shape) = rules.block_bias(2, 0..1, 2..4).unwrap();
        assert_eq!(shape, [1, 2, 1, 2]);
        assert_eq!(values, [-0.5, 0.0, -0.25, 0.0]);
    }
}
