//! What may attend to what. One [`Visibility`] per forward describes everything that removes
//! or biases a query-key pair — key padding, the caller's bool or float mask, causal masking, a
//! sliding window, packed segments, ALiBi — and is checked and turned into the form the kernels
//! take ([`ScoreMasks`]: the caller's masks as tensors, the rules that follow from positions
//! as [`ScoreRules`]) here and nowhere else.

use std::sync::Arc;

use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorData};

use crate::alibi::alibi_slopes_f32;
use crate::geometry::{Geometry, causal_offset};
use crate::input::{AttnMask, MaskValues};
use crate::rules::{ScoreRules, Segments};
use crate::shape::{check_shape, describe};

/// The causal mask of `seq_q` queries over `seq_k` keys, bottom-right aligned: `true` where
/// key `j` lies in the future of query `i`, i.e. `j > i + seq_k - seq_q`.
///
/// When `seq_q > seq_k`, the first `seq_q - seq_k` queries see no key at all (their output
/// is zero).
///
/// # Shapes
///
/// - output: `[seq_q, seq_k]`
pub fn causal_mask(seq_q: usize, seq_k: usize, device: &Device) -> Tensor<2, Bool> {
    Tensor::<2, Bool>::tril_mask([seq_q, seq_k], causal_offset(seq_q, seq_k), device)
}

/// Absolute positions of a forward's first query and first (unpinned) key: RoPE rotates by
/// them, causal masking, ALiBi and a sliding window compare them. A plain forward aligns the
/// sequences at their ends (queries at `seq_k - seq_q ..`, keys at `0 ..`; the first query's
/// position is negative when there are more queries than keys); under a cache they come from
/// the cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Positions {
    pub query: i64,
    pub key: i64,
}

impl Positions {
    /// The position RoPE rotates the first query by (positions before 0 count as 0).
    pub fn rope_query(&self) -> usize {
        self.query.max(0) as usize
    }
}

/// Segment ids of a forward's queries and keys (`[batch, seq_q]`, `[batch, seq_k]`).
#[derive(Debug, Clone)]
pub(crate) struct SegmentIds {
    pub query: Tensor<2, Int>,
    pub key: Tensor<2, Int>,
}

/// Everything that decides which key a query may attend to, and with what added to its score.
#[derive(Debug, Clone)]
pub(crate) struct Visibility {
    /// `[batch, seq_k]`, `true` = padding, ignored.
    pub key_padding: Option<Tensor<2, Bool>>,
    /// The caller's bool (`true` = may not attend) or float (added) mask.
    pub attn_mask: Option<AttnMask>,
    /// A key after the query is hidden.
    pub causal: bool,
    /// A key `window` or more positions before the query is hidden (and without causal
    /// masking one as far after it).
    pub window: Option<usize>,
    /// ALiBi's per-head distance penalty.
    pub alibi: bool,
    pub positions: Positions,
    /// The first keys are at positions `0..pinned_keys` (a streaming cache's sinks).
    pub pinned_keys: usize,
    /// Packed sequences: a query sees only the keys of its own segment.
    pub segments: Option<SegmentIds>,
    /// Key positions the module appends after the caller's (`add_bias_kv`, `add_zero_attn`):
    /// never masked, never biased, as PyTorch pads its masks with "attend" columns for them.
    pub extra_keys: usize,
}

/// Masks in the form the kernels take.
#[derive(Debug, Clone)]
pub(crate) struct ScoreMasks {
    /// `true` = the pair may not attend (key padding and the caller's bool mask), broadcastable
    /// to `[batch, n_heads, seq_q, seq_k + extra_keys]`.
    pub forbid: Option<Tensor<4, Bool>>,
    /// The caller's float mask, added to the scores; broadcastable likewise.
    pub bias: Option<Tensor<4>>,
    /// What follows from positions, computed by each kernel for its blocks.
    pub rules: ScoreRules,
}

impl ScoreMasks {
    /// No mask and no rule over `keys` keys.
    #[cfg(test)]
    pub fn none(keys: usize) -> Self {
        Self {
            forbid: None,
            bias: None,
            rules: ScoreRules::none(keys),
        }
    }

