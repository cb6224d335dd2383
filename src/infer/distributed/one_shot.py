"""A one-shot all-reduce for small messages, over NVLink peer memory.

`OneShotAllReduce` sums each rank's peer-addressable buffer in rank order with PyTorch's
symmetric memory (the same bits on every rank, one launch CUDA graphs capture); messages it
does not `serve` go through NCCL. docs/architecture.md, "Tensor parallelism".
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ONE_SHOT_MAX_BYTES = 512 * 1024  # a message at most this large takes the one-shot kernel
DTYPES = (torch.bfloat16, torch.float32)  # the kernel's (and an engine's activation) dtypes
ALIGNMENT = 16  # bytes: the kernel's vector width


def serves(y: torch.Tensor, max_bytes: int = ONE_SHOT_MAX_BYTES) -> bool:
    """Whether the one-shot kernel takes y: CUDA, a kernel dtype, contiguous, at most `max_bytes`,
    whole 16-byte vectors on a 16-byte boundary."""
    nbytes = y.numel() * y.element_size()
    return (y.is_cuda and y.dtype in DTYPES and y.is_contiguous() and 0 < nbytes <= max_bytes
            and nbytes % ALIGNMENT == 0 and y.data_ptr() % ALIGNMENT == 0)


class OneShotAllReduce:
    """`models.parallel.SmallAllReduce` by the one-shot kernel. Built by every rank at the same
    point (collective), after the default group is up and before any CUDA graph capture."""

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None,
                 max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
        if device.type != "cuda":
            raise ValueError(f"the one-shot all-reduce runs between CUDA devices, not {device}: "
                             "set tensor_parallel_all_reduce='nccl'")
        import torch.distributed._symmetric_memory as symm_mem
        group = group if group is not None else dist.group.WORLD
        assert group is not None
        self.group_name: str = group.group_name
        self.max_bytes = max_bytes
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # (older PyTorch needs it before a rendezvous)
            enable(self.group_name)
        self.buffers: dict[torch.dtype, torch.Tensor] = {}  # dtype -> [max_bytes / itemsize] symmetric
        try:
            for dtype in DTYPES:
                numel = max_bytes // torch.empty((), dtype=dtype).element_size()
                buffer = symm_mem.empty(numel, dtype=dtype, device=device)
                symm_mem.rendezvous(buffer, self.group_name)
                self.buffers[dtype] = buffer
        except RuntimeError as e:
            raise RuntimeError(f"the one-shot all-reduce could not map the other GPUs' memory ({e}); the GPUs "
                               "need peer access (NVLink): set tensor_parallel_all_reduce='nccl'") from e
        self.calls = 0  # messages it reduced (eager calls and graph captures; not replays)

    def __call__(self, y: torch.Tensor) -> torch.Tensor | None:
        """The sum of y over the ranks, a new tensor of y's shape; None if y is not served."""
        if not serves(y, self.max_bytes):
            return None
        flat = y.reshape(-1)
        symm = self.buffers[y.dtype][: flat.numel()]
        self.calls += 1
        return torch.ops.symm_mem.one_shot_all_reduce_copy(symm, flat, "sum", self.group_name).view(y.shape)
