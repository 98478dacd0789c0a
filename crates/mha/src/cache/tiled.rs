//! A compressed [`KvCache`](super::KvCache)'s buffers in tiles of [`TILE`] positions, laid out
//! as a paged pool's blocks, so that the in-place decoding kernel reads each tile's keys and
//! values as one run of memory.
//!
//! Why: in one buffer per head with the positions along the last axis, a tile's keys lay in
//! `head_dim` rows a whole capacity apart; a step read them at about 60% of the bandwidth it
//! reaches on contiguous tiles (f16 and int8 caches of 8 key/value heads, `decoding` bench, AMD
//! Zen 5: slower than an f32 cache, which reads twice and four times the bytes).
//!
//! Tile `t` of batch element `b` is block `t · batch + b` of a `[tiles · batch, heads, ..]`
//! tensor: tile-major, so that a step's new positions of every batch element lie in one range
//! of blocks, and growing the buffer adds blocks at the end.

use burn::tensor::Tensor;
use burn::tensor::kind::Basic;

use crate::cpu::aligned::with_zeros_after;

/// Positions per tile: the paged kernel's largest tile (`paged::cpu::plan`), so that each of
/// its tiles is one block.
pub(crate) const TILE: usize = 64;

/// How a tile lays out its positions and features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Within {
    /// `[TILE, dim]`: each position's features side by side (values, and their scales).
    PositionMajor,
    /// `[dim, TILE]`: each feature's positions side by side (keys, and their scales), as the
    /// kernel reads them (16 positions of a feature per vector).
    FeatureMajor,
}

impl Within {
    /// The axis of a tile's positions in a tiled buffer.
    fn axis(self) -> usize {
        match self {
            Self::PositionMajor => 2,
            Self::FeatureMajor => 3,
        }
    }

    /// `[.., positions, dim]` moved to and from this layout (either way the transpose of the
    /// last two axes for feature-major).
    fn arranged<K: Basic>(self, tensor: Tensor<4, K>) -> Tensor<4, K> {
        match self {
            Self::PositionMajor => tensor,
            Self::FeatureMajor => tensor.swap_dims(2, 3),
        }
    }
}

/// The tiles needed for `positions` positions.
pub(crate) fn tiles_for(positions: usize) -> usize {
    positions.div_ceil(TILE)
}

/// `positions` (`[batch, heads, n, dim]`) in `tiles` tiles (at least `n`'s), the positions past
/// `n` zero.
pub(crate) fn tiled<K: Basic>(
    positions: Tensor<4, K>,
    within: Within,
    tiles: usize,
) -> Tensor<4, K> {
    let [batch, heads, count, dim] = positions.dims();
    assert!(
        count <= tiles * TILE,
        "tiled: {count} positions do not fit {tiles} tiles"
    );
    let padded = if count < tiles * TILE {
        let zeros = Tensor::zeros(
            [batch, heads, tiles * TILE - count, dim],
            (&positions.device(), positions.dtype()),
        );
        Tensor::cat(vec![positions, zeros], 2)
    } else {
        positions
    };
    let blocks = padded
        .reshape([batch, heads, tiles, TILE, dim])
        .permute([2, 0, 1, 3, 4])
        .reshape([tiles * batch, heads, TILE, dim]);
    // The reshape of the permuted view above, and this one of the transposed view, copy it into
    // the layout's memory: the kernel reads buffers as they lie.
    match within {
        Within::PositionMajor => blocks,
        Within::FeatureMajor => blocks
            .swap_dims(2, 3)
            .reshape([tiles * batch, heads, dim, TILE]),
    }
}

/// The first `len` positions of `buffer` (tiles of `batch` elements) as `[batch, heads, len,
/// dim]`.
pub(crate) fn untiled<K: Basic>(
    buffer: &Tensor<4, K>,
    within: Within,
    batch: usize,
    len: usize,
) -> Tensor<4, K> {
    let tiles = tiles_for(len);
    let blocks = within.arranged(buffer.clone().narrow(0, 0, tiles * batch));
    let [_, heads, _, dim] = blocks.dims();
    blocks
        .reshape([tiles, batch, heads, TILE, dim])
        .permute([1, 2, 0, 3, 4])
        .reshape([batch, heads, tiles * TILE, dim])
        .narrow(2, 0, len)
}

