//! The Burn devices the tests and examples run on, chosen by name. Shared by the `mha` crate's
//! integration tests and (through `#[path]`) the workspace root's examples and tests.

use std::io::Write;
use std::panic::{AssertUnwindSafe, catch_unwind};

use burn::tensor::{Device, Tensor};

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
        #[cfg(feature = "wgpu")]
        "wgpu" => Ok(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)),
        // The workspace root builds wgpu only when asked for (it is most of a cold build).
        #[cfg(not(feature = "wgpu"))]
        "wgpu" => Err("this build has no wgpu backend: add `--features wgpu`".to_string()),
        other => Err(format!(
            "unknown device `{other}`; available: {}",
            DEVICE_NAMES.join(", ")
        )),
    }
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

/// The devices cross-backend tests run on: flex, ndarray and wgpu.
///
/// - `MHA_TEST_DEVICES=flex,wgpu` restricts the list; an unknown name or an empty list is a
///   panic, so that a typo cannot make every test pass on no device.
/// - `MHA_REQUIRE_WGPU=1` (CI sets it) makes a missing wgpu adapter, or a device list without
///   wgpu, a panic, so that the GPU code path always runs there.
/// - Otherwise a missing adapter skips wgpu with a message written past the test harness's
///   output capture, so that it shows in the run's output even when every test passes.
pub fn test_devices() -> Vec<(&'static str, Device)> {
    let require_wgpu = std::env::var("MHA_REQUIRE_WGPU").is_ok_and(|value| value == "1");
    devices_from(
        std::env::var("MHA_TEST_DEVICES").ok().as_deref(),
        require_wgpu,
    )
}

/// [`test_devices`] for a device list (`None`: all) and a wgpu requirement.
pub fn devices_from(list: Option<&str>, require_wgpu: bool) -> Vec<(&'static str, Device)> {
    let wanted: Vec<String> = match list {
        Some(list) => list
            .split(',')
            .map(|name| name.trim().to_string())
            .collect(),
        None => DEVICE_NAMES.iter().map(|name| name.to_string()).collect(),
    };
    for name in &wanted {
        assert!(
            DEVICE_NAMES.contains(&name.as_str()),
            "MHA_TEST_DEVICES names unknown device `{name}`; known: {}",
            DEVICE_NAMES.join(", ")
        );
    }
    assert!(
        !require_wgpu || wanted.iter().any(|name| name == "wgpu"),
        "MHA_REQUIRE_WGPU=1 but MHA_TEST_DEVICES leaves wgpu out"
    );
    let mut devices = Vec::new();
    for name in DEVICE_NAMES {
        if !wanted.iter().any(|wanted| wanted == name) {
            continue;
        }
        let device = device_by_name(name).expect("known device name");
        if name == "wgpu" && !wgpu_available(&device) {
            assert!(
                !require_wgpu,
                "MHA_REQUIRE_WGPU=1 but no wgpu adapter works on this machine \
                 (install Mesa's Vulkan driver: apt-get install mesa-vulkan-drivers)"
            );
            announce_wgpu_skip();
            continue;
        }
        devices.push((name, device));
    }
    assert!(
        !devices.is_empty(),
        "no test device left (MHA_TEST_DEVICES={wanted:?})"
    );
    devices
}

fn wgpu_available(device: &Device) -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| device_works(device))
}

/// Writes the skip once per test binary, straight to the process's stderr: the harness
/// captures `eprintln!` of passing tests, not writes to the stream itself.
fn announce_wgpu_skip() {
    static ANNOUNCED: std::sync::Once = std::sync::Once::new();
    ANNOUNCED.call_once(|| {
        let _ = writeln!(
            std::io::stderr(),
            "\n*** SKIPPING wgpu: no adapter found (apt-get install mesa-vulkan-drivers gives a \
             software one); set MHA_REQUIRE_WGPU=1 to make this an error ***\n"
        );
    });
}

/// The largest absolute difference a numeric test accepts against a reference on `device`:
/// 1e-5 on the CPU backends, 1e-4 on wgpu, whose kernels sum in other orders (flash
/// attention's online softmax, tiled matmuls).
pub fn tolerance(device_name: &str) -> f32 {
    if device_name == "wgpu" { 1e-4 } else { 1e-5 }
}
