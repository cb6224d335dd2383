"""The engine's resolved configuration: frozen parts, each validated on construction.

`resolve_config` (defaults.py) turns an `EngineConfig` into one `ResolvedConfig` of parts
(`load`, `cache`, `scheduler`, `speculative`, `parallel`, `execution`); each component reads
the part it needs. docs/architecture.md, "Configuration". Importing it imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from infer.speculative.ngram_tables import NgramConfig
    from infer.speculative.node_tree import DynamicShape
    from infer.speculative.suffix import SuffixConfig
    from infer.speculative.tree import TreeShape

    SpecTree = TreeShape | DynamicShape

EAGLE_METHODS = ("eagle", "eagle3")  # speculative methods whose draft_model is an EAGLE head
MEDUSA = "medusa"  # the speculative method whose draft_model is a directory of Medusa heads
NGRAM_METHODS = ("ngram", "prompt_lookup")  # speculative methods drafting from n-gram tables
_VOCAB_LAYOUTS = ("replicated", "vocab_parallel")
# the values each string field of EngineConfig takes (the command line shows them as the flags' choices)
CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float"),
    "load_format": ("auto", "safetensors", "dummy"),
    "quantization": ("fp8", "int4"),
    "draft_quantization": ("fp8", "int4"),
    "batching_mode": ("continuous", "static"),
    "kv_cache_backend": ("paged", "contiguous"),
    "speculative_method": ("draft_model", *NGRAM_METHODS, "suffix", *EAGLE_METHODS, MEDUSA),
    "spec_policy": ("fixed", "adaptive"),
    "tensor_parallel_embedding": _VOCAB_LAYOUTS,
    "tensor_parallel_lm_head": _VOCAB_LAYOUTS,
    "tensor_parallel_draft": ("driver", "sharded"),
    "tensor_parallel_all_reduce": ("nccl", "one-shot"),
}
ONE_SHOT_NEEDS_CUDA = ("tensor_parallel_all_reduce='one-shot' runs between CUDA devices: set tensor_parallel_size >= 2 "
                       "on GPUs, or leave tensor_parallel_all_reduce='nccl'")
NEEDS_CONTINUOUS = "use_speculative_decoding=True requires batching_mode='continuous'"


def check_choice(name: str, value: str | None) -> None:
    """ValueError unless `value` is one of CHOICES[name] (None too for the quantizations)."""
    allowed = CHOICES[name]
    if name in ("quantization", "draft_quantization"):
        if value not in (None, *allowed):
            raise ValueError(f"{name} must be None or {' or '.join(map(repr, allowed))}, got {value!r}")
    elif value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def check_at_least(name: str, value: int, low: int = 1) -> None:
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def check_pool_options(backend: str, num_blocks: int | None, memory_bytes: int | None,
                       prefix_caching: bool | None) -> None:
    """The KV pool's own combinations (EngineConfig checks the user's with these)."""
    if num_blocks is not None and num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1 or None, got {num_blocks}")
    if memory_bytes is not None and memory_bytes < 1:
        raise ValueError("kv_cache_memory_bytes must be positive or None")
    if num_blocks is not None and memory_bytes is not None:
        raise ValueError("num_blocks and kv_cache_memory_bytes conflict: set at most one")
    if backend == "contiguous" and (num_blocks or memory_bytes):
        raise ValueError("num_blocks / kv_cache_memory_bytes apply to kv_cache_backend='paged' only")
    if prefix_caching and backend != "paged":
        raise ValueError("enable_prefix_caching=True requires kv_cache_backend='paged' "
                         "(set enable_prefix_caching=False for the contiguous backend)")


def check_single_gpu(method: str, dynamic_tree: bool, tensor_parallel_size: int) -> None:
    """EAGLE heads, Medusa heads and dynamic trees run on one GPU."""
    if tensor_parallel_size == 1:
        return
    if dynamic_tree:
        raise ValueError("dynamic trees run on one GPU: set tensor_parallel_size=1"
                         + (" or use a static spec_tree" if method == "draft_model" else ""))
    if method in (*EAGLE_METHODS, MEDUSA):
        raise ValueError(f"speculative_method={method!r} runs on one GPU: set tensor_parallel_size=1")


def check_graphs_device(use_cuda_graphs: bool | None, device: torch.device) -> None:
    """CUDA graphs need a CUDA device: True elsewhere is refused with the fix."""
    if use_cuda_graphs and device.type != "cuda":
        raise ValueError(f"use_cuda_graphs=True needs a CUDA device, but this engine runs on {device.type}: "
                         "drop use_cuda_graphs (on a CPU every step runs eagerly), or set device='cuda'")


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """The models and their weights: where they come from, on which device, in which dtype.
    At most one of `draft_model`, `head` and `medusa` is set."""

    model: str  # the target: a directory, hub id, .gguf file or "dummy:<shape>"
    tokenizer: str  # the target's tokenizer (its own files unless given)
    device: torch.device
    dtype: str  # resolved: "float32" for "auto" on a CPU; "auto" elsewhere keeps the checkpoint's
    load_format: str = "auto"
    quantization: str | None = None
    draft_quantization: str | None = None
    draft_model: str | None = None  # speculative_method "draft_model"
    head: str | None = None  # an EAGLE / EAGLE-3 head ("eagle", "eagle3")
    medusa: str | None = None  # Medusa heads ("medusa")
    draft_vocab: str | None = None  # spec_draft_vocab: the reduced draft vocabulary's table
    seed: int = 0  # requests without their own seed sample from seed-derived generators
    threads: int | None = None  # CPU torch threads; None: by model size (engine/threads.py)

    def __post_init__(self) -> None:
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be a CPU or a CUDA device, got {self.device}")
        for name in ("dtype", "load_format", "quantization", "draft_quantization"):
            check_choice(name, getattr(self, name))
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 or None (chosen by model size), got {self.threads}")
        if sum(x is not None for x in (self.draft_model, self.head, self.medusa)) > 1:
            raise ValueError("a draft model, an EAGLE head and Medusa heads are three ways to draft: load one")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The KV pools for `max_batch_size` sequences of up to `max_seq_len` tokens (num_blocks
    None: that many tokens, or the `memory_bytes` given)."""

    backend: str
    max_batch_size: int
    max_seq_len: int
    block_size: int = 16
    num_blocks: int | None = None
    memory_bytes: int | None = None
    prefix_caching: bool = False

    def __post_init__(self) -> None:
        check_choice("kv_cache_backend", self.backend)
        for name in ("max_batch_size", "max_seq_len", "block_size"):
            check_at_least(name, getattr(self, name))
        check_pool_options(self.backend, self.num_blocks, self.memory_bytes, self.prefix_caching)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """What a step holds: `max_batch_size` running requests, `max_num_batched_tokens` tokens
    (decode rows first, prefill chunks the rest), every sequence at most `max_seq_len`."""

    max_batch_size: int
    max_num_batched_tokens: int
    batching_mode: str = "continuous"
    max_seq_len: int = 1 << 62  # a request at this length decodes no more
    mixed_batches: bool = True  # prefill chunks and plain decode rows in one forward

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_batched_tokens", "max_seq_len"):
            check_at_least(name, getattr(self, name))
        check_choice("batching_mode", self.batching_mode)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How rounds are drafted: the method, K (`length`), the round's shape (None: chains of
    up to K), the length policy, and the n-gram or suffix proposer's own settings."""

    method: str
    length: int
    tree: SpecTree | None = None
    policy: str = "fixed"
    disable_batch_size: int | None = None  # no drafts for a step with more decode rows
    cost_coefficient: float | None = None  # c for the adaptive policy; None: measured
    ngram: NgramConfig | None = None  # the n-gram methods' tables
    suffix: SuffixConfig | None = None  # suffix decoding's tries
    batch_gate: bool = False  # rounds timed against plain steps per batch size (`RoundClock.pays`)

    def __post_init__(self) -> None:
        check_choice("speculative_method", self.method)
        check_choice("spec_policy", self.policy)
        check_at_least("spec_length", self.length)
        if self.disable_batch_size is not None and self.disable_batch_size < 1:
            raise ValueError(f"spec_disable_batch_size must be >= 1 or None, got {self.disable_batch_size}")
        if self.cost_coefficient is not None and self.cost_coefficient < 0:
            raise ValueError(f"spec_cost_coefficient must be >= 0 or None, got {self.cost_coefficient}")
        if self.method in NGRAM_METHODS and (self.ngram is None or self.ngram.method != self.method):
            raise ValueError(f"speculative_method={self.method!r} drafts from n-gram tables: give their settings, "
                             f"ngram=NgramConfig(method={self.method!r}, ...)")
        if self.method not in NGRAM_METHODS and self.ngram is not None:
            raise ValueError(f"n-gram tables' settings apply to speculative_method 'ngram' or 'prompt_lookup', not "
                             f"{self.method!r}: leave ngram unset")
        if (self.suffix is None) == (self.method == "suffix"):
            raise ValueError("suffix decoding's settings (suffix=SuffixConfig(...)) go with speculative_method="
                             f"'suffix' and with it alone, got {self.method!r} with suffix={self.suffix}")
        self._check_tree()

    def _check_tree(self) -> None:
        if self.method == "suffix" and not self.dynamic:
            raise ValueError("speculative_method='suffix' grows its own trees: give spec_tree='dynamic:N' or "
                             "'dynamic:N:B' (at most N nodes a round, B children a node), or leave it unset")
        if self.suffix is not None and self.suffix.max_depth <= self.length:
            raise ValueError(f"spec_suffix_max_depth ({self.suffix.max_depth}) must exceed spec_length "
                             f"({self.length}): a match of m tokens leaves spec_suffix_max_depth - m to draft")
        if self.dynamic:
            assert self.tree is not None
            if self.method not in ("draft_model", "suffix"):
                raise ValueError(f"spec_tree={str(self.tree)!r} (dynamic trees) is drafted by a draft model or "
                                 f"grown by suffix decoding: set speculative_method='draft_model' or 'suffix', or "
                                 f"give a static tree like '3,2,1' for {self.method!r}")
            if self.policy != "fixed":
                who = "speculative_method='suffix'" if self.method == "suffix" else "spec_tree"
                raise ValueError(f"{who} needs spec_policy='fixed' (the tree's depth is spec_length), "
                                 f"got {self.policy!r}")
            if self.tree.depth != self.length:
                raise ValueError(f"a dynamic tree's depth is spec_length ({self.length}), got {self.tree.depth}")
        elif self.tree is not None:
            if self.policy != "fixed":
                raise ValueError(f"spec_tree needs spec_policy='fixed' (the tree is static), got {self.policy!r}")
            if self.length != self.tree.depth:
                raise ValueError(f"spec_tree {str(self.tree)!r} has depth {self.tree.depth} but spec_length is "
                                 f"{self.length}: the tree's depth is K, so leave spec_length unset "
                                 f"or set it to {self.tree.depth}")

    @property
    def dynamic(self) -> bool:
        """Whether rounds grow dynamic trees (`DynamicShape`)."""
        from infer.speculative.node_tree import DynamicShape
        return isinstance(self.tree, DynamicShape)

    @staticmethod
    def parse_tree(text: str | None, length: int) -> SpecTree | None:
        """`spec_tree`'s text as a shape: "3,2,1" static, "dynamic:N[:B]" of depth `length`."""
        from infer.speculative.node_tree import DynamicShape, is_dynamic
        from infer.speculative.tree import TreeShape
        if text is None:
            return None
        try:
            return DynamicShape.parse(text, length) if is_dynamic(text) else TreeShape.parse(text)
        except ValueError as e:
            raise ValueError(f"spec_tree: {e}") from None

    @property
    def row_tokens(self) -> int:
        """The most tokens one decode row puts in a forward: g and a chain of K or a tree's nodes."""
        return 1 + (self.tree.num_nodes if self.tree is not None else self.length)


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor parallelism: `size` ranks, where the embedding, the head and a draft model
    live, and how small all-reduces run."""

    size: int = 1
    embedding: str = "replicated"
    lm_head: str = "vocab_parallel"
    draft: str = "driver"
    all_reduce: str = "nccl"

    def __post_init__(self) -> None:
        check_at_least("tensor_parallel_size", self.size)
        for name in ("embedding", "lm_head", "draft", "all_reduce"):
            check_choice(f"tensor_parallel_{name}", getattr(self, name))
        if self.all_reduce == "one-shot" and self.size < 2:
            raise ValueError(ONE_SHOT_NEEDS_CUDA)


@dataclass(frozen=True, slots=True)
class ExecutionConfig:
    """How steps run: CUDA graphs, the fused (torch.compile) kernels, overlapped scheduling,
    and the largest batch whose EAGLE head rounds run as CUDA graphs."""

    use_cuda_graphs: bool = False
    compile_kernels: bool = False
    async_scheduling: bool = False
    cuda_graph_sampling_batch_max: int = 128

    def __post_init__(self) -> None:
        if self.cuda_graph_sampling_batch_max < 0:
            raise ValueError("cuda_graph_sampling_batch_max must be >= 0 (0: no EAGLE round graphs), "
                             f"got {self.cuda_graph_sampling_batch_max}")


@dataclass(frozen=True, slots=True)
class ResolvedConfig:
    """The engine's whole configuration, every default decided; checks across parts run here."""

    load: LoadConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    speculative: SpeculativeConfig | None
    parallel: ParallelConfig
    execution: ExecutionConfig

    def __post_init__(self) -> None:
        check_graphs_device(self.execution.use_cuda_graphs, self.load.device)
        if (self.cache.max_batch_size, self.cache.max_seq_len) != (self.scheduler.max_batch_size,
                                                                   self.scheduler.max_seq_len):
            raise ValueError(f"the KV pools are sized for {self.cache.max_batch_size} sequences of "
                             f"{self.cache.max_seq_len} tokens but the scheduler runs {self.scheduler.max_batch_size} "
                             f"of {self.scheduler.max_seq_len}: build both from the same sizes")
        if self.parallel.all_reduce == "one-shot" and self.load.device.type != "cuda":
            raise ValueError(ONE_SHOT_NEEDS_CUDA)
        spec = self.speculative
        if spec is not None:
            if self.scheduler.batching_mode != "continuous":
                raise ValueError(NEEDS_CONTINUOUS)
            check_single_gpu(spec.method, spec.dynamic, self.parallel.size)

    @property
    def max_row_tokens(self) -> int:
        """The most tokens one decode row puts in a forward: 1, or a round's block."""
        return 1 if self.speculative is None else self.speculative.row_tokens
