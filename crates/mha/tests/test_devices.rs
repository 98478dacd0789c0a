//! The device list every cross-backend test iterates over cannot be empty or leave a required
//! device out silently: such a list would let every test pass while testing nothing.

mod common;

use common::{devices_from, panic_message};

fn refusal(list: Option<&str>, require_wgpu: bool) -> String {
    panic_message(|| devices_from(list, require_wgpu))
}

#[test]
fn an_unknown_device_name_is_refused_rather_than_skipped() {
    let message = refusal(Some("flex,ndaray"), false);
    assert!(message.contains("unknown device `ndaray`"), "{message}");
}

#[test]
fn an_empty_device_list_is_refused() {
    let message = refusal(Some(""), false);
    assert!(message.contains("unknown device ``"), "{message}");
}

#[test]
fn requiring_wgpu_while_leaving_it_out_is_refused() {
    let message = refusal(Some("flex,ndarray"), true);
    assert!(message.contains("leaves wgpu out"), "{message}");
}

#[test]
fn a_named_list_is_what_runs() {
    let names: Vec<&str> = devices_from(Some("ndarray, flex"), false)
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    assert_eq!(names, ["flex", "ndarray"]);
}
