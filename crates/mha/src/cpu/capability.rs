//! Which instruction set the CPU kernels run: the widest this CPU has, unless the environment
//! caps it, as PyTorch's `ATEN_CPU_CAPABILITY` caps ATen's.
//!
//! Why a cap: each kernel has a copy per instruction set, and a machine runs only its widest.
//! With `MHA_CPU_CAPABILITY=avx2` (or `default`) an AVX-512 machine runs the copies an AVX2
//! (or a baseline) machine runs, so that the tests hold every copy to the same answers on any
//! machine, and a user can rule a copy out when chasing a difference between machines.

use std::sync::OnceLock;

/// The environment variable that caps [`cpu_capability`]: `default`, `avx2` or `avx512`.
pub const CPU_CAPABILITY_VARIABLE: &str = "MHA_CPU_CAPABILITY";

/// Instruction sets the CPU kernels have a copy for, narrowest first (so that `min` caps).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CpuCapability {
    /// The build's baseline: the lane loops as the compiler vectorises them for the target
    /// alone (SSE2 on x86-64, NEON on aarch64).
    Default,
    /// AVX2 with FMA and F16C (x86-64).
    Avx2,
    /// AVX-512F, with AVX2, FMA and F16C (x86-64).
    Avx512,
}

impl CpuCapability {
    /// Every capability, narrowest first.
    pub const ALL: [CpuCapability; 3] = [
        CpuCapability::Default,
        CpuCapability::Avx2,
        CpuCapability::Avx512,
    ];

    /// The name [`CPU_CAPABILITY_VARIABLE`] takes for it: `default`, `avx2` or `avx512`.
    pub fn name(self) -> &'static str {
        match self {
            CpuCapability::Default => "default",
            CpuCapability::Avx2 => "avx2",
            CpuCapability::Avx512 => "avx512",
        }
    }

    /// The capability [`name`](Self::name) gives, if any (case-insensitive).
    pub fn from_name(name: &str) -> Option<CpuCapability> {
        Self::ALL
            .into_iter()
            .find(|capability| capability.name().eq_ignore_ascii_case(name.trim()))
    }

    /// The widest capability this CPU has, whatever the environment says.
    pub fn detected() -> CpuCapability {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c");
            if avx2 && std::arch::is_x86_feature_detected!("avx512f") {
                return CpuCapability::Avx512;
            }
            if avx2 {
                return CpuCapability::Avx2;
            }
        }
        CpuCapability::Default
    }
}

/// The instruction set the CPU kernels run in this process: [`CpuCapability::detected`],
/// capped by `MHA_CPU_CAPABILITY` where it is set ([`CPU_CAPABILITY_VARIABLE`]; a cap above
/// what the CPU has changes nothing). Read once, at the first kernel call, so that every call
/// of a process (a forward and its backward's recomputation) runs the same copies.
///
/// The GEMMs that flex and ndarray run (the `gemm` and BLAS crates) choose their own.
///
/// # Panics
///
/// If `MHA_CPU_CAPABILITY` is set to something other than `default`, `avx2` or `avx512`.
pub fn cpu_capability() -> CpuCapability {
    static CAPABILITY: OnceLock<CpuCapability> = OnceLock::new();
    *CAPABILITY.get_or_init(|| {
        let requested = std::env::var(CPU_CAPABILITY_VARIABLE).ok();
        capped(requested.as_deref(), CpuCapability::detected())
    })
}

/// `detected`, capped by the `requested` name where there is one.
///
/// # Panics
///
/// If `requested` names no capability.
fn capped(requested: Option<&str>, detected: CpuCapability) -> CpuCapability {
    match requested {
        None => detected,
        Some(name) if name.trim().is_empty() => detected,
        Some(name) => {
            let cap = CpuCapability::from_name(name).unwrap_or_else(|| {
                panic!("{CPU_CAPABILITY_VARIABLE}: `default`, `avx2` or `avx512`, not {name:?}")
            });
            cap.min(detected)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cap lowers the detected capability and never raises it; unset or empty leaves it.
    #[test]
    fn a_cap_lowers_and_never_raises() {
        for detected in CpuCapability::ALL {
            assert_eq!(capped(None, detected), detected);
            assert_eq!(capped(Some(""), detected), detected);
            for cap in CpuCapability::ALL {
                assert_eq!(capped(Some(cap.name()), detected), cap.min(detected));
            }
        }
        assert_eq!(
            capped(Some(" AVX2 "), CpuCapability::Avx512),
            CpuCapability::Avx2
        );
    }

    #[test]
    #[should_panic(expected = "MHA_CPU_CAPABILITY: `default`, `avx2` or `avx512`, not \"sse9\"")]
    fn an_unknown_cap_is_refused_by_name() {
        capped(Some("sse9"), CpuCapability::Avx512);
    }

    /// What this process runs is what its environment asks for: the CI runs the tests again
    /// under `MHA_CPU_CAPABILITY=avx2` and `default`, and this test fails there if the cap did
    /// not take.
    #[test]
    fn the_process_runs_what_its_environment_asks_for() {
        let requested = std::env::var(CPU_CAPABILITY_VARIABLE).ok();
        assert_eq!(
            cpu_capability(),
            capped(requested.as_deref(), CpuCapability::detected())
        );
        if let Some(cap) = requested.as_deref().and_then(CpuCapability::from_name) {
            assert!(cpu_capability() <= cap);
        }
    }
}
