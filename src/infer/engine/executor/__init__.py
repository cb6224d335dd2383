"""make_forward: a model's one flat forward through its pool, eager or CUDA graphs of it."""

from __future__ import annotations

from infer.cache.protocol import CachePoolProtocol
from infer.engine.executor.batch_forward import EagerBatchForward, GraphBatchForward
from infer.engine.executor.forward import ForwardFn
from infer.engine.executor.spec import ForwardSpec
from infer.models.llama import LlamaForCausalLM

__all__ = ["ForwardFn", "ForwardSpec", "make_forward"]


def make_forward(model: LlamaForCausalLM, pool: CachePoolProtocol, spec: ForwardSpec) -> ForwardFn:
    """The model's one flat forward through the pool, CUDA graphs of it by token count when
    the spec asks for them on a CUDA device; `spec.kernels` serve every pass."""
    device = next(model.parameters()).device
    if not (spec.use_cuda_graphs and device.type == "cuda"):
        return EagerBatchForward(model, pool, spec.kernels)
    from infer.engine.executor.capture import capture_sizes, graph_context_width
    return GraphBatchForward(model, pool, capture_sizes(spec.max_tokens), spec.max_batch_size,
                             graph_context_width(pool.max_seq_len), spec.kernels, trees=spec.trees)