    /// The masks of queries `queries` against keys `keys`, rules included, as tensors
    /// broadcastable to `[batch, n_heads, q_len, k_len]` (the explicit and fused paths take
    /// the whole range, the chunked path one block at a time).
    pub fn block(
        &self,
        [batch, n_heads]: [usize; 2],
        queries: std::ops::Range<usize>,
        keys: std::ops::Range<usize>,
        (device, dtype): (&Device, DType),
    ) -> (Option<Tensor<4, Bool>>, Option<Tensor<4>>) {
        let mut forbid = self
            .forbid
            .as_ref()
            .map(|mask| narrow_block(mask, &queries, &keys));
        let mut bias = self
            .bias
            .as_ref()
            .map(|bias| narrow_block(bias, &queries, &keys).cast(dtype));
        if let Some(rules) = self.rules_forbid(batch, &queries, &keys, device) {
            forbid = Some(or_broadcast(forbid, rules));
        }
        if let Some((values, shape)) = self.rules.block_bias(n_heads, queries, keys) {
            let alibi = Tensor::<4>::from_data(TensorData::new(values, shape), (device, dtype));
            bias = Some(match bias {
                Some(bias) => add_broadcast(bias, alibi),
                None => alibi,
            });
        }
        (forbid, bias)
    }
}

impl ScoreMasks {
    /// The keys the rules hide in a block, as a `[batch | 1, 1, q_len, k_len]` tensor. Causal
    /// masking alone (the common case) is made on the device (`tril_mask`); the other rules are
    /// evaluated on the host for the block.
    fn rules_forbid(
        &self,
        batch: usize,
        queries: &std::ops::Range<usize>,
        keys: &std::ops::Range<usize>,
        device: &Device,
    ) -> Option<Tensor<4, Bool>> {
        let rules = &self.rules;
        let causal_only = rules.causal
            && rules.window.is_none()
            && rules.segments.is_none()
            && rules.pinned_keys == 0;
        if !causal_only {
            let (values, shape) = rules.block_forbid(batch, queries.clone(), keys.clone())?;
            return Some(Tensor::from_data(TensorData::new(values, shape), device));
        }
        // Key j (of the block) is hidden from query i when j > i + offset.
        let offset = rules.query_start - rules.key_start + queries.start as i64 - keys.start as i64;
        let positional = keys
            .end
            .min(rules.positional_keys)
            .saturating_sub(keys.start);
        let appended = keys.len() - positional;
        let mut parts = Vec::new();
        if positional > 0 {
            parts.push(Tensor::<2, Bool>::tril_mask(
                [queries.len(), positional],
                offset,
                device,
            ));
        }
        if appended > 0 {
            parts.push(Tensor::<2, Bool>::zeros([queries.len(), appended], device));
        }
        let mask = Tensor::cat(parts, 1);
        Some(mask.reshape([1, 1, queries.len(), keys.len()]))
    }
}

impl Visibility {
    /// No mask, no rule, no appended key.
    pub fn nothing_hidden() -> Self {
        Self {
            key_padding: None,
            attn_mask: None,
            causal: false,
            window: None,
            alibi: false,
            positions: Positions::default(),
            pinned_keys: 0,
            segments: None,
            extra_keys: 0,
        }
    }

    /// Whether a positional rule (causal masking, a window, segments) hides some query's keys
    /// by position, which makes rows shorter than `seq_k`.
    pub fn shortens_rows(&self) -> bool {
        self.causal || self.window.is_some() || self.segments.is_some()
    }

    /// Whether the caller's float mask is a tensor that needs a gradient.
    pub fn float_mask_requires_grad(&self) -> bool {
        matches!(
            self.attn_mask.as_ref().map(|mask| &mask.values),
            Some(MaskValues::Float(values)) if values.is_require_grad()
        )
    }

