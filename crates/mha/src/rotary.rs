//! Rotary position embeddings (RoPE, Su et al. 2021) applied to query and key heads, with the
//! position scalings of long-context models, and the cos/sin table computed once per length.
//! On flex and ndarray (f32) the rotation is one native op (`cpu/rotary.rs`, with or without
//! autodiff); elsewhere it is tensor ops, which the native op's tests hold it to.

use std::sync::{Arc, Mutex};

use burn::config::Config;
use burn::tensor::{DType, Device, Int, Tensor, TensorData};

use crate::cpu::native_rotation;

/// Which features of a head form the rotated pairs.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Adjacent features `(x[2i], x[2i+1])`: RoFormer, GPT-J, Meta's LLaMA code and Burn's
    /// `RotaryEncoding`.
    Interleaved,
    /// The two halves `(x[i], x[i + d/2])`: GPT-NeoX and Hugging Face's Llama (`rotate_half`).
    /// Weights from a Hugging Face checkpoint use this layout.
    HalfSplit,
}

/// How positions are stretched for contexts longer than a model was trained on.
#[derive(Config, Debug, Copy, PartialEq)]
pub enum RopeScaling {
    /// Position interpolation (Chen et al. 2023): every frequency divided by `factor`, as if
    /// positions were `factor` times closer (Hugging Face's `rope_type: "linear"`).
    Linear {
        /// Greater than 1 stretches.
        factor: f64,
    },
    /// Llama 3.1's frequency-dependent scaling (Meta's `apply_scaling`, Hugging Face's
    /// `rope_type: "llama3"`): wavelengths longer than `original_max_position /
    /// low_freq_factor` are divided by `factor`, those shorter than `original_max_position /
    /// high_freq_factor` kept, the ones between interpolated.
    Llama3 {
        /// Stretch of the low frequencies (8 in Llama 3.1).
        factor: f64,
        /// 1 in Llama 3.1.
        low_freq_factor: f64,
        /// 4 in Llama 3.1.
        high_freq_factor: f64,
        /// The context the model was trained on (8192 in Llama 3.1).
        original_max_position: usize,
    },
}

/// Rotary position embeddings for [`MultiHeadAttentionConfig::rope`](crate::MultiHeadAttentionConfig::rope).
///
/// Pair `i` of a head at position `p` is rotated by the angle `p · f_i`, `f_i =
/// theta^(-2i / head_dim)` (scaled by [`RopeScaling`] if any), in queries and keys alike,
/// after projection and before the scores; the score of a query at `m` and a key at `n` then
/// depends on their positions only through `m - n`.
#[derive(Config, Debug, PartialEq)]
pub struct RopeConfig {
    /// Base of the rotation frequencies. Must be finite and greater than 1. Default: 10000.
    #[config(default = 10000.0)]
    pub theta: f64,
    /// The pair layout. Default: [`RopeLayout::Interleaved`].
    #[config(default = "RopeLayout::Interleaved")]
    pub layout: RopeLayout,
    /// Position scaling for long contexts. Default: `None`.
    #[config(default = "None")]
    pub scaling: Option<RopeScaling>,
}

impl RopeConfig {
    /// Checks the fields; the reason names the one that is wrong.
    pub fn validate(&self) -> Result<(), String> {
        if !self.theta.is_finite() || self.theta <= 1.0 {
            return Err(format!(
                "theta must be finite and greater than 1, got {}",
                self.theta
            ));
        }
        let positive = |name: &str, value: f64| {
            if value.is_finite() && value > 0.0 {
                Ok(())
            } else {
                Err(format!(
                    "scaling {name} must be finite and positive, got {value}"
                ))
            }
        };
        match self.scaling {
            None => Ok(()),
            Some(RopeScaling::Linear { factor }) => positive("factor", factor),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            }) => {
                positive("factor", factor)?;
                positive("low_freq_factor", low_freq_factor)?;
                positive("high_freq_factor", high_freq_factor)?;
                if high_freq_factor <= low_freq_factor {
                    return Err(format!(
                        "scaling high_freq_factor ({high_freq_factor}) must exceed \
                         low_freq_factor ({low_freq_factor})"
                    ));
                }
                positive("original_max_position", original_max_position as f64)
            }
        }
    }

    /// The rotation frequency of every pair of a head of `head_dim` features, scaled.
    pub fn frequencies(&self, head_dim: usize) -> Vec<f64> {
        let base: Vec<f64> = (0..head_dim / 2)
            .map(|pair| self.theta.powf(-2.0 * pair as f64 / head_dim as f64))
            .collect();
        match self.scaling {
            None => base,
            Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / factor).collect(),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            }) => {
                let context = original_max_position as f64;
                let (low_wavelength, high_wavelength) =
                    (context / low_freq_factor, context / high_freq_factor);
                base.iter()
                    .map(|&frequency| {
                        let wavelength = 2.0 * std::f64::consts::PI / frequency;
                        if wavelength < high_wavelength {
                            frequency
                        } else if wavelength > low_wavelength {
                            frequency / factor
                        } else {
                            let smooth = (context / wavelength - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * frequency / factor + smooth * frequency
                        }
                    })
                    .collect()
            }
        }
    }
}

