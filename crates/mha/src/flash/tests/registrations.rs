//! The flash node's backward and data-parallel training's gradient sync.

use burn::nn::DropoutConfig;

use super::*;
use crate::kernel::explicit_attention;

/// Data-parallel training (burn-train's DDP) syncs a parameter's gradient once it has been
/// registered as often as the tape has parent slots for it. Here one leaf is the query, key
/// and value of one flash call and the key and value of a second one (with sinks), so it
/// fills five slots: each flash node must register each of its tracked slots exactly once,
/// through two backward passes, and the summed gradients must equal the explicit path's.
#[test]
fn the_backward_registers_each_tracked_parent_exactly_once() {
    let dropout = DropoutConfig::new(0.0).init();
    for device in cpu_devices() {
        let device = device.autodiff();
        device.seed(47);
        let shared = normal([2, 2, 5, 6], &device).require_grad();
        let sinks = normal([2], &device).require_grad();
        let frozen = normal([2, 2, 5, 6], &device);
        let masks = ScoreMasks::none(5);
        let blocks = BlockSizes { query: 2, key: 3 };
        let case = |sinks| options(&cases(&device, [2, 2, 5, 5]).remove(0), sinks);
        type Attend<'a> =
            &'a dyn Fn(Tensor<4>, Tensor<4>, Tensor<4>, Option<Tensor<1>>) -> Tensor<4>;
        let probe = Probe::default();
        let execution = Execution {
            probe: Some(probe.clone()),
            ..Execution::default()
        };
        let flash: Attend =
            &|q, k, v, s| flash_attention(q, k, v, &masks, &case(s), blocks, &execution);
        let explicit: Attend =
            &|q, k, v, s| explicit_attention(q, k, v, &masks, &case(s), &dropout).0;
        let grads_of = |attend: Attend| {
            let first = attend(shared.clone(), shared.clone(), shared.clone(), None);
            let second = attend(first, shared.clone(), shared.clone(), Some(sinks.clone()));
            // An untracked input takes a slot of neither count.
            let third = attend(second, frozen.clone(), shared.clone(), None);
            let grads = (third.clone() * third.sin()).sum().backward();
            [
                shared.grad(&grads).unwrap(),
                sinks.grad(&grads).unwrap().reshape([1, 1, 1, 2]),
            ]
        };
        let expected = grads_of(explicit);
        for pass in 0..2 {
            let actual = grads_of(flash);
            let log: Vec<(Vec<u64>, Vec<u64>)> = probe
                .take()
                .into_iter()
                .filter_map(|event| match event {
                    Event::Registered {
                        declared,
                        registered,
                    } => Some((declared, registered)),
                    Event::Computed { .. } => None,
                })
                .collect();
            assert_eq!(log.len(), 3, "three flash nodes ran their backward");
            for (mut declared, mut registered) in log {
                declared.sort_unstable();
                registered.sort_unstable();
                assert_eq!(
                    registered, declared,
                    "pass {pass}: each tracked parent slot registered exactly once"
                );
            }
            for (actual, expected) in actual.into_iter().zip(&expected) {
                let difference = max_difference(&actual, expected);
                assert!(
                    difference <= 1e-5,
                    "pass {pass}: gradient differs by {difference}"
                );
            }
        }
    }
}
