//! Support shared by the workspace root's examples and end-to-end tests: choosing a Burn device
//! by name. The library itself is the `mha` crate (`crates/mha`), whose integration tests
//! share the same device list.

#[path = "../crates/mha/tests/common/devices.rs"]
mod devices;

pub use devices::{DEVICE_NAMES, device_by_name, device_works, test_devices, tolerance};

/// Reads `[--device flex|ndarray|wgpu]` (default `flex`) from the command line of `program`;
/// on a bad argument, prints a one-line error with the usage and exits with status 2.
pub fn device_from_args(program: &str) -> (String, burn::tensor::Device) {
    let (name, device, _) = device_and_options(program, &[]);
    (name, device)
}

/// [`device_from_args`] for a program with options of its own: each `options` entry is a flag
/// and what its value is (for the usage line, `("--window", "N")`); returns the device and, for
/// each flag given, its value, in the order of `options`.
pub fn device_and_options(
    program: &str,
    options: &[(&str, &str)],
) -> (String, burn::tensor::Device, Vec<Option<String>>) {
    let own: String = options
        .iter()
        .map(|(flag, value)| format!(" [{flag} {value}]"))
        .collect();
    let usage = format!(
        "usage: {program} [--device {}]{own}",
        DEVICE_NAMES.join("|")
    );
    let fail = |message: String| -> ! {
        eprintln!("error: {message}; {usage}");
        std::process::exit(2)
    };
    let mut args = std::env::args().skip(1);
    let mut name = String::from("flex");
    let mut values = vec![None; options.len()];
    while let Some(arg) = args.next() {
        let mut value_of = |flag: &str| {
            args.next()
                .unwrap_or_else(|| fail(format!("`{flag}` needs a value")))
        };
        match arg.as_str() {
            "--device" => name = value_of("--device"),
            "--help" | "-h" => {
                println!("{usage}");
                std::process::exit(0)
            }
            other => match options.iter().position(|(flag, _)| *flag == other) {
                Some(index) => values[index] = Some(value_of(other)),
                None => fail(format!("unexpected argument `{other}`")),
            },
        }
    }
    let device = device_by_name(&name).unwrap_or_else(|error| fail(error));
    (name, device, values)
}
