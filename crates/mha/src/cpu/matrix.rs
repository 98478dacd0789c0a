//! Strided f32 matrices over borrowed buffers, the `gemm` crate behind one checked call, the
//! copies that give `gemm` dense factors, and the task runner the CPU kernels share: the CPU
//! layer's pointer arithmetic in one reviewable file.
//!
//! Soundness: every matrix a GEMM reads or writes ([`Matrix`], [`MatrixMut`]) is checked, when
//! it is made, to lie inside the buffer it borrows, and a writable one borrows its buffer
//! mutably (`PhantomData<&'a mut [f32]>`), so that no other matrix reaches its elements while it
//! lives; [`sequence_major_heads`] splits one buffer into matrices that share no element, so
//! that each head can go to a task of its own.

use std::marker::PhantomData;
use std::ops::Range;

use rayon::prelude::*;

/// A rank-4 tensor's elements (f32 unless said) from its first one on, and its strides in
/// elements.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Strided<'a, E = f32> {
    pub values: &'a [E],
    pub strides: [usize; 4],
}

/// A rank-4 tensor's elements (f32 unless said) for writing: element `[a, b, c, d]` at
/// `values[a · strides[0] + b · strides[1] + c · strides[2] + d · strides[3]]`.
pub(crate) struct StridedMut<'a, E = f32> {
    pub values: &'a mut [E],
    pub strides: [usize; 4],
}

/// A head of a `[batch, heads, seq, dim]` tensor: batch element `batch`, head `head`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HeadIndex {
    pub batch: usize,
    pub head: usize,
}

/// Whether the element furthest from the first of a `shape` tensor with `strides` lies below
/// `length` (an empty tensor has none).
fn fits(shape: [usize; 4], strides: [usize; 4], length: usize) -> bool {
    let last = (0..4)
        .map(|axis| shape[axis].saturating_sub(1) * strides[axis])
        .sum::<usize>();
    shape.contains(&0) || last < length
}

/// A `[batch, heads, seq, dim]` tensor (f32 unless said) read in place through its strides: the
/// heads that `Linear` + split produce (`[batch, seq, heads, dim]` memory) need no copy.
pub(crate) struct HeadsView<'a, E = f32> {
    values: &'a [E],
    shape: [usize; 4],
    strides: [usize; 4],
}

impl<'a, E> HeadsView<'a, E> {
    /// # Panics
    ///
    /// If the strides reach past the elements.
    pub fn new(strided: Strided<'a, E>, shape: [usize; 4]) -> Self {
        let Strided { values, strides } = strided;
        assert!(
            fits(shape, strides, values.len()),
            "CPU kernel: a tensor's strides reach past its storage"
        );
        Self {
            values,
            shape,
            strides,
        }
    }

    /// The tensor's `[batch, heads, seq, dim]`.
    pub fn shape(&self) -> [usize; 4] {
        self.shape
    }

    /// Head `index` as a `[seq, dim]` matrix.
    ///
    /// # Panics
    ///
    /// If the head is not in the tensor.
    pub fn head(&self, index: HeadIndex) -> Matrix<'a, E> {
        let [batches, heads, seq, dim] = self.shape;
        assert!(
            index.batch < batches && index.head < heads,
            "CPU kernel: {index:?} is not a head of {:?}",
            self.shape
        );
        let start = index.batch * self.strides[0] + index.head * self.strides[1];
        Matrix::new(
            &self.values[start..],
            seq,
            dim,
            self.strides[2],
            self.strides[3],
        )
    }

    /// Head `index`'s elements from its first to the end of the tensor's, with the tensor's
    /// strides: what [`head`](Self::head) gives without the matrix's checks, for a reader that
    /// checks what it reads against the slice (the paged step's tiles, one per block and
    /// key/value head, which `simd::attend_tile` and its siblings check).
    ///
    /// # Panics
    ///
    /// If the head is not in the tensor.
    #[inline]
    pub fn head_elements(&self, index: HeadIndex) -> Strided<'a, E> {
        let [batches, heads, ..] = self.shape;
        if index.batch >= batches || index.head >= heads {
            head_out_of_range(index, self.shape);
        }
        let start = index.batch * self.strides[0] + index.head * self.strides[1];
        Strided {
            values: &self.values[start..],
            strides: self.strides,
        }
    }

    /// Row `row` of head `index`, which must have unit column stride.
    ///
    /// # Panics
    ///
    /// If the row is not in the tensor, or its elements are not adjacent.
    pub fn row(&self, index: HeadIndex, row: usize) -> &'a [E] {
        let [_, _, seq, dim] = self.shape;
        assert!(row < seq, "CPU kernel: row {row} of {seq}");
        let head = self.head(index);
        assert!(
            head.column_stride == 1 || dim <= 1,
            "CPU kernel: a row read as a slice needs unit column stride"
        );
        let start = row * head.row_stride;
        &head.values[start..start + dim]
    }
}