    /// Panics with the argument's name and expected shape if a mask does not fit `geometry`
    /// (whose `seq_k` counts the caller's keys).
    #[track_caller]
    pub fn check(&self, geometry: &Geometry) {
        if let Some(mask) = &self.key_padding {
            check_shape(
                "key_padding_mask",
                mask.dims(),
                [
                    ("batch", Some(geometry.batch)),
                    ("seq_k", Some(geometry.seq_k)),
                ],
            );
        }
        if let Some(mask) = &self.attn_mask {
            check_attn_mask(mask, geometry);
        }
        if let Some(segments) = &self.segments {
            check_shape(
                "segment_ids",
                segments.query.dims(),
                [
                    ("batch", Some(geometry.batch)),
                    ("seq_q", Some(geometry.seq_q)),
                ],
            );
            check_shape(
                "key segment_ids",
                segments.key.dims(),
                [
                    ("batch", Some(geometry.batch)),
                    ("seq_k", Some(geometry.seq_k)),
                ],
            );
        }
    }

    /// The masks for the kernels, over the caller's `geometry.seq_k` keys plus the appended
    /// ones; the float mask in `dtype`, the scores' float type. The shapes must have passed
    /// [`Visibility::check`].
    pub fn score_masks(
        &self,
        geometry: &Geometry,
        (device, dtype): (&Device, DType),
    ) -> ScoreMasks {
        let Geometry { batch, seq_k, .. } = *geometry;
        let mut forbid = self
            .key_padding
            .clone()
            .map(|mask| mask.reshape([batch, 1, 1, seq_k]));
        let mut bias = None;
        match self.attn_mask.clone().map(|mask| mask.values) {
            Some(MaskValues::Bool(mask)) => forbid = Some(or_broadcast(forbid, mask)),
            Some(MaskValues::Float(values)) => bias = Some(values.cast(dtype)),
            None => {}
        }
        if self.extra_keys > 0 {
            let extra = self.extra_keys;
            forbid = forbid.map(|mask| {
                let [b, h, q, _] = mask.dims();
                Tensor::cat(vec![mask, Tensor::zeros([b, h, q, extra], device)], 3)
            });
            bias = bias.map(|values| {
                let [b, h, q, _] = values.dims();
                let zeros = Tensor::zeros([b, h, q, extra], (device, dtype));
                Tensor::cat(vec![values, zeros], 3)
            });
        }
        ScoreMasks {
            forbid,
            bias,
            rules: self.rules(geometry),
        }
    }

    /// The rules that follow from positions.
    fn rules(&self, geometry: &Geometry) -> ScoreRules {
        let segments = self.segments.as_ref().map(|ids| {
            let read = |ids: &Tensor<2, Int>| {
                ids.to_data()
                    .convert::<i64>()
                    .try_into_vec::<i64>()
                    .expect("segment ids are integers")
            };
            Arc::new(Segments::new(
                read(&ids.query),
                read(&ids.key),
                geometry.seq_q,
                geometry.seq_k,
            ))
        });
        ScoreRules {
            query_start: self.positions.query,
            key_start: self.positions.key,
            pinned_keys: self.pinned_keys,
            positional_keys: geometry.seq_k,
            causal: self.causal,
            window: self.window,
            segments,
            alibi: self
                .alibi
                .then(|| alibi_slopes_f32(geometry.n_heads).into()),
        }
    }
}

/// Panics unless `mask` has one of the shapes `attn_mask` accepts for `geometry`.
#[track_caller]
fn check_attn_mask(mask: &AttnMask, geometry: &Geometry) {
    let [batch, heads, seq_q, seq_k] = mask.dims();
    let seq_axes = [
        ("seq_q", Some(geometry.seq_q)),
        ("seq_k", Some(geometry.seq_k)),
    ];
    let (expected, actual): (Vec<_>, Vec<_>) = match mask.rank {
        2 => (seq_axes.to_vec(), vec![seq_q, seq_k]),
        3 => (
            [vec![("batch", Some(geometry.batch))], seq_axes.to_vec()].concat(),
            vec![batch, seq_q, seq_k],
        ),
        _ => (
            [
                vec![
                    ("batch", Some(geometry.batch)),
                    ("n_heads", Some(geometry.n_heads)),
                ],
                seq_axes.to_vec(),
            ]
            .concat(),
            vec![batch, heads, seq_q, seq_k],
        ),
    };
    // A size-1 batch or head axis broadcasts (one mask for every batch element or head).
    let fits = expected
        .iter()
        .zip(&actual)
        .enumerate()
        .all(|(axis, ((_, size), &got))| {
            let broadcastable = axis + 2 < actual.len() && got == 1;
            *size == Some(got) || broadcastable
        });
    if !fits {
        panic!(
            "MultiHeadAttention: `attn_mask` must have shape {} (rank {}; a batch or head axis \
             of size 1 broadcasts), got {actual:?}",
            describe(&expected),
            mask.rank
        );
    }
}

