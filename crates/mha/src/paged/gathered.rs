//! The generic path of [`MultiHeadAttention::forward_paged`]: sequences' blocks gathered into
//! contiguous tensors with tensor ops and attended to by the kernel
//! [`AttentionPath::Auto`] picks, on backends without the native kernel (GPUs, autodiff) and
//! for runs of rows too long for it. The sequences of a step with at most 32 rows go in a few
//! calls, each padded to its longest (under ALiBi with each sequence's penalty at its own
//! positions in a float mask); a prompt, and one the calls leave alone (the only one of its
//! kind, or too long to share a call), in a call of its own.

use std::ops::Range;

use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorData};

use super::cache::{PagedKvCache, SequenceStep};
use super::step::{IN_PLACE_ROWS, StepHeads};
use crate::alibi::alibi_slopes_f32;
use crate::input::{AttentionPath, IntoAttnMask, NeedWeights};
use crate::mask::{Positions, Visibility};
use crate::module::MultiHeadAttention;

impl MultiHeadAttention {
    /// One sequence's context heads `[1, n_heads, new, head_dim]`: its stored keys and values
    /// gathered from its blocks into one tensor, then the kernel `Auto` picks.
    pub(super) fn gathered_attention(
        &self,
        heads: &StepHeads,
        sequence: &SequenceStep,
        cache: &PagedKvCache,
    ) -> Tensor<4> {
        let StepHeads { query, key, value } = heads;
        let (start, new) = (sequence.rows.start, sequence.rows.len());
        let query = query.clone().narrow(2, start, new);
        let mut new_key = key.clone().narrow(2, start, new);
        let mut new_value = value.clone().narrow(2, start, new);
        // Positions before the first held lie behind the window of every row of the step.
        let first_held = sequence.table.first_held(cache.block_size());
        if sequence.past > first_held {
            let (key_blocks, value_blocks) = cache.stores().expect("the step stored its keys");
            let dtype: DType = key.dtype();
            let past_key = key_blocks.gather(&sequence.table, sequence.past, dtype);
            let past_value = value_blocks.gather(&sequence.table, sequence.past, dtype);
            new_key = Tensor::cat(vec![past_key, new_key], 2);
            new_value = Tensor::cat(vec![past_value, new_value], 2);
        }
        let (key, value) = self.append_extra_positions(new_key, new_value);
        let visibility = Visibility {
            causal: true,
            window: self.window,
            alibi: self.alibi,
            positions: Positions {
                query: sequence.past as i64,
                key: first_held as i64,
            },
            extra_keys: self.extra_keys(),
            ..Visibility::nothing_hidden()
        };
        let geometry = self.geometry(1, new, sequence.past - first_held + new);
        let plan = self.plan(
            visibility,
            geometry,
            AttentionPath::Auto,
            NeedWeights::No,
            &query.device(),
        );
        self.attention_heads(query, key, value, &plan).0
    }

    /// The context heads `[1, n_heads, rows, head_dim]` of each of `sequences` that goes in a
    /// batched call (at most [`IN_PLACE_ROWS`] rows), `None` for the others.
    /// Decoding steps (one row) and short continuations apart, the longest first, the
    /// sequences fill calls while a call's keys widened to every query head stay within
    /// [`BATCH_BYTES`]; a sequence alone in its call is left to the caller.
    pub(super) fn batched_contexts(
        &self,
        heads: &StepHeads,
        sequences: &[SequenceStep],
        cache: &PagedKvCache,
    ) -> Vec<Option<Tensor<4>>> {
        let mut contexts = vec![None; sequences.len()];
        let block_size = cache.block_size();
        // Decoding steps (one row) apart from short continuations: a call pads every member's
        // queries to its most rows.
        let (single, several): (Vec<_>, Vec<_>) = sequences
            .iter()
            .enumerate()
            .filter(|(_, sequence)| sequence.rows.len() <= IN_PLACE_ROWS)
            .map(|(index, sequence)| (index, Member::of(sequence, block_size).held()))
            .partition(|&(index, _)| sequences[index].rows.len() == 1);
        let key_bytes = self.n_heads * self.head_dim * size_of::<f32>();
        let limit = CallLimit {
            bytes: BATCH_BYTES,
            key_bytes,
            block_size,
        };
        for group in [limit.groups(single), limit.groups(several)].concat() {
            let members: Vec<&SequenceStep> = group.iter().map(|&i| &sequences[i]).collect();
            let batch = self.batched_gathered_attention(heads, &members, cache);
            for (place, &index) in group.iter().enumerate() {
                let rows = sequences[index].rows.len();
                contexts[index] = Some(batch.clone().narrow(0, place, 1).narrow(2, 0, rows));
            }
        }
        contexts
    }

