//! The memory figure the benches report, shared through `#[path]`.

/// This process's peak resident set size in MiB (`VmHWM` of `/proc/self/status`; NaN where
/// there is none). On lavapipe, wgpu's software Vulkan driver, device memory is host memory and
/// counts too.
pub fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|line| line.starts_with("VmHWM:"))
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|kib| kib.parse::<f64>().ok())
        .map_or(f64::NAN, |kib| kib / 1024.0)
}