/// `buffer` (tiles of `batch` elements) with `new` (`[batch, heads, n, dim]`) written at
/// positions `at..at + n`, in place where flex holds the buffer once: one assignment for the
/// rest of a partly filled first tile, one for the whole tiles after it, one for a partly filled
/// last tile.
///
/// # Panics
///
/// If the positions do not fit the buffer's tiles.
pub(crate) fn written<K: Basic>(
    mut buffer: Tensor<4, K>,
    within: Within,
    batch: usize,
    at: usize,
    new: Tensor<4, K>,
) -> Tensor<4, K> {
    let count = new.dims()[2];
    let capacity = buffer.dims()[0] / batch * TILE;
    assert!(
        at + count <= capacity,
        "tiled: positions {at}..{} past the buffer's {capacity}",
        at + count
    );
    let mut done = 0;
    while done < count {
        let position = at + done;
        let (tile, offset) = (position / TILE, position % TILE);
        let left = count - done;
        let part = |len: usize| {
            if len == count {
                new.clone()
            } else {
                new.clone().narrow(2, done, len)
            }
        };
        if offset == 0 && left >= TILE {
            // Whole tiles at once.
            let tiles = left / TILE;
            let blocks = tiled(part(tiles * TILE), within, tiles);
            let mut ranges = buffer.dims().map(|size| 0..size);
            ranges[0] = tile * batch..(tile + tiles) * batch;
            buffer = buffer.slice_assign(ranges, blocks);
            done += tiles * TILE;
        } else {
            let len = (TILE - offset).min(left);
            let mut ranges = buffer.dims().map(|size| 0..size);
            ranges[0] = tile * batch..(tile + 1) * batch;
            ranges[within.axis()] = offset..offset + len;
            buffer = buffer.slice_assign(ranges, within.arranged(part(len)));
            done += len;
        }
    }
    buffer
}

/// `buffer` (tiles of `batch` elements) grown to `tiles` tiles, the new ones zero.
pub(crate) fn grown<K: Basic>(buffer: Tensor<4, K>, batch: usize, tiles: usize) -> Tensor<4, K> {
    let blocks = buffer.dims()[0];
    let extra = (tiles * batch).saturating_sub(blocks);
    if extra == 0 {
        return buffer;
    }
    with_zeros_after(buffer, 0, extra)
}

// The tests run on flex.
#[cfg(all(test, feature = "flex"))]
mod tests {
    use burn::tensor::{Device, Distribution, Int, Tensor};

    use super::*;
    use crate::cpu::aligned::starts_on_a_line;

    fn positions(shape: [usize; 4], device: &Device) -> Tensor<4> {
        Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
    }

    fn assert_equal<K: Basic>(actual: Tensor<4, K>, expected: Tensor<4, K>) {
        assert_eq!(actual.dims(), expected.dims());
        actual.into_data().assert_eq(&expected.into_data(), true);
    }

    #[test]
    fn tiles_hold_each_position_where_the_kernel_reads_it() {
        let device = Device::flex();
        let (batch, heads, dim) = (3, 2, 5);
        let source = positions([batch, heads, 100, dim], &device);
        let data = source.to_data().as_slice::<f32>().unwrap().to_vec();
        let keys = tiled(source.clone(), Within::FeatureMajor, 2);
        let values = tiled(source, Within::PositionMajor, 2);
        assert_eq!(keys.dims(), [2 * batch, heads, dim, TILE]);
        assert_eq!(values.dims(), [2 * batch, heads, TILE, dim]);
        let (keys, values) = (
            keys.into_data().as_slice::<f32>().unwrap().to_vec(),
            values.into_data().as_slice::<f32>().unwrap().to_vec(),
        );
        for (element, head, position, feature) in every_index(batch, heads, 2 * TILE, dim) {
            let block = (position / TILE) * batch + element;
            let lane = position % TILE;
            let expected = if position < 100 {
                data[((element * heads + head) * 100 + position) * dim + feature]
            } else {
                0.0
            };
            let key = keys[((block * heads + head) * dim + feature) * TILE + lane];
            let value = values[((block * heads + head) * TILE + lane) * dim + feature];
            assert_eq!(
                (key, value),
                (expected, expected),
                "{element} {head} {position}"
            );
        }
    }