    /// The context heads of `sequences` in one call, `[sequences, n_heads, most_rows,
    /// head_dim]`: row `i` of the batch is `sequences[i]`, its new rows first (the rest
    /// repeat its last and are to be dropped). Each row's keys are its held stored positions,
    /// gathered from the blocks of all the sequences at once and padded behind to the whole
    /// blocks of the longest (so that, while a call keeps its members, its shapes, for which a
    /// GPU compiles its kernels, change once a block rather than every step), then its new
    /// positions padded to the most rows;
    /// one mask hides the padding and what causal masking and the window hide from each query
    /// at its own position: a bool mask, or under ALiBi a float one that also carries each
    /// head's penalty for each sequence's own distances between its queries and keys.
    pub(super) fn batched_gathered_attention(
        &self,
        heads: &StepHeads,
        sequences: &[&SequenceStep],
        cache: &PagedKvCache,
    ) -> Tensor<4> {
        let layout = BatchLayout::of(sequences, cache.block_size());
        let StepHeads { query, key, value } = heads;
        let device = query.device();
        let rows = layout.row_indices(&device);
        let count = sequences.len();
        // `[1, heads, step rows, dim]` → `[sequences, heads, most_rows, dim]`.
        let batched = |heads: &Tensor<4>| {
            let [_, n_heads, _, dim] = heads.dims();
            heads
                .clone()
                .select(2, rows.clone())
                .reshape([n_heads, count, layout.most_rows, dim])
                .swap_dims(0, 1)
        };
        let query = batched(query);
        let (mut key, mut value) = (batched(key), batched(value));
        if layout.past_keys > 0 {
            let (key_blocks, value_blocks) = cache.stores().expect("the step stored its keys");
            let stored: Vec<_> = sequences
                .iter()
                .map(|sequence| (&sequence.table, sequence.past))
                .collect();
            let dtype = key.dtype();
            let past_key = key_blocks.gather_batch(&stored, dtype);
            let past_value = value_blocks.gather_batch(&stored, dtype);
            key = Tensor::cat(vec![past_key, key], 2);
            value = Tensor::cat(vec![past_value, value], 2);
        }
        let (key, value) = self.append_extra_positions(key, value);
        // ALiBi's penalty depends on each sequence's own positions: a float mask carries it.
        let attn_mask = if self.alibi {
            let slopes = alibi_slopes_f32(self.n_heads);
            layout
                .alibi_bias(self.window, &slopes, &device)
                .into_attn_mask()
        } else {
            layout.hidden(self.window, &device).into_attn_mask()
        };
        let visibility = Visibility {
            attn_mask: Some(attn_mask),
            extra_keys: self.extra_keys(),
            ..Visibility::nothing_hidden()
        };
        let geometry = self.geometry(count, layout.most_rows, layout.keys());
        let plan = self.plan(
            visibility,
            geometry,
            AttentionPath::Auto,
            NeedWeights::No,
            &device,
        );
        self.attention_heads(query, key, value, &plan).0
    }
}

/// The most bytes a batched call's keys may take widened to every query head (f32): the
/// explicit path repeats grouped key/value heads, and wgpu binds at most 128 MiB to a shader
/// by default. Longer sequences go in smaller calls (or alone).
const BATCH_BYTES: usize = 32 << 20;