#[cold]
#[inline(never)]
fn head_out_of_range(index: HeadIndex, shape: [usize; 4]) -> ! {
    panic!("CPU kernel: {index:?} is not a head of {shape:?}")
}

/// A tensor broadcast to `[batch, heads, rows, columns]` (a mask, a bias) read in place, with
/// stride 0 on its broadcast axes.
pub(crate) struct BroadcastView<'a> {
    values: &'a [f32],
    strides: [usize; 4],
}

/// One row of a [`BroadcastView`].
pub(crate) enum BroadcastRow<'a> {
    /// The same value in every column (the tensor is broadcast along its last axis).
    Scalar(f32),
    /// The requested columns' values.
    Values(&'a [f32]),
}

/// A row of elements `stride` apart.
#[derive(Clone, Copy)]
pub(crate) struct StridedRow<'a> {
    values: &'a [f32],
    stride: usize,
}

impl StridedRow<'_> {
    /// Element `column`.
    ///
    /// # Panics
    ///
    /// If it lies past the row's buffer.
    pub fn get(&self, column: usize) -> f32 {
        self.values[column * self.stride]
    }
}

impl<'a> BroadcastView<'a> {
    /// # Panics
    ///
    /// If `shape` does not broadcast to `full`, or the strides reach past the elements.
    pub fn new(strided: Strided<'a>, shape: [usize; 4], full: [usize; 4]) -> Self {
        assert!(
            (0..4).all(|axis| shape[axis] == full[axis] || shape[axis] == 1),
            "CPU kernel: mask {shape:?} does not broadcast to {full:?}"
        );
        let strides = [0, 1, 2, 3].map(|axis| match shape[axis] {
            1 => 0,
            _ => strided.strides[axis],
        });
        assert!(
            fits(full, strides, strided.values.len()),
            "CPU kernel: a mask's strides reach past its storage"
        );
        Self {
            values: strided.values,
            strides,
        }
    }

    /// Columns `columns` of row `row` of head `index`.
    pub fn row(&self, index: HeadIndex, row: usize, columns: &Range<usize>) -> BroadcastRow<'a> {
        let [batch_stride, head_stride, row_stride, column_stride] = self.strides;
        let start = index.batch * batch_stride + index.head * head_stride + row * row_stride;
        match column_stride {
            0 => BroadcastRow::Scalar(self.values[start]),
            _ => BroadcastRow::Values(&self.values[start + columns.start..start + columns.end]),
        }
    }

    /// Batch element `batch`'s row when every head and every row of it is the same one and it
    /// varies along its columns (key padding); `None` otherwise.
    pub fn row_shared_by_heads_and_rows(&self, batch: usize) -> Option<StridedRow<'a>> {
        let [batch_stride, head_stride, row_stride, column_stride] = self.strides;
        (head_stride == 0 && row_stride == 0 && column_stride != 0).then(|| StridedRow {
            values: &self.values[batch * batch_stride..],
            stride: column_stride,
        })
    }
}

/// A read-only strided matrix (of f32 unless said) inside a borrowed buffer: element `(i, j)`
/// at `values[i · row_stride + j · column_stride]`, every one of which was checked to lie in
/// `values` when the matrix was made.
#[derive(Debug)]
pub(crate) struct Matrix<'a, E = f32> {
    pub values: &'a [E],
    pub rows: usize,
    pub columns: usize,
    pub row_stride: usize,
    pub column_stride: usize,
}

// Copy for any element type (a derive would ask `E: Copy`).
impl<E> Clone for Matrix<'_, E> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<E> Copy for Matrix<'_, E> {}

