//! Turning the caller's masks (key padding, bool or float attention mask, causal flag) into
//! the one bool mask and one additive bias that the attention kernels take.

use burn::tensor::{Bool, Device, Tensor};

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
    Tensor::<2, Bool>::tril_mask([seq_q, seq_k], seq_k as i64 - seq_q as i64, device)
}

/// The sizes the masks are checked against and built for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MaskGeometry {
    pub batch: usize,
    pub n_heads: usize,
    pub seq_q: usize,
    /// Keys the caller passed.
    pub seq_k: usize,
    /// Key positions the module appends (`add_bias_kv`, `add_zero_attn`); never masked.
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

/// Panics with the argument's name and expected shape if a mask does not fit `geometry`.
#[track_caller]
pub(crate) fn check_masks(
    key_padding_mask: Option<&Tensor<2, Bool>>,
    attn_mask: Option<&AttnMask>,
    geometry: MaskGeometry,
) {
    if let Some(mask) = key_padding_mask {
        check_shape(
            "key_padding_mask",
            mask.dims(),
            [
                ("batch", Some(geometry.batch)),
                ("seq_k", Some(geometry.seq_k)),
            ],
        );
    }
    if let Some(mask) = attn_mask {
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
                "MultiHeadAttention: `attn_mask` must have shape {} (rank {}; a batch or head \
                 axis of size 1 broadcasts), got {actual:?}",
                describe(&expected),
                mask.rank
            );
        }
    }
}

/// Combines the caller's masks into [`ScoreMasks`]. The shapes must have passed
/// [`check_masks`].
///
/// `extra_forbid` and `extra_bias` (`[1 | batch, 1 | n_heads, seq_q, seq_k]`) are the module's
/// own: a sliding window's band, ALiBi's distance penalty.
pub(crate) fn build_masks(
    key_padding_mask: Option<Tensor<2, Bool>>,
    attn_mask: Option<AttnMask>,
    causal: bool,
    geometry: MaskGeometry,
    extra_forbid: Option<Tensor<4, Bool>>,
    extra_bias: Option<Tensor<4>>,
    device: &Device,
) -> ScoreMasks {
    let MaskGeometry {
        batch,
        seq_q,
        seq_k,
        extra_keys,
        ..
    } = geometry;
    let mut forbid = key_padding_mask.map(|mask| mask.reshape([batch, 1, 1, seq_k]));
    let mut bias = None;
    match attn_mask.map(|mask| mask.values) {
        Some(MaskValues::Bool(mask)) => forbid = Some(or_broadcast(forbid, mask)),
        Some(MaskValues::Float(values)) => bias = Some(values),
        None => {}
    }
    if let Some(extra) = extra_forbid {
        forbid = Some(or_broadcast(forbid, extra));
    }
    if let Some(extra) = extra_bias {
        bias = Some(match bias {
            Some(values) => add_broadcast(values, extra),
            None => extra,
        });
    }
    let causal_in_kernel = causal && extra_keys == 0;
    if causal && !causal_in_kernel {
        let future = causal_mask(seq_q, seq_k, device).reshape([1, 1, seq_q, seq_k]);
        forbid = Some(or_broadcast(forbid, future));
    }
    if extra_keys > 0 {
        // The appended key positions are visible to every query, as PyTorch pads its masks
        // with "attend" columns for them.
        forbid = forbid.map(|mask| {
            let [b, h, q, _] = mask.dims();
            let visible = Tensor::<4, Bool>::zeros([b, h, q, extra_keys], device);
            Tensor::cat(vec![mask, visible], 3)
        });
        bias = bias.map(|values| {
            let [b, h, q, _] = values.dims();
            let zeros = Tensor::<4>::zeros([b, h, q, extra_keys], device);
            Tensor::cat(vec![values, zeros], 3)
        });
    }
    ScoreMasks {
        forbid,
        bias,
        causal: causal_in_kernel,
    }
}

/// `a | b` over the broadcast of their shapes (axes of size 1 stretch).
fn or_broadcast(a: Option<Tensor<4, Bool>>, b: Tensor<4, Bool>) -> Tensor<4, Bool> {
    let Some(a) = a else { return b };
    let (a_dims, b_dims) = (a.dims(), b.dims());
    let dims: [usize; 4] = core::array::from_fn(|axis| a_dims[axis].max(b_dims[axis]));
    a.expand(dims).bool_or(b.expand(dims))
}

/// `a + b` over the broadcast of their shapes.
fn add_broadcast(a: Tensor<4>, b: Tensor<4>) -> Tensor<4> {
    let (a_dims, b_dims) = (a.dims(), b.dims());
    let dims: [usize; 4] = core::array::from_fn(|axis| a_dims[axis].max(b_dims[axis]));
    a.expand(dims) + b.expand(dims)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

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
        let geometry = MaskGeometry {
            batch: 2,
            n_heads: 1,
            seq_q: 2,
            seq_k: 2,
            extra_keys: 1,
        };
        let padding = Tensor::<2, Bool>::from_data([[false, true], [false, false]], &device);
        let masks = build_masks(Some(padding), None, true, geometry, None, None, &device);
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
}
