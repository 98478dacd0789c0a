use burn::tensor::{Device, IntDType, TensorData};

use crate::cache::{Quantized, quantize_int8};

use super::*;

/// A pool of 3 blocks, 2 heads, blocks of 4 positions and 3 features, in `layout`, each
/// element its own value.
fn pool(layout: BlockLayout, device: &Device) -> Tensor<4> {
    let shape = match layout {
        BlockLayout::PositionMajor => [3, 2, 4, 3],
        BlockLayout::FeatureMajor => [3, 2, 3, 4],
    };
    let values: Vec<f32> = (0..72).map(|i| i as f32).collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// A step's rows `[1, 2 heads, 3 rows, 3 features]`, negative so that they stand out.
fn rows(device: &Device) -> Tensor<4> {
    let values: Vec<f32> = (0..18).map(|i| -1.0 - i as f32).collect();
    Tensor::from_data(TensorData::new(values, [1, 2, 3, 3]), device)
}

fn elements(tensor: Tensor<4>) -> Vec<f32> {
    tensor.into_data().to_vec().expect("f32 elements")
}

/// What the pool holds after the slots are written, computed element by element.
fn expected(layout: BlockLayout, slots: &[Slot]) -> Vec<f32> {
    let mut values: Vec<f32> = (0..72).map(|i| i as f32).collect();
    for slot in slots {
        for head in 0..2 {
            for feature in 0..3 {
                let at = match layout {
                    BlockLayout::PositionMajor => {
                        ((slot.block * 2 + head) * 4 + slot.offset) * 3 + feature
                    }
                    BlockLayout::FeatureMajor => {
                        ((slot.block * 2 + head) * 3 + feature) * 4 + slot.offset
                    }
                };
                values[at] = -1.0 - (head * 9 + slot.row * 3 + feature) as f32;
            }
        }
    }
    values
}

#[test]
fn rows_land_at_their_slots_in_either_layout_and_a_shared_pool_keeps_its_values() {
    let slots = vec![
        Slot {
            row: 0,
            block: 2,
            offset: 3,
        },
        Slot {
            row: 1,
            block: 0,
            offset: 0,
        },
        Slot {
            row: 2,
            block: 0,
            offset: 1,
        },
    ];
    for device in [Device::flex(), Device::ndarray()] {
        for layout in [BlockLayout::PositionMajor, BlockLayout::FeatureMajor] {
            let original = pool(layout, &device);
            let shared = original.clone();
            let PoolWrite::Written(written) =
                native_write(original, &rows(&device), slots.clone(), layout)
            else {
                panic!("{device:?} writes an f32 pool in place");
            };
            assert_eq!(
                elements(written),
                expected(layout, &slots),
                "{device:?} {layout:?}"
            );
            assert_eq!(
                elements(shared),
                expected(layout, &[]),
                "{device:?} {layout:?}: the clone changed"
            );
        }
    }
}

#[test]
fn rows_of_another_dtype_or_a_pool_under_autodiff_are_handed_back() {
    let device = Device::flex();
    let slots = vec![Slot {
        row: 0,
        block: 0,
        offset: 0,
    }];
    let declined = |write| matches!(write, PoolWrite::Declined(_));
    let half_rows = rows(&device).cast(DType::F16);
    assert!(declined(native_write(
        pool(BlockLayout::PositionMajor, &device),
        &half_rows,
        slots.clone(),
        BlockLayout::PositionMajor
    )));
    let autodiff = device.clone().autodiff();
    let tracked = pool(BlockLayout::PositionMajor, &autodiff);
    assert!(declined(native_write(
        tracked,
        &rows(&autodiff),
        slots,
        BlockLayout::PositionMajor
    )));
}

/// Three slots of the three rows, in two blocks.
fn three_slots() -> Vec<Slot> {
    [(0, 2, 3), (1, 0, 0), (2, 0, 1)]
        .into_iter()
        .map(|(row, block, offset)| Slot { row, block, offset })
        .collect()
}

/// Rows `[1, 2 heads, 3 rows, 3 features]` whose quantization rounds halves: the first
/// feature of each row is its largest magnitude, 127 or 254, so that the others are divided
/// by a scale of 1 or 2 into values such as 0.5, 1.5 and 2.5, which round half to even (0,
/// 2, 2), where rounding half away from zero would give 1, 2 and 3.
fn rows_with_halves(device: &Device) -> Tensor<4> {
    let values = vec![
        127.0f32, 0.5, 1.5, // scale 1
        -254.0, 5.0, -3.0, // scale 2: 2.5 and -1.5
        127.0, 2.5, -0.5, // scale 1
        0.0, 0.0, 0.0, // all zeros: the smallest scale
        127.0, -2.5, 126.5, // scale 1
        -1e-3, 3e-4, 5e-4, // a small scale
    ];
    Tensor::from_data(TensorData::new(values, [1, 2, 3, 3]), device)
}

#[test]
fn an_f16_pool_on_flex_takes_the_rows_as_the_tensor_cast_rounds_them() {
    let device = Device::flex();
    let slots = three_slots();
    // Rows whose f16 roundings differ from truncation.
    let values: Vec<f32> = (0..18).map(|i| 1.0 / (3.0 + i as f32)).collect();
    let rows = Tensor::<4>::from_data(TensorData::new(values, [1, 2, 3, 3]), &device);
    for layout in [BlockLayout::PositionMajor, BlockLayout::FeatureMajor] {
        let half = pool(layout, &device).cast(DType::F16);
        let PoolWrite::Written(written) = native_write(half.clone(), &rows, slots.clone(), layout)
        else {
            panic!("flex writes an f16 pool in place");
        };
        assert_eq!(written.dtype(), DType::F16, "{layout:?}");
        // Each row cast by the tensor op and assigned into its place.
        let cast = rows.clone().cast(DType::F16);
        let mut expected = half;
        for slot in &slots {
            let row = cast.clone().narrow(2, slot.row, 1);
            let row = match layout {
                BlockLayout::PositionMajor => row,
                BlockLayout::FeatureMajor => row.swap_dims(2, 3),
            };
            let ranges = match layout {
                BlockLayout::PositionMajor => [
                    slot.block..slot.block + 1,
                    0..2,
                    slot.offset..slot.offset + 1,
                    0..3,
                ],
                BlockLayout::FeatureMajor => [
                    slot.block..slot.block + 1,
                    0..2,
                    0..3,
                    slot.offset..slot.offset + 1,
                ],
            };
            expected = expected.slice_assign(ranges, row);
        }
        assert_eq!(
            elements(written.cast(DType::F32)),
            elements(expected.cast(DType::F32)),
            "{layout:?}"
        );
    }
}

#[test]
fn an_int8_pool_takes_the_rows_as_quantize_int8_stores_them() {
    let slots = three_slots();
    for device in [Device::flex(), Device::ndarray()] {
        let rows = rows_with_halves(&device);
        let Quantized {
            values: quantized,
            scales: quantized_scales,
        } = quantize_int8(rows.clone());
        let quantized: Vec<i64> = quantized.into_data().convert::<i64>().to_vec().unwrap();
        let quantized_scales = elements(quantized_scales);
        for layout in [BlockLayout::PositionMajor, BlockLayout::FeatureMajor] {
            let (values_shape, scales_shape) = match layout {
                BlockLayout::PositionMajor => ([3, 2, 4, 3], [3, 2, 4, 1]),
                BlockLayout::FeatureMajor => ([3, 2, 3, 4], [3, 2, 1, 4]),
            };
            let pool = Int8Blocks {
                values: Tensor::<4>::zeros(values_shape, &device).cast(IntDType::I8),
                scales: Tensor::ones(scales_shape, &device),
            };
            let PoolWrite::Written(Int8Blocks { values, scales }) =
                native_write_int8(pool, &rows, slots.clone(), layout)
            else {
                panic!("{device:?} writes an int8 pool in place");
            };
            let values: Vec<i64> = values.into_data().convert::<i64>().to_vec().unwrap();
            let scales = elements(scales);
            // Unwritten places keep their zeros and ones.
            let mut expected_values = vec![0i64; 72];
            let mut expected_scales = vec![1.0f32; 24];
            for slot in &slots {
                for head in 0..2 {
                    let position = (slot.block * 2 + head) * 4 + slot.offset;
                    let row = head * 3 + slot.row;
                    expected_scales[position] = quantized_scales[row];
                    for feature in 0..3 {
                        let at = match layout {
                            BlockLayout::PositionMajor => position * 3 + feature,
                            BlockLayout::FeatureMajor => {
                                ((slot.block * 2 + head) * 3 + feature) * 4 + slot.offset
                            }
                        };
                        expected_values[at] = quantized[row * 3 + feature];
                    }
                }
            }
            assert_eq!(values, expected_values, "{device:?} {layout:?}");
            assert_eq!(scales, expected_scales, "{device:?} {layout:?}");
        }
    }
}

/// Rows flex's tensor ops quantize without a panic whatever they hold: a NaN (0 beside a NaN
/// scale), infinities (an infinite scale: every value 0, the infinities NaN over it, so 0) and
/// signed zeros (the smallest scale). ndarray's cast refuses a NaN, so flex alone.
#[test]
fn special_rows_quantize_as_flex_s_tensor_ops_quantize_them() {
    let values = vec![
        f32::NAN,
        1.0,
        -2.0, //
        f32::INFINITY,
        1.0,
        f32::NEG_INFINITY, //
        -0.0,
        0.0,
        -0.0,
    ];
    let rows = Tensor::<4>::from_data(
        TensorData::new(values.clone(), [1, 1, 3, 3]),
        &Device::flex(),
    );
    let Quantized {
        values: quantized,
        scales,
    } = quantize_int8(rows);
    let quantized: Vec<i64> = quantized.into_data().convert::<i64>().to_vec().unwrap();
    let scales = elements(scales);
    for (index, row) in values.chunks(3).enumerate() {
        let scale = int8_scale(row);
        assert!(
            scale.to_bits() == scales[index].to_bits()
                || (scale.is_nan() && scales[index].is_nan()),
            "row {index}: scale {scale} against {}",
            scales[index]
        );
        let row_values: Vec<i64> = row.iter().map(|&x| int8_value(x, scale) as i64).collect();
        assert_eq!(row_values, quantized[index * 3..][..3], "row {index}");
    }
}

#[test]
fn halves_round_to_even_as_the_tensor_ops_round_them() {
    let rows = rows_with_halves(&Device::flex());
    let features: Vec<f32> = rows.clone().into_data().to_vec().unwrap();
    let Quantized { values, scales } = quantize_int8(rows);
    let values: Vec<i64> = values.into_data().convert::<i64>().to_vec().unwrap();
    let scales = elements(scales);
    for (index, row) in features.chunks(3).enumerate() {
        let scale = int8_scale(row);
        assert_eq!(scale.to_bits(), scales[index].to_bits(), "row {index}");
        let row_values: Vec<i64> = row.iter().map(|&x| int8_value(x, scale) as i64).collect();
        assert_eq!(row_values, values[index * 3..][..3], "row {index}");
    }
    // The halves of the first rows, rounded to even.
    assert_eq!(values[..6], [127, 0, 2, -127, 2, -2]);
}

#[test]
#[should_panic(expected = "paged write: rows")]
fn a_slot_outside_the_pool_is_refused() {
    let device = Device::flex();
    let slots = vec![Slot {
        row: 0,
        block: 3,
        offset: 0,
    }];
    let _ = native_write(
        pool(BlockLayout::PositionMajor, &device),
        &rows(&device),
        slots,
        BlockLayout::PositionMajor,
    );
}

#[test]
fn a_broadcast_pool_is_written_through_a_copy_of_its_own() {
    // Three blocks that share one place in memory (a stride of 0): a row written into one
    // block must not show in the others.
    let slots = vec![Slot {
        row: 1,
        block: 2,
        offset: 3,
    }];
    for device in [Device::flex(), Device::ndarray()] {
        let one_block: Tensor<4> = Tensor::zeros([1, 2, 4, 3], &device);
        let broadcast = one_block.expand([3, 2, 4, 3]);
        let PoolWrite::Written(written) = native_write(
            broadcast,
            &rows(&device),
            slots.clone(),
            BlockLayout::PositionMajor,
        ) else {
            panic!("{device:?} writes an f32 pool in place");
        };
        let values = elements(written);
        let changed: Vec<usize> = (0..72).filter(|&i| values[i] != 0.0).collect();
        // Block 2, position 3, both heads' three features.
        let expected: Vec<usize> = (0..2)
            .flat_map(|head| (0..3).map(move |feature| ((2 * 2 + head) * 4 + 3) * 3 + feature))
            .collect();
        assert_eq!(changed, expected, "{device:?}");
    }
}
