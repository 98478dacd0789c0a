use super::*;

/// Element `(i, j)` of `matrix`, by its strides.
fn at(matrix: Matrix, i: usize, j: usize) -> f32 {
    matrix.values[i * matrix.row_stride + j * matrix.column_stride]
}

/// `lhs · rhs` by the definition.
fn naive(lhs: Matrix, rhs: Matrix) -> Vec<f32> {
    let mut out = vec![0.0; lhs.rows * rhs.columns];
    for i in 0..lhs.rows {
        for j in 0..rhs.columns {
            out[i * rhs.columns + j] = (0..lhs.columns)
                .map(|k| at(lhs, i, k) * at(rhs, k, j))
                .sum();
        }
    }
    out
}

fn counting(length: usize) -> Vec<f32> {
    (0..length).map(|i| (i % 7) as f32 - 3.0).collect()
}

#[test]
fn sub_matrices_and_transposes_address_the_elements_they_name() {
    let values: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let matrix = Matrix::new(&values, 3, 4, 8, 2);
    assert_eq!(at(matrix, 2, 3), 22.0);
    assert_eq!(at(matrix.transposed(), 3, 2), 22.0);
    let inner = matrix.rows(1, 2).columns(1, 2);
    assert_eq!((inner.rows, inner.columns), (2, 2));
    assert_eq!([at(inner, 0, 0), at(inner, 1, 1)], [10.0, 20.0]);
    assert_eq!(Matrix::dense(&values, 4, 6).row(2), &values[12..18]);
    assert!(matrix.rows(3, 0).rows == 0, "an empty block at the end");
}

#[test]
#[should_panic(expected = "does not fit its buffer")]
fn a_matrix_reaching_past_its_buffer_is_refused() {
    // The last element, (2, 3), sits at 2 · 8 + 3 · 2 = 22.
    let values = vec![0.0; 22];
    Matrix::new(&values, 3, 4, 8, 2);
}

#[test]
#[should_panic(expected = "out of a 3-row matrix")]
fn rows_past_the_matrix_are_refused() {
    let values = vec![0.0; 12];
    Matrix::dense(&values, 3, 4).rows(2, 2);
}

#[test]
fn writable_blocks_write_their_own_elements_only() {
    let mut values = vec![0.0; 20];
    let mut matrix = MatrixMut::from_slice(&mut values, 3, 4, 6);
    matrix.rows(1, 2).columns(2, 2).fill(1.0);
    matrix.row(0)[3] = 2.0;
    let expected = [
        0.0, 0.0, 0.0, 2.0, 0.0, 0.0, //
        0.0, 0.0, 1.0, 1.0, 0.0, 0.0, //
        0.0, 0.0, 1.0, 1.0, 0.0, 0.0, //
        0.0, 0.0,
    ];
    assert_eq!(values, expected);
}

#[test]
#[should_panic(expected = "out of a 4-column matrix")]
fn writable_columns_past_the_matrix_are_refused() {
    let mut values = vec![0.0; 12];
    MatrixMut::dense(&mut values, 3, 4).columns(3, 2);
}

/// A product of strided, transposed factors equals the definition, overwritten and
/// accumulated, on one thread and on rayon's.
#[test]
fn gemm_equals_the_definition_on_strided_factors() {
    let (rows, inner, columns) = (5, 7, 3);
    let lhs_values = counting(inner * 9);
    let rhs_values = counting(columns * inner * 2 + 1);
    // lhs read transposed from a [inner, 9] buffer; rhs with column stride 2.
    let lhs = Matrix::new(&lhs_values, inner, rows, 9, 1).transposed();
    let rhs = Matrix::new(&rhs_values, inner, columns, columns * 2, 2);
    let expected = naive(lhs, rhs);
    for parallelism in [gemm::Parallelism::None, gemm::Parallelism::Rayon(2)] {
        let mut out = vec![1.0; rows * columns];
        let mut dst = MatrixMut::dense(&mut out, rows, columns);
        gemm_on(&mut dst, Write::Overwrite, lhs, rhs, 0.5, parallelism);
        let halves: Vec<f32> = expected.iter().map(|x| 0.5 * x).collect();
        assert_eq!(out, halves, "overwritten");
        let mut dst = MatrixMut::dense(&mut out, rows, columns);
        gemm_on(&mut dst, Write::Accumulate, lhs, rhs, 0.5, parallelism);
        assert_eq!(out, expected, "accumulated");
    }
}

#[test]
#[should_panic(expected = "a 5x7 by 6x3 product")]
fn a_product_of_mismatched_sizes_is_refused() {
    let values = vec![0.0; 64];
    let mut out = vec![0.0; 15];
    let mut dst = MatrixMut::dense(&mut out, 5, 3);
    gemm(
        &mut dst,
        Write::Overwrite,
        Matrix::dense(&values, 5, 7),
        Matrix::dense(&values, 6, 3),
        1.0,
    );
}

