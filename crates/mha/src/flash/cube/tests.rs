use super::*;

/// A call the kernels take: f32 throughout, GQA, no sinks or segments.
fn taken() -> CallTraits {
    CallTraits {
        query: DType::F32,
        key: DType::F32,
        value: DType::F32,
        bias: Some(DType::F32),
        sinks: false,
        segments: false,
        geometry: Geometry {
            batch: 2,
            n_heads: 4,
            n_kv_heads: 2,
            seq_q: 5,
            seq_k: 7,
            head_dim: 64,
            value_dim: 32,
        },
    }
}

/// The kernels take f32, f16 and bf16 calls with or without a bias of the inputs' type, and
/// leave to the generic body (one decision per call, forward and backward alike) sinks,
/// segments, mixed or other float types, heads wider than they keep in registers, and empty
/// axes, as the module docs say.
#[test]
fn the_kernels_take_the_calls_the_module_docs_say_and_no_others() {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let same = CallTraits {
            query: dtype,
            key: dtype,
            value: dtype,
            bias: Some(dtype),
            ..taken()
        };
        assert!(same.taken(), "{dtype:?}");
        assert!(
            CallTraits { bias: None, ..same }.taken(),
            "{dtype:?} without a bias"
        );
    }
    let geometry = taken().geometry;
    let refused = [
        (
            "sinks",
            CallTraits {
                sinks: true,
                ..taken()
            },
        ),
        (
            "segments",
            CallTraits {
                segments: true,
                ..taken()
            },
        ),
        (
            "f64",
            CallTraits {
                query: DType::F64,
                key: DType::F64,
                value: DType::F64,
                bias: None,
                ..taken()
            },
        ),
        (
            "a key of another type",
            CallTraits {
                key: DType::F16,
                ..taken()
            },
        ),
        (
            "a value of another type",
            CallTraits {
                value: DType::BF16,
                ..taken()
            },
        ),
        (
            "a bias of another type",
            CallTraits {
                bias: Some(DType::F16),
                ..taken()
            },
        ),
        (
            "wide heads",
            CallTraits {
                geometry: Geometry {
                    head_dim: MAX_HEAD_DIM + 1,
                    ..geometry
                },
                ..taken()
            },
        ),
        (
            "wide values",
            CallTraits {
                geometry: Geometry {
                    value_dim: MAX_HEAD_DIM + 1,
                    ..geometry
                },
                ..taken()
            },
        ),
        (
            "no queries",
            CallTraits {
                geometry: Geometry {
                    seq_q: 0,
                    ..geometry
                },
                ..taken()
            },
        ),
        (
            "no keys",
            CallTraits {
                geometry: Geometry {
                    seq_k: 0,
                    ..geometry
                },
                ..taken()
            },
        ),
        (
            "no batch",
            CallTraits {
                geometry: Geometry {
                    batch: 0,
                    ..geometry
                },
                ..taken()
            },
        ),
    ];
    for (what, call) in refused {
        assert!(!call.taken(), "{what}");
    }
    let widest = Geometry {
        head_dim: MAX_HEAD_DIM,
        value_dim: MAX_HEAD_DIM,
        ..geometry
    };
    assert!(
        CallTraits {
            geometry: widest,
            ..taken()
        }
        .taken(),
        "the widest heads"
    );
}
