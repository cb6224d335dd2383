"""make_forward: the eager forward, or CUDA graphs of it when its `ForwardSpec` asks on a GPU."""

from __future__ import annotations

from infer.cache.protocol import CachePoolProtocol
from infer.engine.executor.forward import EagerForward, ForwardFn
from infer.engine.executor.spec import ForwardSpec
from infer.models.llama import LlamaForCausalLM

__all__ = ["EagerForward", "ForwardFn", "ForwardSpec", "make_forward"]


def make_forward(model: LlamaForCausalLM, pool: CachePoolProtocol, spec: ForwardSpec) -> ForwardFn:
    """CUDA graphs of the spec's shapes when it asks for them on a CUDA device, else eager.

    `spec.kernels` serve every step, captured or eager (a fused bundle is compiled for
    dynamic shapes, so a prefill chunk's rows meet the same compiled kernels).
    """
    device = next(model.parameters()).device
    if not (spec.use_cuda_graphs and device.type == "cuda"):
        return EagerForward(model, pool, spec.kernels)
    from infer.engine.executor.capture import capture_sizes
    from infer.engine.executor.graphs import GraphForward
    return GraphForward(model, pool, capture_sizes(spec.max_batch_size), spec.shapes, kernels=spec.kernels,
                        sample_widths=spec.sample_widths, small_batch_shapes=spec.small_batch_shapes,
                        verify_modes=spec.verify_modes, sampling_batch_max=spec.sampling_batch_max,
                        draft_probs=spec.draft_probs)
