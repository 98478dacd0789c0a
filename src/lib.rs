//! Support shared by the top-level examples and tests of the `mha` crate: choosing a Burn
//! device by name, and listing the devices every cross-backend test runs on.
//!
//! The library itself is the `mha` crate (`crates/mha`).

use std::panic::{AssertUnwindSafe, catch_unwind};

use burn::tensor::{Device, DeviceKind, Tensor};

/// The device names [`device_by_name`] understands.
pub const DEVICE_NAMES: [&str; 3] = ["flex", "ndarray", "wgpu"];

/// The Burn device called `name` (`flex`, `ndarray` or `wgpu`).
///
/// `wgpu` is the default wgpu adapter: a GPU where there is one, or a software Vulkan driver
/// such as Mesa's lavapipe.
pub fn device_by_name(name: &str) -> Result<Device, String> {
    match name {
        "flex" => Ok(Device::flex()),
        "ndarray" => Ok(ndarray_device()),
        "wgpu" => Ok(Device::wgpu(DeviceKind::DefaultDevice)),
        other => Err(format!(
            "unknown device `{other}`; available: {}",
            DEVICE_NAMES.join(", ")
        )),
    }
}

/// Reads `[--device flex|ndarray|wgpu]` (default `flex`) from the command line of `program`;
/// on a bad argument, prints a one-line error with the usage and exits with status 2.
pub fn device_from_args(program: &str) -> (String, Device) {
    let usage = format!("usage: {program} [--device {}]", DEVICE_NAMES.join("|"));
    let fail = |message: String| -> ! {
        eprintln!("error: {message}; {usage}");
        std::process::exit(2)
    };
    let mut args = std::env::args().skip(1);
    let mut name = String::from("flex");
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--device" => {
                name = args
                    .next()
                    .unwrap_or_else(|| fail("`--device` needs a value".into()))
            }
            "--help" | "-h" => {
                println!("{usage}");
                std::process::exit(0)
            }
            other => fail(format!("unexpected argument `{other}`")),
        }
    }
    let device = device_by_name(&name).unwrap_or_else(|error| fail(error));
    (name, device)
}

/// burn-ndarray is deprecated upstream (in favour of flex) but still shipped in 0.22; we keep
/// supporting it, and this is the one place that builds it.
#[allow(deprecated)]
fn ndarray_device() -> Device {
    Device::ndarray()
}

/// Whether the device can run a tensor operation (a wgpu device needs an adapter).
pub fn device_works(device: &Device) -> bool {
    let device = device.clone();
    let previous_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let works = catch_unwind(AssertUnwindSafe(|| {
        Tensor::<1>::ones([2], &device).sum().into_scalar::<f32>() == 2.0
    }))
    .unwrap_or(false);
    std::panic::set_hook(previous_hook);
    works
}

/// The devices cross-backend tests run on: flex and ndarray always, and wgpu where an adapter
/// exists.
///
/// - `MHA_TEST_DEVICES=flex,wgpu` restricts the list.
/// - Without an adapter, wgpu is skipped with a loud message on stderr — unless
///   `MHA_REQUIRE_WGPU=1`, which CI sets so that the GPU code path always runs: then the
///   missing adapter is a panic.
pub fn test_devices() -> Vec<(&'static str, Device)> {
    let wanted = std::env::var("MHA_TEST_DEVICES").ok();
    let require_wgpu = std::env::var("MHA_REQUIRE_WGPU").is_ok_and(|value| value == "1");
    let mut devices = Vec::new();
    for name in DEVICE_NAMES {
        if let Some(wanted) = &wanted
            && !wanted.split(',').any(|w| w.trim() == name)
        {
            continue;
        }
        let device = device_by_name(name).expect("known device name");
        if name == "wgpu" && !wgpu_available(&device) {
            assert!(
                !require_wgpu,
                "MHA_REQUIRE_WGPU=1 but no wgpu adapter works on this machine \
                 (install Mesa's Vulkan driver: apt-get install mesa-vulkan-drivers)"
            );
            eprintln!(
                "\n*** SKIPPING wgpu: no adapter found (apt-get install mesa-vulkan-drivers \
                 gives a software one); set MHA_REQUIRE_WGPU=1 to make this an error ***\n"
            );
            continue;
        }
        devices.push((name, device));
    }
    devices
}

fn wgpu_available(device: &Device) -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| device_works(device))
}

/// The largest absolute difference a numeric test accepts against a reference on `device`:
/// 1e-5 on the CPU backends, 1e-4 on wgpu, whose kernels sum in other orders (flash
/// attention's online softmax, tiled matmuls).
pub fn tolerance(device_name: &str) -> f32 {
    if device_name == "wgpu" { 1e-4 } else { 1e-5 }
}