/// Positions the cos/sin table covers at most: 32 MiB at a head width of 128 in f32. Angles
/// past it are computed for the positions a call needs, so that a stream decoded for millions
/// of tokens (under a sliding or streaming window, whose cache stays small) does not grow the
/// table with its absolute position.
const TABLE_POSITIONS: usize = 1 << 16;

/// A [`RopeConfig`] in use: the configuration and its cos/sin table, computed once per device,
/// float type and length (grown by doubling, up to `table_positions`) instead of at every call.
#[derive(Debug, Clone)]
pub(crate) struct Rope {
    pub config: RopeConfig,
    table: Arc<Mutex<Option<Table>>>,
    /// The native op's table: f32 on the host.
    host_table: Arc<Mutex<Option<HostTable>>>,
    /// [`TABLE_POSITIONS`], or fewer where a test sets it.
    table_positions: usize,
}

/// `cos` and `sin` of positions `0..len`, `[len, head_dim / 2]` each.
#[derive(Debug)]
struct Table {
    device: Device,
    dtype: DType,
    head_dim: usize,
    len: usize,
    cos: Tensor<2>,
    sin: Tensor<2>,
}

impl Rope {
    pub fn new(config: RopeConfig) -> Self {
        Self::with_table_positions(config, TABLE_POSITIONS)
    }

    /// A `Rope` whose table covers at most `positions` positions (the tests' seam).
    fn with_table_positions(config: RopeConfig, positions: usize) -> Self {
        Self {
            config,
            table: Arc::new(Mutex::new(None)),
            host_table: Arc::new(Mutex::new(None)),
            table_positions: positions,
        }
    }

    /// `cos` and `sin` for positions `start..start + seq`, `[seq, head_dim / 2]` each.
    fn angles(
        &self,
        head_dim: usize,
        start: usize,
        seq: usize,
        device: &Device,
        dtype: DType,
    ) -> (Tensor<2>, Tensor<2>) {
        if start + seq > self.table_positions {
            let positions: Vec<usize> = (start..start + seq).collect();
            return angles_at(&self.config, head_dim, &positions, device, dtype);
        }
        let mut table = self
            .table
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let fits = table.as_ref().is_some_and(|table| {
            table.device == *device
                && table.dtype == dtype
                && table.head_dim == head_dim
                && table.len >= start + seq
        });
        if !fits {
            let len = self.table_len(start + seq);
            *table = Some(Table::new(&self.config, head_dim, len, device, dtype));
        }
        let table = table.as_ref().expect("made above");
        (
            table.cos.clone().narrow(0, start, seq),
            table.sin.clone().narrow(0, start, seq),
        )
    }

    /// Rotates `x` (`[batch, heads, seq, head_dim]`) whose first position is `start`.
    ///
    /// # Panics
    ///
    /// Panics if `head_dim` is odd (the configuration refuses that earlier).
    pub fn apply(&self, x: Tensor<4>, start: usize) -> Tensor<4> {
        let [_, _, seq, head_dim] = x.dims();
        assert!(
            head_dim.is_multiple_of(2),
            "RoPE needs an even head_dim, got {head_dim}"
        );
        native_rotation(&x, || {
            self.rotation(head_dim, (start..start + seq).collect())
        })
        .unwrap_or_else(|| self.apply_with_tensor_ops(x, start))
    }

    /// [`Rope::apply`] through tensor ops: every backend's body, and on flex and ndarray what
    /// the native op is held to.
    fn apply_with_tensor_ops(&self, x: Tensor<4>, start: usize) -> Tensor<4> {
        let [_, _, seq, head_dim] = x.dims();
        let (cos, sin) = self.angles(head_dim, start, seq, &x.device(), x.dtype());
        self.rotate(x, cos, sin)
    }