    /// Every `(element, head, position, feature)` of the given sizes.
    fn every_index(
        batch: usize,
        heads: usize,
        positions: usize,
        dim: usize,
    ) -> impl Iterator<Item = (usize, usize, usize, usize)> {
        (0..batch).flat_map(move |element| {
            (0..heads).flat_map(move |head| {
                (0..positions)
                    .flat_map(move |position| (0..dim).map(move |f| (element, head, position, f)))
            })
        })
    }

    #[test]
    fn writes_across_tiles_then_read_back_give_the_positions_in_order() {
        let device = Device::flex();
        let (batch, heads, dim) = (2, 3, 4);
        for within in [Within::PositionMajor, Within::FeatureMajor] {
            // Runs that start and end inside tiles, fill a tile exactly, span whole tiles.
            for lengths in [
                vec![1, 1, 62, 1, 130, 3],
                vec![64, 64, 1],
                vec![200],
                vec![5, 250],
            ] {
                let total: usize = lengths.iter().sum();
                let source = positions([batch, heads, total, dim], &device);
                let first = lengths[0];
                let mut buffer =
                    tiled(source.clone().narrow(2, 0, first), within, tiles_for(first));
                let mut at = first;
                assert_equal(
                    untiled(&buffer, within, batch, at),
                    source.clone().narrow(2, 0, at),
                );
                for len in lengths[1..].iter().copied() {
                    buffer = grown(buffer, batch, tiles_for(at + len));
                    buffer = written(buffer, within, batch, at, source.clone().narrow(2, at, len));
                    at += len;
                    assert_equal(
                        untiled(&buffer, within, batch, at),
                        source.clone().narrow(2, 0, at),
                    );
                }
            }
        }
    }

    #[test]
    fn int8_tiles_round_trip() {
        let device = Device::flex();
        let source = Tensor::<1, Int>::arange(0..120, &device)
            .reshape([2, 3, 20, 1])
            .cast(burn::tensor::IntDType::I8);
        let buffer = tiled(source.clone(), Within::FeatureMajor, 1);
        assert_eq!(buffer.dims(), [2, 3, 1, TILE]);
        assert_equal(untiled(&buffer, Within::FeatureMajor, 2, 20), source);
    }

    #[test]
    fn grown_buffers_start_on_a_cache_line() {
        let device = Device::flex();
        let floats = tiled(positions([2, 8, 64, 64], &device), Within::FeatureMajor, 1);
        let halves = floats.clone().cast(burn::tensor::FloatDType::F16);
        let int8 = Tensor::<4, Int>::ones([2, 8, 64, 64], &device).cast(burn::tensor::IntDType::I8);
        let grown_floats = grown(floats.clone(), 2, 3);
        assert_equal(grown_floats.clone().narrow(0, 0, 2), floats);
        assert!(starts_on_a_line(grown_floats));
        assert!(starts_on_a_line(grown(halves, 2, 3)));
        assert!(starts_on_a_line(grown(int8, 2, 3)));
    }

    #[test]
    #[should_panic(expected = "past the buffer's 64")]
    fn a_write_past_the_tiles_is_refused() {
        let device = Device::flex();
        let buffer = tiled(positions([1, 1, 10, 2], &device), Within::PositionMajor, 1);
        written(
            buffer,
            Within::PositionMajor,
            1,
            60,
            positions([1, 1, 5, 2], &device),
        );
    }
}
