//! [`Geometry`]: the sizes of one attention call, and the bottom-right causal alignment.

/// The sizes of one attention call on split heads:
///
/// - query `[batch, n_heads, seq_q, head_dim]`
/// - key `[batch, n_kv_heads, seq_k, head_dim]`
/// - value `[batch, n_kv_heads, seq_k, value_dim]`
///
/// The module builds it from its own sizes and the input's; the kernels read it off the tensors
/// they are given ([`Geometry::of_heads`]), which checks that the three fit together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub batch: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub head_dim: usize,
    pub value_dim: usize,
}

impl Geometry {
    /// The geometry of query, key and value heads of these shapes.
    ///
    /// # Panics
    ///
    /// If the shapes do not fit together: batch sizes or key/value head counts that differ, a
    /// key head width other than the query's, key and value lengths that differ, key/value
    /// heads that do not divide the query heads, or an empty axis. A kernel calls this at
    /// entry, so that no caller can drive it past the end of a buffer.
    #[track_caller]
    pub fn of_heads(query: [usize; 4], key: [usize; 4], value: [usize; 4]) -> Self {
        let [batch, n_heads, seq_q, head_dim] = query;
        let [key_batch, n_kv_heads, seq_k, key_dim] = key;
        let [value_batch, value_heads, value_len, value_dim] = value;
        let fits = key_batch == batch
            && value_batch == batch
            && key_dim == head_dim
            && value_heads == n_kv_heads
            && value_len == seq_k
            && n_kv_heads > 0
            && n_heads.is_multiple_of(n_kv_heads);
        assert!(
            fits,
            "attention kernel: query {query:?}, key {key:?} and value {value:?} do not fit \
             together (expected query [batch, n_heads, seq_q, head_dim], key [batch, n_kv_heads, \
             seq_k, head_dim], value [batch, n_kv_heads, seq_k, value_dim], n_kv_heads dividing \
             n_heads)"
        );
        assert!(
            query.iter().chain(&key).chain(&value).all(|&size| size > 0),
            "attention kernel: query {query:?}, key {key:?} and value {value:?} must have no \
             empty axis"
        );
        Self {
            batch,
            n_heads,
            n_kv_heads,
            seq_q,
            seq_k,
            head_dim,
            value_dim,
        }
    }

    /// Query heads per key/value head.
    pub fn groups(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// The key/value head that query head `head` reads (PyTorch's `repeat_interleave` order).
    #[cfg_attr(not(any(feature = "flex", feature = "ndarray")), allow(dead_code))]
    pub fn kv_head(&self, head: usize) -> usize {
        head / self.groups()
    }

    /// `[batch, n_heads, seq_q, seq_k]`: how many scores the call has.
    pub fn score_elements(&self) -> usize {
        self.batch * self.n_heads * self.seq_q * self.seq_k
    }
}

/// Bottom-right causal alignment (FlashAttention's): query `i` of `seq_q` sees key `j` of
/// `seq_k` when `j <= i + causal_offset(seq_q, seq_k)`, so that the last query sees every key.
pub(crate) fn causal_offset(seq_q: usize, seq_k: usize) -> i64 {
    seq_k as i64 - seq_q as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grouped_heads_read_their_key_value_head() {
        let geometry = Geometry::of_heads([2, 6, 3, 4], [2, 2, 5, 4], [2, 2, 5, 7]);
        assert_eq!(geometry.groups(), 3);
        assert_eq!(
            (0..6).map(|h| geometry.kv_head(h)).collect::<Vec<_>>(),
            [0, 0, 0, 1, 1, 1]
        );
        assert_eq!(geometry.value_dim, 7);
    }

    #[test]
    #[should_panic(expected = "do not fit together")]
    fn key_value_heads_that_do_not_divide_the_query_heads_are_refused() {
        Geometry::of_heads([1, 4, 3, 4], [1, 3, 5, 4], [1, 3, 5, 4]);
    }

    #[test]
    #[should_panic(expected = "do not fit together")]
    fn a_key_narrower_than_the_query_is_refused() {
        Geometry::of_heads([1, 2, 3, 8], [1, 2, 5, 4], [1, 2, 5, 4]);
    }
}
