"""EngineConfig: every knob of the engine, validated on construction.

`LLM(**kwargs)` and the CLI flags map one to one onto its fields. An engine never changes
it: at start it resolves it into frozen parts (parts.py, defaults.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from infer.engine.parts import (CHOICES, EAGLE_METHODS, MEDUSA, NEEDS_CONTINUOUS, NGRAM_METHODS, ONE_SHOT_NEEDS_CUDA,
                                ParallelConfig, SpeculativeConfig, check_at_least, check_choice, check_pool_options,
                                check_single_gpu)
from infer.speculative.draft_vocab import table_path

DEFAULT_SPEC_LENGTH = 5  # K when neither spec_length nor spec_tree is given
# fields that configure speculative decoding: one set off its default turns it on when
# use_speculative_decoding is unset
SPECULATION_FIELDS = ("speculative_method", "draft_model", "spec_length", "spec_tree", "spec_policy",
                      "spec_disable_batch_size", "spec_batch_gate", "spec_cost_coefficient", "ngram_max_order",
                      "ngram_min_order", "ngram_window", "spec_suffix_max_depth", "spec_suffix_cache_tokens",
                      "spec_suffix_min_prob", "draft_quantization", "tensor_parallel_draft", "spec_draft_vocab")
SUFFIX_FIELDS = ("spec_suffix_max_depth", "spec_suffix_cache_tokens", "spec_suffix_min_prob")
# speculative_method="suffix" with spec_tree / spec_length unset: chains of up to 24 tokens
SUFFIX_SPEC_LENGTH = 24
SUFFIX_TREE = f"dynamic:{SUFFIX_SPEC_LENGTH}:1"
# vLLM's names of engine options, for the error an unknown option gets
VLLM_NAMES = {"enforce_eager": "use_cuda_graphs=False", "max_model_len": "max_seq_len",
              "max_num_seqs": "max_batch_size",
              "speculative_config": "use_speculative_decoding, speculative_method, draft_model, spec_length",
              "num_speculative_tokens": "spec_length", "gpu_memory_utilization": "kv_cache_memory_bytes"}


@dataclass
class EngineConfig:
    """Every setting of the engine, validated on construction: a wrong value or combination
    raises ValueError naming the fields (and the fix). `LLM(model, **fields)` and the flags of
    `infer generate | serve | bench` (`--max-batch-size` for `max_batch_size`) set them.

    Groups, each field commented below: model and weights (model: directory, hub id, .gguf
    file, "dummy:<shape>" or None = demo); batching and memory (kv_cache_backend "paged" or
    "contiguous"); speed (use_cuda_graphs, compile_kernels, async_scheduling: on for CUDA);
    speculation (use_speculative_decoding, None: on when a speculation field is set;
    speculative_method: "draft_model", "ngram", "prompt_lookup", "suffix", "eagle" / "eagle3"
    with draft_model an EAGLE head, "medusa" with Medusa heads); tensor parallelism; seed.
    """

    model: str | None = None  # local directory, hub id or .gguf file; None = the bundled demo target
    tokenizer: str | None = None  # default: the model's directory
    dtype: str = "auto"
    device: str = "auto"  # "auto" = cuda when available, else cpu
    load_format: str = "auto"  # "auto" | "safetensors" | "dummy" (random weights, for timing)
    # None | "fp8" (per-channel) | "int4" (groups of 128 columns, 8-bit head): the target's linear
    # weights quantized at load; checkpoints stored quantized load as stored
    quantization: str | None = None
    draft_quantization: str | None = None  # the same for the draft model (or Medusa heads)
    seed: int = 0  # requests without their own seed sample from seed-derived generators
    threads: int | None = None  # CPU: torch threads; None = by model size (engine/threads.py)
    # running requests; None: sized from the GPU's memory (up to 256), 8 on a CPU (engine/batch_size.py)
    max_batch_size: int | None = None
    # tokens a sequence holds, prompt and output; None: the model's own context, capped by the KV
    # memory (engine/batch_size.py); a value above the model's context is cut to it
    max_seq_len: int | None = None
    # tokens a step computes: its decode rows' first, prefill chunks take the rest (longer prompts are chunked)
    max_num_batched_tokens: int = 512
    # prefill chunks and decode rows in one forward (False: a forward each, for comparison)
    mixed_batches: bool = True
    batching_mode: str = "continuous"
    kv_cache_backend: str = "paged"
    block_size: int = 16
    num_blocks: int | None = None  # paged: None = enough for max_batch_size x max_seq_len
    kv_cache_memory_bytes: int | None = None  # paged: alternative to num_blocks
    enable_prefix_caching: bool | None = None  # None = on for the paged backend
    # CUDA graphs of decode and speculation steps; None: on for CUDA (False: vLLM's enforce_eager)
    use_cuda_graphs: bool | None = None
    # the largest batch whose EAGLE head rounds run as one CUDA graph each (above it eagerly)
    cuda_graph_sampling_batch_max: int = 128
    compile_kernels: bool | None = None  # fuse elementwise ops with torch.compile; None = with CUDA graphs
    # overlapped scheduling: the host prepares step n+1 while the GPU runs step n; None = on for CUDA
    async_scheduling: bool | None = None
    # speculative decoding; None: on when a field of SPECULATION_FIELDS is set
    use_speculative_decoding: bool | None = None
    speculative_method: str = "draft_model"
    # dir, hub id or .gguf (None with the demo target: the demo draft); "eagle" / "eagle3": the
    # head's directory; "medusa": the Medusa heads' directory
    draft_model: str | None = None
    # a reduced draft vocabulary: a table `infer draft-vocab` writes (None: the draft's whole vocabulary)
    spec_draft_vocab: str | None = None
    # K: candidate tokens per speculation round; None: the depth of spec_tree, else DEFAULT_SPEC_LENGTH
    spec_length: int | None = None
    # children per node at each depth, e.g. "3,2,1,1" (its depth becomes spec_length); or dynamic
    # trees "dynamic:N[:B]": the N best drafted nodes verified, B expanded per level (default
    # min(4, N)), depth spec_length. None: a chain of spec_length drafts
    spec_tree: str | None = None
    spec_policy: str = "fixed"  # "fixed" K, or "adaptive" K per request (0 = plain decode)
    # speculation is off for a step whose decode batch is larger than this (None: never off)
    spec_disable_batch_size: int | None = None
    # the batch gate: a batch size where timed rounds give fewer tokens a second steps plainly.
    # None: on for a GPU, off on a CPU (False: outputs never depend on timing)
    spec_batch_gate: bool | None = None
    # c, the draft step's cost over the target's (adaptive policy); None: measured at start on a
    # GPU, the weight-byte ratio on a CPU. Given: taken as is, nothing timed
    spec_cost_coefficient: float | None = None
    ngram_max_order: int = 4
    ngram_min_order: int = 2
    ngram_window: int = 512
    # speculative_method="suffix": substrings of up to this many tokens are counted
    spec_suffix_max_depth: int = 48
    # tokens of finished requests' outputs every request drafts from (0: its own tokens alone)
    spec_suffix_cache_tokens: int = 65536
    spec_suffix_min_prob: float = 0.1  # a draft node's estimated probability must reach this
    # tensor parallelism: N ranks, one per GPU; the engine starts ranks 1..N-1 as worker processes
    tensor_parallel_size: int = 1
    tensor_parallel_embedding: str = "replicated"  # or "vocab_parallel" (V/N rows a rank, one all-reduce)
    tensor_parallel_lm_head: str = "vocab_parallel"  # or "replicated" (every rank computes every logit)
    tensor_parallel_draft: str = "driver"  # the draft model whole on rank 0, or "sharded" like the target
    # "one-shot": small all-reduces by one kernel over peer memory, NCCL for the rest; "nccl": NCCL only
    tensor_parallel_all_reduce: str = "nccl"

    def __post_init__(self) -> None:
        self._resolve_speculation()
        self._check_suffix()
        if self.spec_length is None:
            tree = SpeculativeConfig.parse_tree(self.spec_tree, DEFAULT_SPEC_LENGTH)  # (a static tree: its depth)
            self.spec_length = DEFAULT_SPEC_LENGTH if tree is None else tree.depth
        for name in CHOICES:
            check_choice(name, getattr(self, name))
        if self.device != "auto" and not self.device.startswith(("cpu", "cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 or None (sized from memory), got {self.max_batch_size}")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1 or None (the model's context), got {self.max_seq_len}")
        for name in ("max_num_batched_tokens", "block_size", "spec_length", "ngram_window", "tensor_parallel_size"):
            check_at_least(name, getattr(self, name))
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 or None (chosen by model size), got {self.threads}")
        if self.cuda_graph_sampling_batch_max < 0:
            raise ValueError("cuda_graph_sampling_batch_max must be >= 0 (0: no EAGLE round graphs), "
                             f"got {self.cuda_graph_sampling_batch_max}")
        if not 2 <= self.ngram_min_order <= self.ngram_max_order:
            raise ValueError("ngram orders must satisfy 2 <= ngram_min_order <= ngram_max_order, "
                             f"got {self.ngram_min_order}..{self.ngram_max_order}")
        if self.enable_prefix_caching is None:
            self.enable_prefix_caching = self.kv_cache_backend == "paged"
        check_pool_options(self.kv_cache_backend, self.num_blocks, self.kv_cache_memory_bytes,
                           self.enable_prefix_caching)
        self._check_combinations()
        self._check_tree()

    def speculation_fields_set(self) -> list[str]:
        """The SPECULATION_FIELDS holding a value other than their default (spec_length: DEFAULT_SPEC_LENGTH)."""
        defaults = {f.name: f.default for f in fields(self)}
        return [name for name in SPECULATION_FIELDS
                if getattr(self, name) not in (defaults[name], *((DEFAULT_SPEC_LENGTH,) if name == "spec_length" else ()))]

    def speculative_part(self, cuda: bool = False) -> SpeculativeConfig | None:
        """The speculation settings as their validated part (parts.py); None without speculation."""
        from infer.speculative.ngram_tables import NgramConfig
        from infer.speculative.suffix import SuffixConfig
        if not self.use_speculative_decoding:
            return None
        assert self.spec_length is not None
        ngram = suffix = None
        if self.speculative_method in NGRAM_METHODS:
            try:
                ngram = NgramConfig(self.speculative_method, self.ngram_max_order, self.ngram_min_order,
                                    self.ngram_window)
            except ValueError as e:
                raise ValueError(f"ngram_{e}") from None
        if self.speculative_method == "suffix":
            try:
                suffix = SuffixConfig(self.spec_suffix_max_depth, self.spec_suffix_cache_tokens,
                                      self.spec_suffix_min_prob)
            except ValueError as e:
                raise ValueError(f"spec_suffix_{e}") from None
        return SpeculativeConfig(self.speculative_method, self.spec_length,
                                 SpeculativeConfig.parse_tree(self.spec_tree, self.spec_length), self.spec_policy,
                                 self.spec_disable_batch_size, self.spec_cost_coefficient, ngram, suffix,
                                 cuda if self.spec_batch_gate is None else self.spec_batch_gate)

    def parallel_part(self) -> ParallelConfig:
        """The tensor-parallel settings as their validated part (parts.py)."""
        return ParallelConfig(self.tensor_parallel_size, self.tensor_parallel_embedding, self.tensor_parallel_lm_head,
                              self.tensor_parallel_draft, self.tensor_parallel_all_reduce)

    def _resolve_speculation(self) -> None:
        """use_speculative_decoding=None: on when a speculation field is set; False with one set is refused."""
        given = self.speculation_fields_set()
        if self.use_speculative_decoding is None:
            self.use_speculative_decoding = bool(given)
        elif not self.use_speculative_decoding and given:
            raise ValueError(f"{', '.join(given)} {'configures' if len(given) == 1 else 'configure'} speculative "
                             "decoding, which use_speculative_decoding=False turns off: set "
                             "use_speculative_decoding=True, or leave "
                             f"{'it' if len(given) == 1 else 'them'} unset")

    def _check_combinations(self) -> None:
        """What spans the parts: the device, the draft's loading and the methods' models."""
        parallel = self.parallel_part()
        if parallel.all_reduce == "one-shot" and self.device == "cpu":
            raise ValueError(ONE_SHOT_NEEDS_CUDA)
        if self.draft_quantization is not None and not (
                self.use_speculative_decoding and self.speculative_method in ("draft_model", MEDUSA)):
            raise ValueError("draft_quantization applies to a draft model or Medusa heads: set "
                             "use_speculative_decoding=True with speculative_method='draft_model' or 'medusa', "
                             "or leave draft_quantization unset")
        if self.tensor_parallel_draft == "sharded" and not (
                self.use_speculative_decoding and self.speculative_method == "draft_model"):
            raise ValueError("tensor_parallel_draft='sharded' applies to a draft model: set use_speculative_decoding="
                             "True with speculative_method='draft_model', or leave tensor_parallel_draft unset")
        self._check_draft_vocab()
        if self.use_speculative_decoding:
            if self.batching_mode != "continuous":
                raise ValueError(NEEDS_CONTINUOUS)
            if self.speculative_method == "draft_model" and self.draft_model is None and self.model is not None:
                raise ValueError("use_speculative_decoding=True with speculative_method='draft_model' "
                                 "requires draft_model (a path or hub id)")
            if self.speculative_method in EAGLE_METHODS:
                self._check_eagle()
            if self.speculative_method == MEDUSA:
                self._check_medusa()

    def _check_draft_vocab(self) -> None:
        if self.spec_draft_vocab is None:
            return
        if not (self.use_speculative_decoding and self.speculative_method == "draft_model"):
            raise ValueError("spec_draft_vocab reduces a draft model's vocabulary: set speculative_method="
                             f"'draft_model' (not {self.speculative_method!r}), or leave spec_draft_vocab unset")
        if self.tensor_parallel_draft == "sharded":
            raise ValueError("spec_draft_vocab needs the draft's whole lm_head: set tensor_parallel_draft='driver'")
        table_path(self.spec_draft_vocab)  # (a missing file refused here, before any model loads)

    def _check_eagle(self) -> None:
        method = self.speculative_method
        if self.draft_model is None and not (self.model is None and method == "eagle3"):  # (demo: its head)
            raise ValueError(f"speculative_method={method!r} requires draft_model: the directory of an "
                             f"{'EAGLE-3' if method == 'eagle3' else 'EAGLE'} head trained for the target"
                             + (" (the demo target ships an EAGLE-3 head: speculative_method='eagle3')"
                                if self.model is None else ""))
        check_single_gpu(method, False, self.tensor_parallel_size)

    def _check_medusa(self) -> None:
        if self.draft_model is None:
            raise ValueError("speculative_method='medusa' requires draft_model: the directory of Medusa heads "
                             "trained for the target (config.json with medusa_num_heads, and "
                             "medusa_lm_head.safetensors or .pt), or 'dummy-medusa:<shape>' for timing")
        check_single_gpu(MEDUSA, False, self.tensor_parallel_size)

    def _check_suffix(self) -> None:
        """speculative_method="suffix": spec_tree and spec_length default to SUFFIX_TREE and
        SUFFIX_SPEC_LENGTH (its part checks the rest); its fields refused with other methods."""
        if not (self.use_speculative_decoding and self.speculative_method == "suffix"):
            defaults = {f.name: f.default for f in fields(self)}
            given = [name for name in SUFFIX_FIELDS if getattr(self, name) != defaults[name]]
            if given:
                raise ValueError(f"{', '.join(given)} apply to speculative_method='suffix': set it (and "
                                 "use_speculative_decoding=True), or leave them unset")
            return
        self.spec_tree = SUFFIX_TREE if self.spec_tree is None else self.spec_tree
        self.spec_length = SUFFIX_SPEC_LENGTH if self.spec_length is None else self.spec_length

    def _check_tree(self) -> None:
        """The speculation part (its tree, policy and K checked there); spec_tree is normalised
        ("3, 2" -> "3,2", "dynamic:16" -> "dynamic:16:4")."""
        if self.spec_tree is not None and not self.use_speculative_decoding:
            raise ValueError("spec_tree applies to speculative decoding: set use_speculative_decoding=True "
                             "or leave spec_tree unset")
        part = self.speculative_part()
        if part is None or part.tree is None:
            return
        check_single_gpu(part.method, part.dynamic, self.tensor_parallel_size)
        self.spec_tree = str(part.tree)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            hints = [f"{name}: use {VLLM_NAMES[name]}" for name in unknown if name in VLLM_NAMES]
            raise ValueError(f"unknown engine option(s) {unknown}" + (f" ({'; '.join(hints)})" if hints else "")
                             + f"; valid options: {sorted(known)}")
        return cls(**kwargs)

