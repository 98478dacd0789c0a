//! The backends compiled in (by Cargo feature) and the device for each.

use burn::tensor::Device;

/// Names of the devices this build can train on, in the order of the features.
pub fn available() -> Vec<&'static str> {
    [
        (cfg!(feature = "flex"), "flex"),
        (cfg!(feature = "ndarray"), "ndarray"),
        (cfg!(feature = "wgpu"), "wgpu"),
        (cfg!(feature = "vulkan"), "vulkan"),
        (cfg!(feature = "metal"), "metal"),
        (cfg!(feature = "cuda"), "cuda"),
    ]
    .into_iter()
    .filter_map(|(enabled, name)| enabled.then_some(name))
    .collect()
}

/// The device called `name` (`cuda:1` for a CUDA device's index), or an error listing the
/// compiled-in ones.
pub fn by_name(name: &str) -> Result<Device, String> {
    let (name, index) = match name.split_once(':') {
        Some((name, index)) => (
            name,
            index
                .parse::<usize>()
                .map_err(|_| format!("device `{name}:{index}`: the index is not a number"))?,
        ),
        None => (name, 0),
    };
    if index != 0 && name != "cuda" {
        return Err(format!(
            "device `{name}:{index}`: only CUDA devices take an index"
        ));
    }
    let device = match name {
        #[cfg(feature = "flex")]
        "flex" => Device::flex(),
        #[cfg(feature = "ndarray")]
        "ndarray" => ndarray(),
        #[cfg(feature = "wgpu")]
        "wgpu" => Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
        #[cfg(feature = "vulkan")]
        "vulkan" => Device::vulkan(burn::tensor::DeviceKind::DefaultDevice),
        #[cfg(feature = "metal")]
        "metal" => Device::metal(burn::tensor::DeviceKind::DefaultDevice),
        #[cfg(feature = "cuda")]
        "cuda" => Device::cuda(index),
        other => {
            return Err(format!(
                "device `{other}` is not compiled in; available: {} (enable others with \
                 `--features ndarray,wgpu,vulkan,metal,cuda`)",
                available().join(", ")
            ));
        }
    };
    Ok(device)
}

/// burn-ndarray is deprecated upstream but still shipped; this is the one place building it.
#[cfg(feature = "ndarray")]
#[allow(deprecated)]
fn ndarray() -> Device {
    Device::ndarray()
}
