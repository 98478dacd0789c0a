//! Bad input panics with a message naming the argument, the expected and the actual shape.

mod common;

use burn::tensor::{Bool, Device, Tensor};
use common::panic_message;
use mha::{
    AttentionPath, BlockSizes, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig, NeedWeights,
};

fn zeros<const D: usize>(shape: [usize; D]) -> Tensor<D> {
    Tensor::zeros(shape, &Device::flex())
}

fn mask<const D: usize>(shape: [usize; D]) -> Tensor<D, Bool> {
    Tensor::zeros(shape, &Device::flex())
}

/// Cross-attention module: d_model 8, 2 heads, key width 6, value width 5.
fn module() -> MultiHeadAttention {
    MultiHeadAttentionConfig::new(8, 2)
        .with_d_key_input(Some(6))
        .with_d_value_input(Some(5))
        .init(&Device::flex())
}

/// batch 2, seq_q 3, seq_k 4.
fn good_input() -> MhaInput {
    MhaInput::new(zeros([2, 3, 8]), zeros([2, 4, 6]), zeros([2, 4, 5]))
}

#[test]
fn the_good_input_runs() {
    let output = module().forward(good_input());
    assert_eq!(output.context.dims(), [2, 3, 8]);
}

// Longer than most: a table of (bad input, exact message) rows, a row per check.
#[test]
fn every_bad_input_is_refused_with_a_clear_message() {
    let module = module();
    let self_module = MultiHeadAttentionConfig::new(8, 2).init(&Device::flex());
    let dropout_module = MultiHeadAttentionConfig::new(8, 2)
        .with_dropout(0.2)
        .init(&Device::flex().autodiff());
    let quiet_module = MultiHeadAttentionConfig::new(8, 2)
        .with_quiet_softmax(true)
        .init(&Device::flex());

    type Case<'a> = (&'static str, Box<dyn FnOnce() + 'a>, &'static str);
    let m = &module;
    let cases: Vec<Case> = vec![
        (
            "query width",
            Box::new(move || {
                m.forward(MhaInput::new(
                    zeros([2, 3, 7]),
                    zeros([2, 4, 6]),
                    zeros([2, 4, 5]),
                ));
            }),
            "`query` must have shape [batch, seq_q, d_model=8], got [2, 3, 7] (axis 2 `d_model` is 7)",
        ),
        (
            "key width",
            Box::new(move || {
                m.forward(MhaInput::new(
                    zeros([2, 3, 8]),
                    zeros([2, 4, 8]),
                    zeros([2, 4, 5]),
                ));
            }),
            "`key` must have shape [batch=2, seq_k, d_key_input=6], got [2, 4, 8] (axis 2 `d_key_input` is 8)",
        ),
        (
            "value width",
            Box::new(move || {
                m.forward(MhaInput::new(
                    zeros([2, 3, 8]),
                    zeros([2, 4, 6]),
                    zeros([2, 4, 6]),
                ));
            }),
            "`value` must have shape [batch=2, seq_k=4, d_value_input=5], got [2, 4, 6] (axis 2 `d_value_input` is 6)",
        ),
        (
            "key batch",
            Box::new(move || {
                m.forward(MhaInput::new(
                    zeros([2, 3, 8]),
                    zeros([3, 4, 6]),
                    zeros([2, 4, 5]),
                ));
            }),
            "`key` must have shape [batch=2, seq_k, d_key_input=6], got [3, 4, 6] (axis 0 `batch` is 3)",
        ),
        (
            "value batch",
            Box::new(move || {
                m.forward(MhaInput::new(
                    zeros([2, 3, 8]),
                    zeros([2, 4, 6]),
                    zeros([1, 4, 5]),
                ));
            }),
            "`value` must have shape [batch=2, seq_k=4, d_value_input=5], got [1, 4, 5] (axis 0 `batch` is 1)",
        ),
        (
            "value length",
            Box::new(move || {
                m.forward(MhaInput::new(
                    zeros([2, 3, 8]),
                    zeros([2, 4, 6]),
                    zeros([2, 5, 5]),
                ));
            }),
            "`value` must have shape [batch=2, seq_k=4, d_value_input=5], got [2, 5, 5] (axis 1 `seq_k` is 5)",
        ),
        (
            "self-attention on a cross-attention module",
            Box::new(move || {
                m.forward(MhaInput::self_attn(zeros([2, 3, 8])));
            }),
            "`key` must have shape [batch=2, seq_k, d_key_input=6], got [2, 3, 8]",
        ),
        (
            "padding batch",
            Box::new(move || {
                m.forward(good_input().key_padding_mask(mask([1, 4])));
            }),
            "`key_padding_mask` must have shape [batch=2, seq_k=4], got [1, 4] (axis 0 `batch` is 1)",
        ),
        (
            "padding length",
            Box::new(move || {
                m.forward(good_input().key_padding_mask(mask([2, 3])));
            }),
            "`key_padding_mask` must have shape [batch=2, seq_k=4], got [2, 3] (axis 1 `seq_k` is 3)",
        ),
        (
            "2-D mask query length",
            Box::new(move || {
                m.forward(good_input().attn_mask(mask([4, 4])));
            }),
            "`attn_mask` must have shape [seq_q=3, seq_k=4] (rank 2; a batch or head axis of size 1 broadcasts), got [4, 4]",
        ),
        (
            "2-D float mask key length",
            Box::new(move || {
                m.forward(good_input().attn_mask(zeros([3, 5])));
            }),
            "`attn_mask` must have shape [seq_q=3, seq_k=4] (rank 2; a batch or head axis of size 1 broadcasts), got [3, 5]",
        ),
        (
            "3-D mask batch",
            Box::new(move || {
                m.forward(good_input().attn_mask(mask([3, 3, 4])));
            }),
            "`attn_mask` must have shape [batch=2, seq_q=3, seq_k=4] (rank 3; a batch or head axis of size 1 broadcasts), got [3, 3, 4]",
        ),
        (
            "4-D mask heads",
            Box::new(move || {
                m.forward(good_input().attn_mask(mask([2, 3, 3, 4])));
            }),
            "`attn_mask` must have shape [batch=2, n_heads=2, seq_q=3, seq_k=4] (rank 4; a batch or head axis of size 1 broadcasts), got [2, 3, 3, 4]",
        ),
        (
            "1-D mask",
            Box::new(move || {
                m.forward(good_input().attn_mask(mask([4])));
            }),
            "`attn_mask` must have rank 2 [seq_q, seq_k], 3 [batch, seq_q, seq_k] or 4 [batch, n_heads, seq_q, seq_k], got rank 1 with shape [4]",
        ),
        (
            "5-D float mask",
            Box::new(move || {
                m.forward(good_input().attn_mask(zeros([1, 2, 2, 3, 4])));
            }),
            "`attn_mask` must have rank 2 [seq_q, seq_k], 3 [batch, seq_q, seq_k] or 4 [batch, n_heads, seq_q, seq_k], got rank 5",
        ),
        (
            "empty key sequence",
            Box::new(move || {
                m.forward(MhaInput::new(
                    zeros([2, 3, 8]),
                    zeros([2, 0, 6]),
                    zeros([2, 0, 5]),
                ));
            }),
            "`query` and `key` must have a non-empty batch and sequence, got query [2, 3, 8] and key [2, 0, 6]",
        ),
        (
            "fused path with weights",
            Box::new(move || {
                m.forward(
                    good_input()
                        .need_weights(NeedWeights::PerHead)
                        .path(AttentionPath::Fused),
                );
            }),
            "`AttentionPath::Fused` was forced but attention weights are requested",
        ),
        (
            "fused path with dropout",
            Box::new(move || {
                let x = Tensor::<3>::zeros([1, 2, 8], &Device::flex().autodiff());
                dropout_module.forward(MhaInput::self_attn(x).path(AttentionPath::Fused));
            }),
            "`AttentionPath::Fused` was forced but dropout is active",
        ),
        (
            "fused path with quiet softmax",
            Box::new(move || {
                quiet_module
                    .forward(MhaInput::self_attn(zeros([1, 2, 8])).path(AttentionPath::Fused));
            }),
            "`AttentionPath::Fused` was forced but the softmax has a sink (attention sinks or the quiet softmax)",
        ),
        (
            "chunked path with empty blocks",
            Box::new(move || {
                m.forward(
                    good_input().path(AttentionPath::Chunked(BlockSizes { query: 0, key: 4 })),
                );
            }),
            "`AttentionPath::Chunked` needs positive block sizes, got BlockSizes { query: 0, key: 4 }",
        ),
        (
            "flash path with empty blocks",
            Box::new(move || {
                m.forward(good_input().path(AttentionPath::Flash(BlockSizes { query: 2, key: 0 })));
            }),
            "`AttentionPath::Flash` needs positive block sizes, got BlockSizes { query: 2, key: 0 }",
        ),
        (
            "self-attention width",
            Box::new(move || {
                self_module.forward(MhaInput::self_attn(zeros([1, 2, 4])));
            }),
            "`query` must have shape [batch, seq_q, d_model=8], got [1, 2, 4]",
        ),
    ];
    assert!(cases.len() >= 15);
    for (label, run, expected) in cases {
        let message = panic_message(run);
        assert!(
            message.contains(expected),
            "{label}: panic message\n  {message}\nshould contain\n  {expected}"
        );
    }
}