    /// Rotates `x` (`[batch, heads, seq, head_dim]`) whose position `i` along `seq` is
    /// `positions[i]`: the rows of a ragged batch, each at its own sequence's position.
    ///
    /// # Panics
    ///
    /// Panics if `head_dim` is odd or `positions` does not have one entry per row.
    pub fn apply_at(&self, x: Tensor<4>, positions: &[usize]) -> Tensor<4> {
        let [_, _, seq, head_dim] = x.dims();
        assert!(
            head_dim.is_multiple_of(2) && positions.len() == seq,
            "RoPE needs an even head_dim and one position per row, got head_dim {head_dim}, {} \
             positions for {seq} rows",
            positions.len()
        );
        native_rotation(&x, || self.rotation(head_dim, positions.to_vec()))
            .unwrap_or_else(|| self.apply_at_with_tensor_ops(x, positions))
    }

    /// [`Rope::apply_at`] through tensor ops, as [`Rope::apply_with_tensor_ops`].
    fn apply_at_with_tensor_ops(&self, x: Tensor<4>, positions: &[usize]) -> Tensor<4> {
        let [_, _, seq, head_dim] = x.dims();
        let device = x.device();
        let end = positions.iter().max().map_or(0, |&last| last + 1);
        if end > self.table_positions {
            let (cos, sin) = angles_at(&self.config, head_dim, positions, &device, x.dtype());
            return self.rotate(x, cos, sin);
        }
        let (cos, sin) = self.angles(head_dim, 0, end, &device, x.dtype());
        let indices = Tensor::<1, Int>::from_data(
            TensorData::new(
                positions.iter().map(|&p| p as i64).collect::<Vec<_>>(),
                [seq],
            ),
            &device,
        );
        let (cos, sin) = (cos.select(0, indices.clone()), sin.select(0, indices));
        self.rotate(x, cos, sin)
    }

    /// The positions a table grown to cover `0..end` holds: a power of two, at least 64, at most
    /// the table's bound (both bodies' tables grow alike).
    fn table_len(&self, end: usize) -> usize {
        end.next_power_of_two().max(64).min(self.table_positions)
    }

    /// The native op's [`Rotation`] of rows at `positions`: rows of the host table where it
    /// covers them (grown as [`Rope::angles`] grows its table), else angles of exactly these
    /// positions.
    fn rotation(&self, head_dim: usize, positions: Vec<usize>) -> Rotation {
        let end = positions.iter().max().map_or(0, |&last| last + 1);
        let layout = self.config.layout;
        if end > self.table_positions {
            let (cos, sin) = host_angles(&self.config, head_dim, &positions);
            return Rotation {
                cos,
                sin,
                rows: (0..positions.len()).collect(),
                layout,
                inverse: false,
            };
        }
        let mut table = self
            .host_table
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let fits = table
            .as_ref()
            .is_some_and(|table| table.head_dim == head_dim && table.len >= end);
        if !fits {
            let len = self.table_len(end);
            let (cos, sin) = host_angles(&self.config, head_dim, &(0..len).collect::<Vec<_>>());
            *table = Some(HostTable {
                head_dim,
                len,
                cos,
                sin,
            });
        }
        let table = table.as_ref().expect("made above");
        Rotation {
            cos: table.cos.clone(),
            sin: table.sin.clone(),
            rows: positions.into(),
            layout,
            inverse: false,
        }
    }

    /// `x` rotated by the angles whose `cos` and `sin` are given per row (`[seq, head_dim / 2]`).
    fn rotate(&self, x: Tensor<4>, cos: Tensor<2>, sin: Tensor<2>) -> Tensor<4> {
        let [batch, heads, seq, head_dim] = x.dims();
        let half = head_dim / 2;
        let cos = cos.reshape([1, 1, seq, half]);
        let sin = sin.reshape([1, 1, seq, half]);
        match self.config.layout {
            RopeLayout::Interleaved => {
                let pairs = x.reshape([batch, heads, seq, half, 2]);
                let even = pairs
                    .clone()
                    .narrow(4, 0, 1)
                    .reshape([batch, heads, seq, half]);
                let odd = pairs.narrow(4, 1, 1).reshape([batch, heads, seq, half]);
                let rotated_even = even.clone() * cos.clone() - odd.clone() * sin.clone();
                let rotated_odd = odd * cos + even * sin;
                Tensor::stack::<5>(vec![rotated_even, rotated_odd], 4)
                    .reshape([batch, heads, seq, head_dim])
            }
            RopeLayout::HalfSplit => {
                let first = x.clone().narrow(3, 0, half);
                let second = x.narrow(3, half, half);
                let rotated_first = first.clone() * cos.clone() - second.clone() * sin.clone();
                let rotated_second = second * cos + first * sin;
                Tensor::cat(vec![rotated_first, rotated_second], 3)
            }
        }
    }
}

