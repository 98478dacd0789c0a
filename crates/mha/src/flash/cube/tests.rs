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
        executor: Executor::Software,
    }
}

/// [`taken`] changed by `change`.
fn with(change: impl FnOnce(&mut CallTraits)) -> CallTraits {
    let mut call = taken();
    change(&mut call);
    call
}

/// The kernels take f32, f16 and bf16 calls with or without a bias of the inputs' type, and
/// leave to the generic body (one decision per call, forward and backward alike) sinks,
/// segments, mixed or other float types, heads wider than they keep in registers, and empty
/// axes, as the module docs say.
#[test]
fn the_kernels_take_the_calls_the_module_docs_say_and_no_others() {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let same = with(|c| (c.query, c.key, c.value, c.bias) = (dtype, dtype, dtype, Some(dtype)));
        assert!(same.taken(), "{dtype:?}");
        assert!(
            CallTraits { bias: None, ..same }.taken(),
            "{dtype:?} without a bias"
        );
    }
    let refused: [(&str, CallTraits); 11] = [
        ("sinks", with(|c| c.sinks = true)),
        ("segments", with(|c| c.segments = true)),
        (
            "f64",
            with(|c| {
                (c.query, c.key, c.value, c.bias) = (DType::F64, DType::F64, DType::F64, None)
            }),
        ),
        ("a key of another type", with(|c| c.key = DType::F16)),
        ("a value of another type", with(|c| c.value = DType::BF16)),
        (
            "a bias of another type",
            with(|c| c.bias = Some(DType::F16)),
        ),
        (
            "wide heads",
            with(|c| c.geometry.head_dim = MAX_HEAD_DIM + 1),
        ),
        (
            "wide values",
            with(|c| c.geometry.value_dim = MAX_HEAD_DIM + 1),
        ),
        ("no queries", with(|c| c.geometry.seq_q = 0)),
        ("no keys", with(|c| c.geometry.seq_k = 0)),
        ("no batch", with(|c| c.geometry.batch = 0)),
    ];
    for (what, call) in refused {
        assert!(!call.taken(), "{what}");
    }
    let widest =
        with(|c| (c.geometry.head_dim, c.geometry.value_dim) = (MAX_HEAD_DIM, MAX_HEAD_DIM));
    assert!(widest.taken(), "the widest heads");
}