impl<'a, E> Matrix<'a, E> {
    /// # Panics
    ///
    /// If an element lies outside `values`.
    pub fn new(
        values: &'a [E],
        rows: usize,
        columns: usize,
        row_stride: usize,
        column_stride: usize,
    ) -> Self {
        let matrix = Self {
            values,
            rows,
            columns,
            row_stride,
            column_stride,
        };
        assert!(
            matrix.fits(values.len()),
            "CPU kernel: a {rows}x{columns} matrix does not fit its buffer"
        );
        matrix
    }

    /// A dense row-major matrix.
    ///
    /// # Panics
    ///
    /// If it does not fit `values`.
    pub fn dense(values: &'a [E], rows: usize, columns: usize) -> Self {
        Self::new(values, rows, columns, columns, 1)
    }

    /// Whether every element lies below `length`.
    fn fits(&self, length: usize) -> bool {
        self.rows == 0
            || self.columns == 0
            || (self.rows - 1) * self.row_stride + (self.columns - 1) * self.column_stride < length
    }

    pub fn transposed(self) -> Self {
        Self {
            rows: self.columns,
            columns: self.rows,
            row_stride: self.column_stride,
            column_stride: self.row_stride,
            ..self
        }
    }

    /// Columns `start..start + count`.
    ///
    /// # Panics
    ///
    /// If they are not columns of the matrix.
    pub fn columns(self, start: usize, count: usize) -> Self {
        self.transposed().rows(start, count).transposed()
    }

    /// Rows `start..start + count`.
    ///
    /// # Panics
    ///
    /// If they are not rows of the matrix.
    pub fn rows(self, start: usize, count: usize) -> Self {
        let offset = rows_offset(start, count, self.rows, self.row_stride);
        Self::new(
            &self.values[offset..],
            count,
            self.columns,
            self.row_stride,
            self.column_stride,
        )
    }

    /// Row `row`'s elements, which must be adjacent.
    ///
    /// # Panics
    ///
    /// If it is not a row of the matrix, or its column stride is not 1.
    pub fn row(self, row: usize) -> &'a [E] {
        assert!(
            row < self.rows && (self.column_stride == 1 || self.columns <= 1),
            "CPU kernel: row {row} of a {}-row matrix read as a slice",
            self.rows
        );
        &self.values[row * self.row_stride..][..self.columns]
    }
}

/// The element offset of rows `start..start + count` of a matrix of `rows` rows (0 for no
/// rows, so that an empty range at the end stays inside the buffer).
///
/// # Panics
///
/// If they are not rows of the matrix.
fn rows_offset(start: usize, count: usize, rows: usize, row_stride: usize) -> usize {
    assert!(
        start + count <= rows,
        "CPU kernel: rows {start}..{} out of a {rows}-row matrix",
        start + count
    );
    if count == 0 { 0 } else { start * row_stride }
}

/// A writable matrix with unit column stride: element `(i, j)` at `pointer + i · row_stride +
/// j`, every one of which was checked, when the matrix was made, to lie in the buffer it
/// borrows, and which no other live matrix reaches.
pub(crate) struct MatrixMut<'a> {
    pointer: *mut f32,
    pub rows: usize,
    pub columns: usize,
    row_stride: usize,
    buffer: PhantomData<&'a mut [f32]>,
}

impl<'a> MatrixMut<'a> {
    /// # Panics
    ///
    /// If an element lies outside `values`.
    pub fn from_slice(
        values: &'a mut [f32],
        rows: usize,
        columns: usize,
        row_stride: usize,
    ) -> Self {
        Matrix::new(values, rows, columns, row_stride, 1);
        Self {
            pointer: values.as_mut_ptr(),
            rows,
            columns,
            row_stride,
            buffer: PhantomData,
        }
    }

    /// A dense row-major matrix over `values`.
    ///
    /// # Panics
    ///
    /// If it does not fit `values`.
    pub fn dense(values: &'a mut [f32], rows: usize, columns: usize) -> Self {
        Self::from_slice(values, rows, columns, columns)
    }