/// A mask's `[.., .., queries, keys]` block, where an axis of size 1 (broadcast) is kept whole.
fn narrow_block<K: burn::tensor::kind::Basic>(
    tensor: &Tensor<4, K>,
    queries: &std::ops::Range<usize>,
    keys: &std::ops::Range<usize>,
) -> Tensor<4, K> {
    let narrow = |tensor: Tensor<4, K>, axis: usize, range: &std::ops::Range<usize>| {
        if tensor.dims()[axis] == 1 || (range.start == 0 && range.end == tensor.dims()[axis]) {
            tensor
        } else {
            tensor.narrow(axis, range.start, range.len())
        }
    };
    narrow(narrow(tensor.clone(), 2, queries), 3, keys)
}

/// `a | b` over the broadcast of their shapes (axes of size 1 stretch).
fn or_broadcast(a: Option<Tensor<4, Bool>>, b: Tensor<4, Bool>) -> Tensor<4, Bool> {
    let Some(a) = a else { return b };
    let dims = broadcast_dims(a.dims(), b.dims());
    a.expand(dims).bool_or(b.expand(dims))
}

/// `a + b` over the broadcast of their shapes.
fn add_broadcast(a: Tensor<4>, b: Tensor<4>) -> Tensor<4> {
    let dims = broadcast_dims(a.dims(), b.dims());
    a.expand(dims) + b.expand(dims)
}

fn broadcast_dims(a: [usize; 4], b: [usize; 4]) -> [usize; 4] {
    core::array::from_fn(|axis| a[axis].max(b[axis]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry(batch: usize, seq_q: usize, seq_k: usize) -> Geometry {
        Geometry {
            batch,
            n_heads: 1,
            n_kv_heads: 1,
            seq_q,
            seq_k,
            head_dim: 1,
            value_dim: 1,
        }
    }

    #[test]
    fn causal_mask_is_bottom_right_aligned() {
        let device = Device::flex();
        let square = causal_mask(3, 3, &device).into_data();
        square.assert_eq(
            &TensorData::from([
                [false, true, true],
                [false, false, true],
                [false, false, false],
            ]),
            false,
        );
        // Two new queries after three cached keys: the last query sees every key.
        let decode = causal_mask(2, 5, &device).into_data();
        decode.assert_eq(
            &TensorData::from([
                [false, false, false, false, true],
                [false, false, false, false, false],
            ]),
            false,
        );
    }

    #[test]
    fn padding_and_causal_masks_merge_and_extra_keys_stay_visible() {
        let device = Device::flex();
        let padding = Tensor::<2, Bool>::from_data([[false, true], [false, false]], &device);
        let visibility = Visibility {
            key_padding: Some(padding),
            causal: true,
            extra_keys: 1,
            ..Visibility::nothing_hidden()
        };
        let masks = visibility.score_masks(&geometry(2, 2, 2), (&device, DType::F32));
        let (forbid, _) = masks.block([2, 1], 0..2, 0..3, (&device, DType::F32));
        forbid.unwrap().expand([2, 1, 2, 3]).into_data().assert_eq(
            &TensorData::from([
                [[[false, true, false], [false, true, false]]],
                [[[false, true, false], [false, false, false]]],
            ]),
            false,
        );
    }

    #[test]
    fn a_window_hides_keys_that_far_before_the_query_in_absolute_positions() {
        let device = Device::flex();
        // Queries at 5 and 6 over keys at 3..7, window 2: each sees itself and one before.
        let visibility = Visibility {
            window: Some(2),
            causal: true,
            positions: Positions { query: 5, key: 3 },
            ..Visibility::nothing_hidden()
        };
        let masks = visibility.score_masks(&geometry(1, 2, 4), (&device, DType::F32));
        let (forbid, _) = masks.block([1, 1], 0..2, 0..4, (&device, DType::F32));
        forbid.unwrap().into_data().assert_eq(
            &TensorData::from([[[[true, false, false, true], [true, true, false, false]]]]),
            false,
        );
    }
}