/// Heads of a sequence-major buffer interleave: head 1's rows sit between head 0's, and each
/// head's matrix writes its own elements only.
#[test]
fn sequence_major_heads_interleave_and_share_no_element() {
    let shape = [2, 2, 3, 2];
    let mut values = vec![0.0; 24];
    let mut heads = sequence_major_heads(&mut values, shape);
    assert_eq!(
        heads.len(),
        4,
        "in head order: (0, 0), (0, 1), (1, 0), (1, 1)"
    );
    for (index, head) in heads.iter_mut().enumerate() {
        for row in 0..3 {
            head.row(row).fill((10 * index + row) as f32);
        }
    }
    drop(heads);
    // Element (s, d) of head (b, h) at ((b · 3 + s) · 2 + h) · 2 + d.
    let expected: Vec<f32> = (0..24)
        .map(|i| {
            let (b, s, h) = (i / 12, i / 4 % 3, i / 2 % 2);
            (10 * (2 * b + h) + s) as f32
        })
        .collect();
    assert_eq!(values, expected);
}

#[test]
#[should_panic(expected = "head split of a buffer of 23 elements")]
fn a_head_split_larger_than_its_buffer_is_refused() {
    let mut values = vec![0.0; 23];
    sequence_major_heads(&mut values, [2, 2, 3, 2]);
}

#[test]
fn copies_hold_the_matrix_and_its_transpose() {
    let values = counting(40);
    let matrix = Matrix::new(&values, 17, 2, 2, 1).columns(0, 2);
    let strided = Matrix::new(&values, 5, 3, 8, 2);
    for source in [matrix, strided] {
        let (mut dense, mut transposed) = (Vec::new(), Vec::new());
        let copy = dense_copy(&mut dense, source);
        let flipped = transposed_copy(&mut transposed, source);
        assert_eq!(
            (flipped.rows, flipped.columns),
            (source.columns, source.rows)
        );
        for i in 0..source.rows {
            for j in 0..source.columns {
                assert_eq!(at(copy, i, j), at(source, i, j));
                assert_eq!(at(flipped, j, i), at(source, i, j));
            }
        }
        assert_ne!(flipped.row_stride % 64, 0, "no power-of-two row stride");
    }
}

#[test]
fn heads_and_broadcast_views_read_through_their_strides() {
    let values = counting(2 * 3 * 4 * 5);
    // [batch 2, seq 3, heads 4, dim 5] memory seen as [2, 4, 3, 5].
    let strided = Strided {
        values: &values,
        strides: [60, 5, 20, 1],
    };
    let heads = HeadsView::new(strided, [2, 4, 3, 5]);
    let index = HeadIndex { batch: 1, head: 2 };
    assert_eq!(heads.row(index, 1), &values[60 + 20 + 10..][..5]);
    assert_eq!(at(heads.head(index), 2, 4), values[60 + 40 + 10 + 4]);
    // A [2, 1, 1, 5] mask over [2, 4, 3, 5] scores.
    let mask = BroadcastView::new(
        Strided {
            values: &values[..10],
            strides: [5, 5, 5, 1],
        },
        [2, 1, 1, 5],
        [2, 4, 3, 5],
    );
    match mask.row(index, 2, &(1..3)) {
        BroadcastRow::Values(row) => assert_eq!(row, &values[6..8]),
        BroadcastRow::Scalar(_) => panic!("varies along its columns"),
    }
    let shared = mask.row_shared_by_heads_and_rows(1).expect("key padding");
    assert_eq!(shared.get(4), values[9]);
    let per_query = BroadcastView::new(strided, [2, 1, 3, 1], [2, 4, 3, 5]);
    assert!(per_query.row_shared_by_heads_and_rows(0).is_none());
    assert!(matches!(
        per_query.row(index, 1, &(0..5)),
        BroadcastRow::Scalar(_)
    ));
}

#[test]
#[should_panic(expected = "strides reach past its storage")]
fn a_heads_view_reaching_past_its_storage_is_refused() {
    let values = vec![0.0; 59];
    let strided = Strided {
        values: &values,
        strides: [30, 5, 10, 1],
    };
    HeadsView::new(strided, [2, 2, 3, 5]);
}

#[test]
fn tasks_run_once_each_on_one_thread_and_on_the_pool() {
    for threads in [Threads::One, Threads::Pool] {
        let seen = std::sync::Mutex::new(Vec::new());
        for_each_task(
            (0..50).collect(),
            threads,
            || 0usize,
            |calls, item: usize| {
                *calls += 1;
                seen.lock().expect("seen").push(item);
            },
        );
        let mut seen = seen.into_inner().expect("seen");
        seen.sort_unstable();
        assert_eq!(seen, (0..50).collect::<Vec<_>>(), "{threads:?}");
    }
}

/// A row reads the same through adjacent elements and through a column stride, copied or in
/// place.
#[test]
fn rows_read_alike_whatever_the_column_stride() {
    // [[0, 1, 2], [3, 4, 5]] and its transpose read from the same buffer.
    let values: Vec<f32> = (0..6).map(|v| v as f32).collect();
    let matrix = Matrix::dense(&values, 2, 3);
    let transposed = matrix.transposed();
    let mut out = [0.0f32; 2];
    transposed.copy_row(2, &mut out);
    assert_eq!(out, [2.0, 5.0]);
    let mut scratch = Vec::new();
    assert_eq!(transposed.row_or_copy(1, &mut scratch), [1.0, 4.0]);
    assert_eq!(matrix.row_or_copy(1, &mut scratch), [3.0, 4.0, 5.0]);
    let mut out = [0.0f32; 3];
    matrix.copy_row(0, &mut out);
    assert_eq!(out, [0.0, 1.0, 2.0]);
}