impl Table {
    fn new(
        config: &RopeConfig,
        head_dim: usize,
        len: usize,
        device: &Device,
        dtype: DType,
    ) -> Self {
        let positions: Vec<usize> = (0..len).collect();
        let (cos, sin) = angles_at(config, head_dim, &positions, device, dtype);
        Self {
            device: device.clone(),
            dtype,
            head_dim,
            len,
            cos,
            sin,
        }
    }
}

/// `cos` and `sin` of positions `0..len` in f32 on the host, `[len, head_dim / 2]` each: the
/// native op's table.
#[derive(Debug)]
struct HostTable {
    head_dim: usize,
    len: usize,
    cos: Arc<[f32]>,
    sin: Arc<[f32]>,
}

/// The angles of a rotation: row `r` of every head turns by row `rows[r]` of the tables.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Rotation {
    /// `[table rows, head_dim / 2]`: each pair's `cos`.
    pub cos: Arc<[f32]>,
    /// `[table rows, head_dim / 2]`: each pair's `sin`.
    pub sin: Arc<[f32]>,
    /// The table row of each row of the rotated heads.
    pub rows: Arc<[usize]>,
    /// Which features form the pairs.
    pub layout: RopeLayout,
    /// Turns the other way (by `-angle`): the backward of a rotation.
    pub inverse: bool,
}

impl Rotation {
    /// The rotation by the opposite angles.
    #[cfg_attr(not(any(feature = "flex", feature = "ndarray")), allow(dead_code))]
    pub fn inverted(self) -> Self {
        Self {
            inverse: !self.inverse,
            ..self
        }
    }
}

/// [`angles_at`]'s values in f32 on the host.
fn host_angles(
    config: &RopeConfig,
    head_dim: usize,
    positions: &[usize],
) -> (Arc<[f32]>, Arc<[f32]>) {
    let angles = angles(config, head_dim, positions);
    (
        angles.iter().map(|angle| angle.cos() as f32).collect(),
        angles.iter().map(|angle| angle.sin() as f32).collect(),
    )
}

/// The angle of every pair of features at each of `positions`, `[positions, head_dim / 2]`, in
/// f64.
fn angles(config: &RopeConfig, head_dim: usize, positions: &[usize]) -> Vec<f64> {
    let frequencies = config.frequencies(head_dim);
    positions
        .iter()
        .flat_map(|&position| {
            frequencies
                .iter()
                .map(move |frequency| position as f64 * frequency)
        })
        .collect()
}

/// `cos` and `sin` of `positions`, `[positions, head_dim / 2]` each: the angles in f64, then in
/// `dtype`, the same values whether a table holds them or a call computes them.
fn angles_at(
    config: &RopeConfig,
    head_dim: usize,
    positions: &[usize],
    device: &Device,
    dtype: DType,
) -> (Tensor<2>, Tensor<2>) {
    let (rows, half) = (positions.len(), head_dim / 2);
    let angles = angles(config, head_dim, positions);
    let cos: Vec<f64> = angles.iter().map(|angle| angle.cos()).collect();
    let sin: Vec<f64> = angles.iter().map(|angle| angle.sin()).collect();
    (
        Tensor::from_data(TensorData::new(cos, [rows, half]), (device, dtype)),
        Tensor::from_data(TensorData::new(sin, [rows, half]), (device, dtype)),
    )
}

impl RopeConfig {
    /// Rotates `x` (`[batch, heads, seq, head_dim]`) whose first position is `start` (a
    /// one-off table; a module keeps its table between calls).
    ///
    /// # Panics
    ///
    /// Panics if `head_dim` is odd.
    pub fn apply(&self, x: Tensor<4>, start: usize) -> Tensor<4> {
        Rope::new(self.clone()).apply(x, start)
    }
}

#[cfg(test)]
mod tests;
