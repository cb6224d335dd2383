"""Engine defaults that depend on the device, resolved once when an engine is built
(`resolve_engine_defaults`), and what a device cannot honour (`check_device_options`).

- CUDA graphs (`use_cuda_graphs=None`) are on for CUDA devices, and with them the fused
  kernels (`compile_kernels=None`); `use_cuda_graphs=False` (`--enforce-eager`, vLLM's name)
  runs every step eagerly, with the eager kernels unless compile_kernels=True.
- On a CPU they stay off; `use_cuda_graphs=True` there is refused (nothing can capture a
  graph), with the fix in the message.
- `quantization="fp8"` or `"int4"` (or a draft's) on a CPU warns: a CPU has no FP8 or int4
  matmul, so every step converts the weights back to float32 and decodes slower than float32
  weights (they still save the weights' memory).
- Context length, batch size, KV pool: engine/batch_size.py.
"""

from __future__ import annotations

import logging

import torch

from infer.engine.batch_size import resolve_sizes
from infer.engine.config import EngineConfig
from infer.engine.loading import LoadedModels, resolve_device

log = logging.getLogger("infer.engine")


def check_device_options(config: EngineConfig, device: torch.device) -> list[str]:
    """ValueError for what `device` cannot do at all; the warnings for what it does slowly."""
    if device.type != "cuda" and config.use_cuda_graphs:
        raise ValueError(f"use_cuda_graphs=True needs a CUDA device, but this engine runs on {device.type}: "
                         "drop use_cuda_graphs (on a CPU every step runs eagerly), or set device='cuda'")
    warnings = []
    for name in ("quantization", "draft_quantization"):
        kind = getattr(config, name)
        if device.type == "cpu" and kind in ("fp8", "int4"):
            warnings.append(f"{name}={kind!r} on a CPU decodes slower than float32 weights: a CPU has no "
                            f"{kind.upper()} matmul, so every step converts the weights back (it only saves their "
                            f"memory); leave {name} unset to decode faster here")
    return warnings


def resolve_engine_defaults(config: EngineConfig, models: LoadedModels | None = None) -> torch.device:
    """Fill in `config`'s device-dependent defaults (module docstring) and sizes, warn about
    slow choices; the engine's device. With `models` already loaded: their device and configs."""
    device = next(models.target.parameters()).device if models is not None else resolve_device(config.device)
    for warning in check_device_options(config, device):
        log.warning(warning)
    if config.use_cuda_graphs is None:
        config.use_cuda_graphs = device.type == "cuda"
    resolve_sizes(config, models)
    return device