    /// Rows `start..start + count`, borrowed from this matrix.
    ///
    /// # Panics
    ///
    /// If they are not rows of the matrix.
    pub fn rows(&mut self, start: usize, count: usize) -> MatrixMut<'_> {
        let offset = rows_offset(start, count, self.rows, self.row_stride);
        MatrixMut {
            // SAFETY: row `start` lies in the buffer (checked extent; `start < rows` when
            // `count > 0`, and the pointer is not used when `count == 0`).
            pointer: unsafe { self.pointer.add(offset) },
            rows: count,
            columns: self.columns,
            row_stride: self.row_stride,
            buffer: PhantomData,
        }
    }

    /// Columns `start..start + count`, borrowed from this matrix.
    ///
    /// # Panics
    ///
    /// If they are not columns of the matrix.
    pub fn columns(&mut self, start: usize, count: usize) -> MatrixMut<'_> {
        assert!(
            start + count <= self.columns,
            "CPU kernel: columns {start}..{} out of a {}-column matrix",
            start + count,
            self.columns
        );
        let offset = if count == 0 || self.rows == 0 {
            0
        } else {
            start
        };
        MatrixMut {
            // SAFETY: when the matrix has a row, column `start` of its first row lies in the
            // checked extent (`start < columns` when `count > 0`; the pointer is not used when
            // `count == 0` or `rows == 0`), and so do the sub-matrix's other elements, which are
            // the matrix's.
            pointer: unsafe { self.pointer.add(offset) },
            rows: self.rows,
            columns: count,
            row_stride: self.row_stride,
            buffer: PhantomData,
        }
    }

    /// Row `row`.
    ///
    /// # Panics
    ///
    /// If it is not a row of the matrix.
    pub fn row(&mut self, row: usize) -> &mut [f32] {
        assert!(
            row < self.rows,
            "CPU kernel: row {row} of a {}-row matrix",
            self.rows
        );
        // SAFETY: the row's elements lie in the checked extent, which this matrix alone reaches
        // while the returned slice borrows it.
        unsafe {
            std::slice::from_raw_parts_mut(self.pointer.add(row * self.row_stride), self.columns)
        }
    }

    /// Sets every element to `value`.
    pub fn fill(&mut self, value: f32) {
        for row in 0..self.rows {
            self.row(row).fill(value);
        }
    }
}

// SAFETY: a `MatrixMut` is the one way to its elements while it lives (it is made from a
// mutable borrow, or from `sequence_major_heads`'s disjoint split of one), so moving it to
// another thread is moving a `&mut [f32]`.
unsafe impl Send for MatrixMut<'_> {}

/// The heads of a `[batch, seq, heads, dim]` buffer (sequence-major: the layout the head merge
/// and `Linear`'s backward read without a copy) seen as logical shape `[batch, heads, seq,
/// dim]`, each as a `[seq, dim]` matrix, in head order (`batch · heads + head`). They are
/// disjoint, so that each can go to a task of its own; a head's rows interleave with the other
/// heads', which is why the buffer cannot be split into slices.
///
/// # Panics
///
/// If the shape does not fit the buffer.
pub(crate) fn sequence_major_heads(
    values: &mut [f32],
    [batches, heads, seq, dim]: [usize; 4],
) -> Vec<MatrixMut<'_>> {
    assert!(
        batches * heads * seq * dim <= values.len(),
        "CPU kernel: a {:?} head split of a buffer of {} elements",
        [batches, heads, seq, dim],
        values.len()
    );
    let pointer = values.as_mut_ptr();
    let head_at = |batch: usize, head: usize| {
        let start = match seq * dim {
            0 => 0,
            _ => (batch * seq * heads + head) * dim,
        };
        MatrixMut {
            // SAFETY: `start` lies in the buffer when the head has an element (checked above:
            // its last element, `start + (seq - 1) · heads · dim + dim - 1`, is below
            // `batches · seq · heads · dim`), and is 0 when it has none. Element `(s, d)` of head
            // `(b, h)` is element `((b · seq + s) · heads + h) · dim + d` of the buffer, another
            // one for every head, row and column: the matrices share no element, and the
            // returned vector borrows the buffer mutably while any lives.
            pointer: unsafe { pointer.add(start) },
            rows: seq,
            columns: dim,
            row_stride: heads * dim,
            buffer: PhantomData,
        }
    };
    (0..batches)
        .flat_map(|batch| (0..heads).map(move |head| (batch, head)))
        .map(|(batch, head)| head_at(batch, head))
        .collect()
}

/// What a product does with the destination's values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Write {
    /// `dst ← beta · lhs · rhs`.
    Overwrite,
    /// `dst ← dst + beta · lhs · rhs`.
    Accumulate,
}

