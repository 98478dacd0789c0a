//! What may attend to what. One [`Visibility`] per forward describes everything that removes
//! or biases a query-key pair — key padding, the caller's bool or float mask, causal masking, a
//! cache's sliding window, ALiBi — and is checked and turned into the form the kernels take
//! ([`ScoreMasks`]) here and nowhere else.

use burn::tensor::{Bool, DType, Device, Tensor, TensorData};

use crate::alibi::alibi_bias;
use crate::geometry::{Geometry, causal_offset};
use crate::input::{AttnMask, MaskValues};
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

/// Absolute positions of a forward's first query and first key: RoPE rotates by them, ALiBi
/// and a sliding window measure distances with them. A plain forward aligns the sequences at
/// their ends (queries at `seq_k - seq_q ..`, keys at `0 ..`), as the causal mask does; under a
/// cache they come from the cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Positions {
    pub query: usize,
    pub key: usize,
}

/// Everything that decides which key a query may attend to, and with what added to its score.
#[derive(Debug, Clone)]
pub(crate) struct Visibility {
    /// `[batch, seq_k]`, `true` = padding, ignored.
    pub key_padding: Option<Tensor<2, Bool>>,
    /// The caller's bool (`true` = may not attend) or float (added) mask.
    pub attn_mask: Option<AttnMask>,
    /// Bottom-right causal masking.
    pub causal: bool,
    /// A key `window` or more positions before the query is hidden (a cache's sliding window).
    pub window: Option<usize>,
    /// ALiBi's per-head distance penalty.
    pub alibi: bool,
    pub positions: Positions,
    /// Key positions the module appends after the caller's (`add_bias_kv`, `add_zero_attn`):
    /// never masked, never biased, as PyTorch pads its masks with "attend" columns for them.
    pub extra_keys: usize,
}

/// Masks in the form the kernels take, each broadcastable to
/// `[batch, n_heads, seq_q, seq_k + extra_keys]`.
#[derive(Debug, Clone, Default)]
pub(crate) struct ScoreMasks {
    /// `true` = the pair may not attend.
    pub forbid: Option<Tensor<4, Bool>>,
    /// Added to the scaled scores.
    pub bias: Option<Tensor<4>>,
    /// Apply the bottom-right causal mask over all keys (set only when no keys were appended,
    /// else the causal part is already in `forbid`).
    pub causal: bool,
}

impl Visibility {
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
    }

    /// The masks for the kernels, over the caller's `geometry.seq_k` keys plus the appended
    /// ones; the bias in `dtype`, the scores' float type. The shapes must have passed
    /// [`Visibility::check`].
    pub fn score_masks(
        &self,
        geometry: &Geometry,
        (device, dtype): (&Device, DType),
    ) -> ScoreMasks {
        let Geometry {
            batch,
            seq_q,
            seq_k,
            ..
        } = *geometry;
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
        if let Some(window) = self.window {
            forbid = Some(or_broadcast(
                forbid,
                self.window_mask(window, seq_q, seq_k, device),
            ));
        }
        if self.alibi {
            let alibi = alibi_bias(
                geometry.n_heads,
                self.positions,
                seq_q,
                seq_k,
                (device, dtype),
            );
            bias = Some(match bias {
                Some(values) => add_broadcast(values, alibi),
                None => alibi,
            });
        }
        let causal_in_kernel = self.causal && self.extra_keys == 0;
        if self.causal && !causal_in_kernel {
            let future = causal_mask(seq_q, seq_k, device).reshape([1, 1, seq_q, seq_k]);
            forbid = Some(or_broadcast(forbid, future));
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
            causal: causal_in_kernel,
        }
    }

    /// `[1, 1, seq_q, seq_k]`: `true` where the key lies `window` or more positions before the
    /// query.
    fn window_mask(
        &self,
        window: usize,
        seq_q: usize,
        seq_k: usize,
        device: &Device,
    ) -> Tensor<4, Bool> {
        let Positions { query, key } = self.positions;
        let values: Vec<bool> = (0..seq_q)
            .flat_map(|q| (0..seq_k).map(move |k| key + k + window <= query + q))
            .collect();
        Tensor::<2, Bool>::from_data(TensorData::new(values, [seq_q, seq_k]), device)
            .reshape([1, 1, seq_q, seq_k])
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

    fn nothing_hidden() -> Visibility {
        Visibility {
            key_padding: None,
            attn_mask: None,
            causal: false,
            window: None,
            alibi: false,
            positions: Positions::default(),
            extra_keys: 0,
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
    fn padding_attn_and_causal_masks_merge_and_extra_keys_stay_visible() {
        let device = Device::flex();
        let padding = Tensor::<2, Bool>::from_data([[false, true], [false, false]], &device);
        let visibility = Visibility {
            key_padding: Some(padding),
            causal: true,
            extra_keys: 1,
            ..nothing_hidden()
        };
        let masks = visibility.score_masks(&geometry(2, 2, 2), (&device, DType::F32));
        assert!(
            !masks.causal,
            "causal goes into the bool mask when keys are appended"
        );
        masks.forbid.unwrap().into_data().assert_eq(
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
            positions: Positions { query: 5, key: 3 },
            ..nothing_hidden()
        };
        let masks = visibility.score_masks(&geometry(1, 2, 4), (&device, DType::F32));
        masks.forbid.unwrap().into_data().assert_eq(
            &TensorData::from([[[[true, false, false, false], [true, true, false, false]]]]),
            false,
        );
    }
}
