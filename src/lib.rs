//! Support shared by the workspace root's examples and end-to-end tests: choosing a Burn device
//! by name. The library itself is the `mha` crate (`crates/mha`), whose integration tests
//! share the same device list.

#[path = "../crates/mha/tests/common/devices.rs"]
mod devices;

pub use devices::{DEVICE_NAMES, device_by_name, device_works, test_devices, tolerance};

/// Reads `[--device flex|ndarray|wgpu]` (default `flex`) from the command line of `program`;
/// on a bad argument, prints a one-line error with the usage and exits with status 2.
pub fn device_from_args(program: &str) -> (String, burn::tensor::Device) {
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