/// What bounds a batched call's size: its keys widened to every query head within `bytes`.
struct CallLimit {
    bytes: usize,
    /// Bytes of one key position widened to every query head.
    key_bytes: usize,
    block_size: usize,
}

impl CallLimit {
    /// `candidates` (a sequence's index and its held stored positions) in calls of at least
    /// two, the longest first, each as many as fit beside its longest (its stored positions
    /// in whole blocks, and room for [`IN_PLACE_ROWS`] new ones); the sequences left alone are
    /// in none.
    fn groups(&self, mut candidates: Vec<(usize, usize)>) -> Vec<Vec<usize>> {
        candidates.sort_by_key(|&(_, held)| std::cmp::Reverse(held));
        let mut groups = Vec::new();
        let mut rest = candidates.as_slice();
        while let Some(&(_, longest)) = rest.first() {
            let keys = longest.next_multiple_of(self.block_size) + IN_PLACE_ROWS;
            let fit = (self.bytes / (keys * self.key_bytes)).clamp(1, rest.len());
            let (group, later) = rest.split_at(fit);
            if group.len() > 1 {
                groups.push(group.iter().map(|&(index, _)| index).collect());
            }
            rest = later;
        }
        groups
    }
}

/// Where each sequence of a batched call lies: its rows of the step, its stored positions and
/// the first it holds.
struct Member {
    rows: Range<usize>,
    past: usize,
    first_held: usize,
}

impl Member {
    fn of(sequence: &SequenceStep, block_size: usize) -> Self {
        Member {
            rows: sequence.rows.clone(),
            past: sequence.past,
            first_held: sequence.table.first_held(block_size),
        }
    }

    /// Stored positions it holds, from its first held one.
    fn held(&self) -> usize {
        self.past - self.first_held
    }
}

/// The layout of a batched call ([`MultiHeadAttention::batched_gathered_attention`]): each
/// sequence's queries padded to the most rows, its keys its held stored positions padded to
/// `past_keys`, then its new positions padded to the most rows.
struct BatchLayout {
    members: Vec<Member>,
    most_rows: usize,
    /// The most stored positions a sequence holds, rounded up to whole blocks (as gathered).
    past_keys: usize,
}

impl BatchLayout {
    fn of(sequences: &[&SequenceStep], block_size: usize) -> Self {
        let members: Vec<Member> = sequences
            .iter()
            .map(|sequence| Member::of(sequence, block_size))
            .collect();
        let most_rows = members.iter().map(|member| member.rows.len()).max();
        let longest_past = members.iter().map(Member::held).max().unwrap_or(0);
        Self {
            most_rows: most_rows.expect("a batch of sequences"),
            past_keys: longest_past.next_multiple_of(block_size),
            members,
        }
    }

    /// Key positions of each row of the call.
    fn keys(&self) -> usize {
        self.past_keys + self.most_rows
    }

    /// The step's row each query row of the call reads, sequence by sequence: its own rows,
    /// then its last again up to the most rows.
    fn row_indices(&self, device: &Device) -> Tensor<1, Int> {
        let indices: Vec<i64> = self
            .members
            .iter()
            .flat_map(|member| {
                let last = member.rows.end - 1;
                (0..self.most_rows).map(move |row| (member.rows.start + row).min(last) as i64)
            })
            .collect();
        let count = indices.len();
        Tensor::from_data(TensorData::new(indices, [count]), device)
    }

