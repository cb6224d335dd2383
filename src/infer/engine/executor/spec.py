"""ForwardSpec: how one forward function is built (`Executor.make_forward(model, pool, spec)`);
a tensor-parallel worker builds the same forward from the same spec."""

from __future__ import annotations

from dataclasses import dataclass

from infer.models.kernels.bundle import EAGER, Kernels


@dataclass(frozen=True, slots=True)
class ForwardSpec:
    """use_cuda_graphs: capture CUDA graphs (on a CUDA device only; elsewhere every pass is
    eager). max_batch_size: the most rows a pass holds. kernels: the kernel bundle of every
    pass, captured or eager. tokens: the most tokens a graphed pass holds (None: one a row).
    trees: graphs whose attention applies tree rules too (tree speculation)."""

    use_cuda_graphs: bool = False
    max_batch_size: int = 1
    kernels: Kernels = EAGER
    tokens: int | None = None
    trees: bool = False

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"ForwardSpec.max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.tokens is not None and self.tokens < 1:
            raise ValueError(f"ForwardSpec.tokens must be >= 1 or None, got {self.tokens}")

    @property
    def max_tokens(self) -> int:
        """The largest token-count bucket graphs are captured for."""
        return self.tokens if self.tokens is not None else self.max_batch_size
