//! The flash op under autodiff: one node over q, k, v (and the sinks when a call has them)
//! whose state is the inputs, the output and each query's softmax statistics, never a score
//! block, and whose backward is the backend's [`FlashKernels::backward_kernel`].

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, NodeGuard, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend};

use super::inputs::{FlashForward, FlashGrads, FlashInputs, FlashParams, FlashState};
use super::{FlashAttentionBackend, FlashKernels};
use crate::extension::{MaybeBool, MaybeFloat};

impl<B: FlashKernels, C: CheckpointStrategy> FlashAttentionBackend for Autodiff<B, C> {
    fn flash_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        bias: MaybeFloat<Self>,
        forbid: MaybeBool<Self>,
        sinks: MaybeFloat<Self>,
        params: FlashParams,
    ) -> FloatTensor<Self> {
        let nodes = [query.node(), key.node(), value.node()];
        let inputs = FlashInputs::new(query, key, value, bias, forbid, sinks, params);
        let sinks_node = inputs.sinks.as_ref().map(|sinks| sinks.node());
        let inputs = inner::<B, C>(inputs);
        match sinks_node {
            None => record::<B, C, 3>(nodes, inputs),
            Some(sinks) => {
                let [query, key, value] = nodes;
                record::<B, C, 4>([query, key, value, sinks], inputs)
            }
        }
    }

    fn flash_attention_weights(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        bias: MaybeFloat<Self>,
        forbid: MaybeBool<Self>,
        sinks: MaybeFloat<Self>,
        params: FlashParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let inputs = FlashInputs::new(query, key, value, bias, forbid, sinks, params);
        let tracked = [Some(&inputs.query), Some(&inputs.key), Some(&inputs.value)]
            .into_iter()
            .chain([inputs.sinks.as_ref()])
            .flatten()
            .any(|tensor| tensor.is_tracked());
        // The dispatch sends weights requests on autodiff devices to the explicit path; this
        // guards any other caller against gradients that would silently go missing.
        assert!(
            !tracked,
            "flash attention: the weights are computed for inference and cannot carry a \
             gradient; use the explicit path when an input requires one"
        );
        let (output, weights) = B::weights_kernel(&inner::<B, C>(inputs));
        (Self::from_inner(output), Self::from_inner(weights))
    }
}

/// The inputs on the backend under autodiff (the bias is a constant to the op).
fn inner<B: FlashKernels, C: CheckpointStrategy>(
    inputs: FlashInputs<Autodiff<B, C>>,
) -> FlashInputs<B> {
    FlashInputs {
        query: inputs.query.into_primitive(),
        key: inputs.key.into_primitive(),
        value: inputs.value.into_primitive(),
        bias: inputs.bias.map(|bias| bias.into_primitive()),
        forbid: inputs.forbid,
        sinks: inputs.sinks.map(|sinks| sinks.into_primitive()),
        params: inputs.params,
    }
}

/// Runs the forward and, when a parent is tracked, records the node that will run the
/// backward: parents q, k, v, and the sinks when the call has them.
fn record<B: FlashKernels, C: CheckpointStrategy, const N: usize>(
    nodes: [NodeGuard; N],
    inputs: FlashInputs<B>,
) -> FloatTensor<Autodiff<B, C>>
where
    FlashAttentionBackward<N>: Backward<B, N, State = FlashState<B>>,
{
    match FlashAttentionBackward::<N>
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let FlashForward {
                output,
                softmax_stats,
            } = B::forward_kernel(&inputs);
            let state = FlashState {
                inputs,
                output: output.clone(),
                softmax_stats,
            };
            prep.finish(state, output)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::forward_kernel(&inputs).output),
    }
}

/// The flash op's autodiff node over `N` parents: q, k, v, and the sinks when a call has them.
#[derive(Debug)]
pub(crate) struct FlashAttentionBackward<const N: usize>;

impl<B: FlashKernels, const N: usize> Backward<B, N> for FlashAttentionBackward<N> {
    type State = FlashState<B>;

    /// Registers one gradient for each tracked parent, exactly once (what data-parallel
    /// training's per-parameter gradient sync counts on).
    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let output_grad = grads.consume::<B>(&ops.node);
        let execution = ops.state.inputs.params.execution.clone();
        let FlashGrads {
            query,
            key,
            value,
            sinks,
        } = B::backward_kernel(&ops.state, output_grad);
        let computed = [Some(query), Some(key), Some(value), sinks];
        let declared = ops
            .node
            .parents
            .iter()
            .map(|parent| parent.id.value)
            .collect();
        let mut registered = Vec::new();
        for (node, grad) in ops.parents.into_iter().zip(computed) {
            if let (Some(node), Some(grad)) = (node, grad) {
                registered.push(node.id.value);
                grads.register::<B>(node.id, grad);
            }
        }
        execution.note_registered(declared, registered);
    }
}