    /// For each sequence, query row and key of the call, in that order, how far the key lies
    /// behind the query (query position − key position) where the query may attend to it;
    /// `None` where it may not: padding (of the stored positions or the new ones), a new key
    /// after the query, a key `window` or more positions before it. A padding query row sees
    /// what its sequence's last row sees.
    fn distances(&self, window: Option<usize>) -> Vec<Option<usize>> {
        let keys = self.keys();
        let mut distances = Vec::with_capacity(self.members.len() * self.most_rows * keys);
        for member in &self.members {
            let new = member.rows.len();
            for row in 0..self.most_rows {
                let row = row.min(new - 1);
                let query = member.past + row;
                distances.extend((0..keys).map(|key| {
                    let position = if key < self.past_keys {
                        (key < member.held()).then_some(member.first_held + key)
                    } else {
                        let offset = key - self.past_keys;
                        (offset <= row).then_some(member.past + offset)
                    };
                    let distance = query - position?;
                    window
                        .is_none_or(|window| distance < window)
                        .then_some(distance)
                }));
            }
        }
        distances
    }

    /// `[sequences, most_rows, keys]`, `true` where a query may not attend to a key
    /// ([`BatchLayout::distances`]).
    fn hidden(&self, window: Option<usize>, device: &Device) -> Tensor<3, Bool> {
        let hidden: Vec<bool> = self.distances(window).iter().map(Option::is_none).collect();
        let shape = [self.members.len(), self.most_rows, self.keys()];
        Tensor::from_data(TensorData::new(hidden, shape), device)
    }

