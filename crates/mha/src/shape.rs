//! Shape checks whose panic messages name the argument, the expected and the actual shape.

use core::fmt::Write;

/// One axis of an expected shape: its name, and the size it must have (`None`: any size).
pub(crate) type Axis<'a> = (&'a str, Option<usize>);

/// Panics unless `actual` matches `expected` axis by axis.
///
/// The message reads, for example:
/// ``MultiHeadAttention: `key` must have shape [batch=2, seq_k, d_key_input=16], got [2, 5, 8]
/// (axis 2 `d_key_input` is 8)``.
#[track_caller]
pub(crate) fn check_shape<const D: usize>(argument: &str, actual: [usize; D], expected: [Axis; D]) {
    if let Some(axis) =
        (0..D).find(|&axis| matches!(expected[axis].1, Some(size) if size != actual[axis]))
    {
        panic!(
            "MultiHeadAttention: `{argument}` must have shape {}, got {actual:?} (axis {axis} `{}` is {})",
            describe(&expected),
            expected[axis].0,
            actual[axis]
        );
    }
}

/// `[batch=2, seq_k, d_key_input=16]`.
pub(crate) fn describe(expected: &[Axis]) -> String {
    let mut text = String::from("[");
    for (index, (name, size)) in expected.iter().enumerate() {
        if index > 0 {
            text.push_str(", ");
        }
        match size {
            Some(size) => write!(text, "{name}={size}").unwrap(),
            None => text.push_str(name),
        }
    }
    text.push(']');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matching_shapes_pass() {
        check_shape(
            "x",
            [2, 3, 4],
            [("batch", Some(2)), ("seq", None), ("d", Some(4))],
        );
    }

    #[test]
    #[should_panic(
        expected = "MultiHeadAttention: `key` must have shape [batch=2, seq_k, d_key_input=16], got [2, 5, 8] (axis 2 `d_key_input` is 8)"
    )]
    fn mismatch_names_argument_axis_and_shapes() {
        check_shape(
            "key",
            [2, 5, 8],
            [
                ("batch", Some(2)),
                ("seq_k", None),
                ("d_key_input", Some(16)),
            ],
        );
    }
}
