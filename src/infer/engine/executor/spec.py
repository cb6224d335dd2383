"""ForwardSpec: what a forward function is built to run, and which of its steps CUDA graphs capture.

Every forward function (`ForwardFn`) is built from a model, its KV pool and one
`ForwardSpec` (`Executor.make_forward(model, pool, spec)`). The spec says whether CUDA
graphs are used, for which batch sizes and step shapes, with which kernels, and which
sampling and acceptance steps are captured after the forward. A rank of a tensor-parallel
engine other than rank 0 runs the forward part of each step only (`forward_only()`): it
captures no sampling or acceptance graphs and keeps no draft probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from infer.models.kernels import EAGER, Kernels

Shape = tuple[int, bool]  # (tokens per row, logits of every token?)
VERIFY_MODES = ("greedy", "one_hot", "draft_probs")  # acceptance graphs (see GraphForward)
# sampling, acceptance and draft-loop graphs and `small_batch_shapes` only for batch buckets up to
# this size by default (EngineConfig.cuda_graph_sampling_batch_max)
SMALL_BATCH_MAX = 32


def _shapes(name: str, shapes: object) -> tuple[Shape, ...]:
    out = tuple(shapes)  # type: ignore[call-overload]
    for shape in out:
        if (not isinstance(shape, tuple) or len(shape) != 2 or not isinstance(shape[0], int) or shape[0] < 1
                or not isinstance(shape[1], bool)):
            raise ValueError(f"ForwardSpec.{name}: each shape is (width >= 1, all_logits: bool), got {shape!r}")
    return out


@dataclass(frozen=True, slots=True)
class ForwardSpec:
    """How to build one forward function (lists given for the tuple fields are kept as tuples).

    use_cuda_graphs: capture CUDA graphs (on a CUDA device only; elsewhere every step is eager).
    max_batch_size: the largest batch; graphs are captured per bucket 1, 2, 4, ... up to it.
    shapes: (width, all_logits) steps captured for every bucket (prefill always runs eagerly).
    kernels: the kernel bundle of every step, captured or eager.
    sample_widths: last-token widths also captured with temperature sampling (draft steps).
    small_batch_shapes: shapes captured for buckets up to `sampling_batch_max` only.
    verify_modes: acceptance steps captured after each verification shape (of VERIFY_MODES).
    sampling_batch_max: the largest bucket with sampling, acceptance and draft-loop graphs.
    draft_probs: whether `draft_loop` returns the probabilities of sampled rows (False: the
        tokens only, None for the probabilities; a rank that only follows rank 0's steps).
    tokens, trees: the graphs' largest token bucket, and whether tree graphs are captured.
    """

    use_cuda_graphs: bool = False
    max_batch_size: int = 1
    shapes: tuple[Shape, ...] = ()
    kernels: Kernels = EAGER
    sample_widths: tuple[int, ...] = ()
    small_batch_shapes: tuple[Shape, ...] = ()
    verify_modes: tuple[str, ...] = ()
    sampling_batch_max: int = SMALL_BATCH_MAX
    draft_probs: bool = True
    tokens: int | None = None  # the most tokens a graphed pass holds (None: max_batch_size x the widest shape)
    trees: bool = False  # graphs whose attention applies tree rules too (tree speculation)

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"ForwardSpec.max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.sampling_batch_max < 0:
            raise ValueError(f"ForwardSpec.sampling_batch_max must be >= 0, got {self.sampling_batch_max}")
        object.__setattr__(self, "shapes", _shapes("shapes", self.shapes))
        object.__setattr__(self, "small_batch_shapes", _shapes("small_batch_shapes", self.small_batch_shapes))
        widths = tuple(self.sample_widths)
        if any(not isinstance(w, int) or w < 1 for w in widths):
            raise ValueError(f"ForwardSpec.sample_widths must be widths >= 1, got {widths}")
        object.__setattr__(self, "sample_widths", widths)
        modes = tuple(self.verify_modes)
        if not set(modes) <= set(VERIFY_MODES):
            raise ValueError(f"ForwardSpec.verify_modes must be among {VERIFY_MODES}, got {modes}")
        object.__setattr__(self, "verify_modes", modes)

    @property
    def max_tokens(self) -> int:
        """The largest token-count bucket graphs are captured for."""
        if self.tokens is not None:
            return self.tokens
        return self.max_batch_size * max((w for w, _ in self.shapes), default=1)

    def forward_only(self) -> ForwardSpec:
        """This spec for a rank that runs only the forward part of each step (a tensor-parallel
        worker): the same forward graphs, no sampling or acceptance graphs, no draft probabilities."""
        return replace(self, sample_widths=(), verify_modes=(), draft_probs=False)