    /// ALiBi's penalty as a float mask `[sequences, heads, most_rows, keys]`: `-slope ·
    /// distance` for each head's slope where a query may attend to a key (each sequence at its
    /// own positions), `-inf` where it may not. Made on the device from the distances and the
    /// slopes, so that the host sends a distance and a flag per query and key, not a float
    /// per head too.
    fn alibi_bias(&self, window: Option<usize>, slopes: &[f32], device: &Device) -> Tensor<4> {
        let distances = self.distances(window);
        let hidden: Vec<bool> = distances.iter().map(Option::is_none).collect();
        let distances: Vec<f32> = distances
            .iter()
            .map(|distance| distance.unwrap_or(0) as f32)
            .collect();
        let shape = [self.members.len(), 1, self.most_rows, self.keys()];
        let heads = slopes.len();
        let penalties =
            Tensor::<4>::from_data(TensorData::new(slopes.to_vec(), [1, heads, 1, 1]), device);
        let [sequences, _, rows, keys] = shape;
        let full = [sequences, heads, rows, keys];
        let hidden = Tensor::<4, Bool>::from_data(TensorData::new(hidden, shape), device);
        Tensor::<4>::from_data(TensorData::new(distances, shape), device)
            .mul(penalties.neg())
            .mask_fill(hidden.expand(full), f32::NEG_INFINITY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(rows: Range<usize>, past: usize, first_held: usize) -> Member {
        Member {
            rows,
            past,
            first_held,
        }
    }

    #[test]
    fn calls_take_the_longest_first_as_many_as_fit_and_leave_a_lone_one_out() {
        // 1 KiB a key position, 100 KiB a call, and each row of a call takes its longest's
        // stored positions in whole blocks of 16 and 32 new ones: 20 stored, 64 keys, one fits;
        // 16 or 3 stored, 48 keys, two fit; none stored, 32 keys, three fit.
        let limit = CallLimit {
            bytes: 100 << 10,
            key_bytes: 1 << 10,
            block_size: 16,
        };
        // 0 stored: 32 keys, 3 fit; 1-16 stored: 48 keys, 2 fit; 17-32: 64 keys, 1 fits.
        let groups = limit.groups(vec![
            (0, 0),
            (1, 20),
            (2, 5),
            (3, 16),
            (4, 0),
            (5, 3),
            (6, 0),
        ]);
        // The longest alone (left to the caller); 16 with 5; 3 with the first 0; the last two.
        assert_eq!(groups, vec![vec![3, 2], vec![5, 0], vec![4, 6]]);
        // Without a bound, one call.
        let unbounded = CallLimit {
            bytes: usize::MAX,
            ..limit
        };
        assert_eq!(unbounded.groups(vec![(0, 7), (1, 9)]), vec![vec![1, 0]]);
    }

    /// Sequence 0: two new rows (step rows 0 and 1) after 3 stored positions; sequence 1: one
    /// row (step row 2) after 5 stored, the first 4 given back (held: position 4); sequence 2:
    /// one row (step row 3), nothing stored.
    fn three_sequences() -> BatchLayout {
        BatchLayout {
            members: vec![member(0..2, 3, 0), member(2..3, 5, 4), member(3..4, 0, 0)],
            most_rows: 2,
            past_keys: 3,
        }
    }

    #[test]
    fn rows_repeat_their_last_and_keys_hide_padding_the_future_and_the_window() {
        let layout = three_sequences();
        let device = Device::flex();
        let rows = layout.row_indices(&device).into_data();
        assert_eq!(rows.iter::<i64>().collect::<Vec<_>>(), [0, 1, 2, 2, 3, 3]);
        let hidden = |window| -> Vec<bool> {
            layout
                .hidden(window, &device)
                .into_data()
                .to_vec::<bool>()
                .unwrap()
        };
        let (o, x) = (false, true);
        // Keys: 3 stored (padded), then 2 new (padded).
        #[rustfmt::skip]
        let everything = [
            o, o, o, o, x, // sequence 0, row 0 (position 3): stored 0-2, itself
            o, o, o, o, o, // row 1 (position 4): stored 0-2, both new
            o, x, x, o, x, // sequence 1, row 0 (position 5): stored 4, itself
            o, x, x, o, x, // its padding row, as its last
            x, x, x, o, x, // sequence 2 (position 0): itself only
            x, x, x, o, x,
        ];
        assert_eq!(hidden(None), everything);
        // A window of 2: position 3 sees 2-3, position 4 sees 3-4, position 5 sees 4-5.
        #[rustfmt::skip]
        let window = [
            x, x, o, o, x,
            x, x, x, o, o,
            o, x, x, o, x,
            o, x, x, o, x,
            x, x, x, o, x,
            x, x, x, o, x,
        ];
        assert_eq!(hidden(Some(2)), window);
    }

    #[test]
    fn alibi_penalises_each_sequence_at_its_own_distances_and_forbids_what_is_hidden() {
        let layout = three_sequences();
        let n = None;
        // Keys: 3 stored (padded), then 2 new (padded); a query's distance to each.
        #[rustfmt::skip]
        let distances = [
            Some(3), Some(2), Some(1), Some(0), n,       // sequence 0, position 3
            Some(4), Some(3), Some(2), Some(1), Some(0), // position 4
            Some(1), n, n, Some(0), n,                   // sequence 1, position 5
            Some(1), n, n, Some(0), n,                   // its padding row
            n, n, n, Some(0), n,                         // sequence 2, position 0
            n, n, n, Some(0), n,
        ];
        assert_eq!(layout.distances(None), distances);
        let slopes = [0.5, 0.25];
        let bias = layout
            .alibi_bias(None, &slopes, &Device::flex())
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        let per_sequence = 2 * layout.keys();
        let expected: Vec<f32> = distances
            .chunks(per_sequence)
            .flat_map(|sequence| {
                slopes.iter().flat_map(move |slope| {
                    sequence.iter().map(move |distance| {
                        distance.map_or(f32::NEG_INFINITY, |distance| -slope * distance as f32)
                    })
                })
            })
            .collect();
        assert_eq!(bias, expected);
        // A window of 2 forbids what it hides.
        let windowed = layout.alibi_bias(Some(2), &slopes, &Device::flex());
        let forbidden: Vec<bool> = windowed
            .into_data()
            .iter::<f32>()
            .map(|value| value == f32::NEG_INFINITY)
            .collect();
        let hidden: Vec<bool> = layout
            .hidden(Some(2), &Device::flex())
            .into_data()
            .to_vec::<bool>()
            .unwrap()
            .chunks(per_sequence)
            .flat_map(|sequence| [sequence, sequence].concat())
            .collect();
        assert_eq!(forbidden, hidden);
    }
}