/// [`gemm_on`] on the calling thread.
///
/// # Panics
///
/// If the three matrices' sizes do not fit a product.
pub(crate) fn gemm(dst: &mut MatrixMut, write: Write, lhs: Matrix, rhs: Matrix, beta: f32) {
    gemm_on(dst, write, lhs, rhs, beta, gemm::Parallelism::None);
}

/// `dst (+)= beta · lhs · rhs` on `parallelism`'s threads.
///
/// # Panics
///
/// If the three matrices' sizes do not fit a product.
pub(crate) fn gemm_on(
    dst: &mut MatrixMut,
    write: Write,
    lhs: Matrix,
    rhs: Matrix,
    beta: f32,
    parallelism: gemm::Parallelism,
) {
    assert!(
        lhs.rows == dst.rows && rhs.columns == dst.columns && lhs.columns == rhs.rows,
        "CPU kernel: a {}x{} by {}x{} product into {}x{}",
        lhs.rows,
        lhs.columns,
        rhs.rows,
        rhs.columns,
        dst.rows,
        dst.columns
    );
    if dst.rows == 0 || dst.columns == 0 {
        return;
    }
    // SAFETY: every element the strides reach lies in its buffer (checked when each matrix was
    // made), and `dst` is borrowed mutably from a buffer no `Matrix` reads.
    unsafe {
        gemm::gemm(
            dst.rows,
            dst.columns,
            lhs.columns,
            dst.pointer,
            1,
            dst.row_stride as isize,
            write == Write::Accumulate,
            lhs.values.as_ptr(),
            lhs.column_stride as isize,
            lhs.row_stride as isize,
            rhs.values.as_ptr(),
            rhs.column_stride as isize,
            rhs.row_stride as isize,
            1.0,
            beta,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// Whether a call is spread over rayon's threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Threads {
    /// The calling thread alone: a call too small to repay waking the workers.
    One,
    /// Rayon's pool.
    Pool,
}

/// Runs `task(scratch, item)` for every item, on `threads`, each thread with its own scratch
/// from `init`.
pub(crate) fn for_each_task<T: Send, S>(
    items: Vec<T>,
    threads: Threads,
    init: impl Fn() -> S + Sync + Send,
    task: impl Fn(&mut S, T) + Sync + Send,
) {
    match threads {
        Threads::Pool => items.into_par_iter().for_each_init(init, task),
        Threads::One => {
            let mut scratch = init();
            items.into_iter().for_each(|item| task(&mut scratch, item));
        }
    }
}

/// `matrix` (`[rows, columns]`, any strides) copied into `buffer` as its `[columns, rows]`
/// transpose with unit column stride.
///
/// Why: `gemm` packs the left-hand factor of its (row-major destination) problems in panels
/// along the destination's columns, so `Q Kᵀ` and `dO Vᵀ` have it pack `K` and `V` with
/// each panel gathered element by element across rows `d_model` floats apart, which alias
/// in the L1 cache (1.7 ns an element; 14% of a training step at (1, 2048, 512, 8)), and
/// again for every query block of the head. From this copy, made once per head, the packing
/// is a sequence of contiguous copies.
pub(crate) fn transposed_copy<'b>(buffer: &'b mut Vec<f32>, matrix: Matrix) -> Matrix<'b> {
    let (rows, columns) = (matrix.rows, matrix.columns);
    // A row stride that is not a multiple of a large power of two, for the same aliasing.
    let stride = rows.next_multiple_of(16) + 16;
    let values = grown(buffer, columns * stride);
    const ROW_BLOCK: usize = 16;
    for first_row in (0..rows).step_by(ROW_BLOCK) {
        let block_rows = ROW_BLOCK.min(rows - first_row);
        let source = matrix.rows(first_row, block_rows);
        for (column, out) in values.chunks_exact_mut(stride).enumerate() {
            let out = &mut out[first_row..first_row + block_rows];
            for (row, slot) in out.iter_mut().enumerate() {
                *slot = source.values[row * source.row_stride + column * source.column_stride];
            }
        }
    }
    Matrix::new(values, columns, rows, stride, 1)
}

