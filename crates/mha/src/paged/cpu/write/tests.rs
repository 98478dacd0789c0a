use burn::tensor::{Device, TensorData};

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
fn a_pool_of_another_dtype_or_under_autodiff_is_handed_back() {
    let device = Device::flex();
    let half = pool(BlockLayout::PositionMajor, &device).cast(DType::F16);
    let slots = vec![Slot {
        row: 0,
        block: 0,
        offset: 0,
    }];
    let declined = |write| matches!(write, PoolWrite::Declined(_));
    assert!(declined(native_write(
        half,
        &rows(&device),
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
