//! Support shared by the workspace root's examples and end-to-end tests: choosing a Burn device
//! by name, and what the serving examples share ([`serving`]). The library itself is the `mha`
//! crate (`crates/mha`), whose integration tests share the same device list.

#[path = "../crates/mha/tests/common/devices.rs"]
mod devices;
pub mod serving;

pub use devices::{DEVICE_NAMES, device_by_name, device_works, test_devices, tolerance};

/// Reads `[--device flex|ndarray|wgpu]` (default `flex`) from the command line of `program`;
/// on a bad argument, prints a one-line error with the usage and exits with status 2.
pub fn device_from_args(program: &str) -> (String, burn::tensor::Device) {
    let (name, device, _) = device_and_options(program, &[]);
    (name, device)
}

/// [`device_from_args`] for a program with options of its own: each `options` entry is a flag
/// and what its value is (for the usage line, `("--window", "N")`). Returns the device and the
/// values given.
pub fn device_and_options(
    program: &str,
    options: &[(&str, &str)],
) -> (String, burn::tensor::Device, ProgramOptions) {
    let own: String = options
        .iter()
        .map(|(flag, value)| format!(" [{flag} {value}]"))
        .collect();
    let usage = format!(
        "usage: {program} [--device {}]{own}",
        DEVICE_NAMES.join("|")
    );
    let mut given = ProgramOptions {
        usage,
        values: options
            .iter()
            .map(|(flag, _)| (flag.to_string(), None))
            .collect(),
    };
    let mut args = std::env::args().skip(1);
    let mut name = String::from("flex");
    while let Some(arg) = args.next() {
        let mut value_of = |flag: &str| {
            args.next()
                .unwrap_or_else(|| given.fail(&format!("`{flag}` needs a value")))
        };
        match arg.as_str() {
            "--device" => name = value_of("--device"),
            "--help" | "-h" => {
                println!("{}", given.usage);
                std::process::exit(0)
            }
            other => match given.values.iter().position(|(flag, _)| flag == other) {
                Some(index) => {
                    let value = value_of(other);
                    given.values[index].1 = Some(value);
                }
                None => given.fail(&format!("unexpected argument `{other}`")),
            },
        }
    }
    let device = device_by_name(&name).unwrap_or_else(|error| given.fail(&error));
    (name, device, given)
}

/// A program's own options as [`device_and_options`] read them from its command line.
pub struct ProgramOptions {
    usage: String,
    /// Each flag and the value given for it, if any.
    values: Vec<(String, Option<String>)>,
}

impl ProgramOptions {
    /// The value given for `flag`, if it was given.
    ///
    /// # Panics
    ///
    /// If `flag` is not one of the program's options.
    pub fn value(&self, flag: &str) -> Option<&str> {
        let (_, value) = self
            .values
            .iter()
            .find(|(own, _)| own == flag)
            .unwrap_or_else(|| panic!("`{flag}` is not an option of the program"));
        value.as_deref()
    }

    /// The number given for `flag`, if it was given: a whole number of at least `least`, or
    /// else the program exits as [`fail`](Self::fail) with ``"`flag` takes {what}, not
    /// `value`"``.
    ///
    /// # Panics
    ///
    /// If `flag` is not one of the program's options.
    pub fn number(&self, flag: &str, least: usize, what: &str) -> Option<usize> {
        self.value(flag).map(|value| match value.parse::<usize>() {
            Ok(number) if number >= least => number,
            _ => self.fail(&format!("`{flag}` takes {what}, not `{value}`")),
        })
    }

    /// Prints `message` with the usage line and exits with status 2: a bad argument.
    pub fn fail(&self, message: &str) -> ! {
        eprintln!("error: {message}; {}", self.usage);
        std::process::exit(2)
    }
}