impl<'a, E: Copy> Matrix<'a, E> {
    /// Row `row` copied into `out` (the matrix's `columns` long), whatever its column stride.
    ///
    /// # Panics
    ///
    /// If it is not a row of the matrix, or `out` is not `columns` long.
    pub fn copy_row(self, row: usize, out: &mut [E]) {
        assert!(
            row < self.rows && out.len() == self.columns,
            "CPU kernel: row {row} of a {}x{} matrix into {} elements",
            self.rows,
            self.columns,
            out.len()
        );
        let start = row * self.row_stride;
        match self.column_stride {
            1 => out.copy_from_slice(&self.values[start..start + self.columns]),
            stride => {
                for (column, slot) in out.iter_mut().enumerate() {
                    *slot = self.values[start + column * stride];
                }
            }
        }
    }

    /// Row `row` as a slice: in place where its elements are adjacent, else copied into
    /// `scratch`.
    ///
    /// # Panics
    ///
    /// If it is not a row of the matrix.
    pub fn row_or_copy<'s>(self, row: usize, scratch: &'s mut Vec<E>) -> &'s [E]
    where
        'a: 's,
    {
        if self.column_stride == 1 || self.columns <= 1 {
            return self.row(row);
        }
        scratch.clear();
        scratch.extend(
            (0..self.columns)
                .map(|column| self.values[row * self.row_stride + column * self.column_stride]),
        );
        scratch
    }
}

/// `matrix` (`[rows, columns]`, any strides) copied into `buffer` as dense rows.
///
/// Why: `dS K` and `P V` read a head's keys or values as their right-hand factor, which
/// `gemm` packs again for every query block; from rows `d_model` floats apart (2 KiB at
/// d_model 512) that packing gathers across lines that alias in the L1 cache. One-thread
/// microbenchmark of `dS K` at 128 queries × 8192 keys, head width 64: 171-177 GFLOP/s from
/// dense rows against 147-164 from the heads layout.
pub(crate) fn dense_copy<'b>(buffer: &'b mut Vec<f32>, matrix: Matrix) -> Matrix<'b> {
    let (rows, columns) = (matrix.rows, matrix.columns);
    let values = grown(buffer, rows * columns);
    for (row, out) in values.chunks_exact_mut(columns.max(1)).enumerate() {
        matrix.copy_row(row, out);
    }
    Matrix::dense(values, rows, columns)
}

/// The first `length` elements of `buffer`, grown (zero-filled) if it is shorter: a scratch
/// buffer whose elements the caller overwrites, so the part reused from earlier calls is not
/// cleared again.
pub(crate) fn grown(buffer: &mut Vec<f32>, length: usize) -> &mut [f32] {
    if buffer.len() < length {
        buffer.resize(length, 0.0);
    }
    &mut buffer[..length]
}

/// A rank-4 tensor's strides as the in-place kernels take them: `None` unless all are
/// non-negative and the last is 1. An axis of length 1 is never stepped along, so its stride,
/// whatever it is, is read as 1 (a transposed `[.., 1, d]` keeps a last stride of d, on flex
/// and in ndarray's standard layout alike).
pub(crate) fn kernel_strides(shape: &[usize], strides: &[isize]) -> Option<[usize; 4]> {
    if shape.len() != 4 || strides.len() != 4 {
        return None;
    }
    let strides: [isize; 4] =
        [0, 1, 2, 3].map(|axis| if shape[axis] == 1 { 1 } else { strides[axis] });
    (strides[3] == 1 && strides.iter().all(|&s| s >= 0))
        .then(|| strides.map(|stride| stride as usize))
}

/// The elements an ndarray view of rank 4 spans from its first one, and its strides, if all
/// are non-negative and the last is 1.
#[cfg(feature = "ndarray")]
pub(crate) fn ndarray_elements<'a, E>(view: ndarray::ArrayViewD<'a, E>) -> Option<Strided<'a, E>> {
    let shape = view.shape();
    let strides = kernel_strides(shape, view.strides())?;
    if view.is_empty() {
        return Some(Strided {
            values: &[],
            strides,
        });
    }
    let extent = 1
        + (0..4)
            .map(|axis| (shape[axis] - 1) * strides[axis])
            .sum::<usize>();
    // SAFETY: the view is not empty and its strides are non-negative, so its elements lie in
    // `extent` elements from its first one, all inside the array it borrows for `'a`.
    let values = unsafe { std::slice::from_raw_parts(view.as_ptr(), extent) };
    Some(Strided { values, strides })
}

#[cfg(test)]
mod tests;
