"""Engine defaults that depend on the device, resolved once when an engine is built
(`resolve_engine_defaults`), and what a device cannot honour (`check_device_options`).

CUDA graphs (`use_cuda_graphs=None`) and with them the fused kernels are on for CUDA
devices (`use_cuda_graphs=False`, `--enforce-eager`, runs every step eagerly, with the
eager kernels unless compile_kernels=True); on a CPU they stay off and True is refused with
the fix. FP8 or int4 weights on a CPU warn. Context length, batch size and KV pool:
engine/batch_size.py. docs/architecture.md, "Defaults and start-up".
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
