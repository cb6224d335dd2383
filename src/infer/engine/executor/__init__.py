"""make_forward: the eager forward, or CUDA graphs of it when enabled on a GPU."""

from __future__ import annotations

from infer.engine.executor.forward import EagerForward, ForwardFn
from infer.cache.protocol import CachePoolProtocol
from infer.models.kernels import EAGER, Kernels
from infer.models.llama import LlamaForCausalLM

__all__ = ["EagerForward", "ForwardFn", "make_forward"]


def make_forward(model: LlamaForCausalLM, pool: CachePoolProtocol, use_cuda_graphs: bool, max_batch_size: int,
                 shapes: list[tuple[int, bool]], kernels: Kernels = EAGER,
                 sample_widths: tuple[int, ...] = (),
                 small_batch_shapes: list[tuple[int, bool]] | None = None,
                 verify_modes: tuple[str, ...] = (), sampling_batch_max: int | None = None) -> ForwardFn:
    """Graphs of the given (width, all_logits) shapes on CUDA when asked for, else eager.

    `kernels` serve these fixed, small shapes only (decode, draft steps, verification);
    prefill always runs the eager kernels, so compiled kernels never see its many shapes.
    `sample_widths`: last-token widths also captured with temperature sampling (draft steps);
    `small_batch_shapes`: shapes captured for batch buckets up to `sampling_batch_max` only
    (None: GraphForward's default), as are the sampling graphs and `verify_modes`:
    rejection sampling captured after verification (see GraphForward).
    """
    device = next(model.parameters()).device
    if not (use_cuda_graphs and device.type == "cuda"):
        return EagerForward(model, pool, kernels)
    from infer.engine.executor.graphs import SMALL_BATCH_MAX, GraphForward, batch_buckets
    return GraphForward(model, pool, batch_buckets(max_batch_size), shapes, kernels=kernels,
                        sample_widths=sample_widths, small_batch_shapes=small_batch_shapes or (),
                        verify_modes=verify_modes,
                        sampling_batch_max=SMALL_BATCH_MAX if sampling_batch_max is None else sampling_batch_max)
