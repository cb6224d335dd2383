"""Projections from the paper's speed model (speculative/theory.py) and measured costs, and
prefill's model FLOPs against the GPUs' peak bf16 FLOPs (MFU). The efficiency of an
implementation is its measured speedup / the predicted factor; the gap is the engine's own
overhead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from infer.models.config import ModelConfig
from infer.speculative.theory import tree_walltime_factor, walltime_factor

__all__ = ["efficiency", "peak_bf16_flops", "prefill_flops", "projection_table", "round_projection",
           "tree_projection", "Projection", "TreeProjection"]

# peak dense (no sparsity) bf16 tensor-core FLOP/s, by a part of torch.cuda.get_device_name()
# (the first key found in the name wins: list a longer name before a name it contains)
PEAK_BF16_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100 80GB HBM3": 989e12,  # the SXM part
    "A100": 312e12,
}

DEFAULT_ALPHAS = (0.6, 0.7, 0.8, 0.9)
DEFAULT_KS = tuple(range(1, 9))
# trees of at most 8 nodes (the cost measurement's v(K) goes to K = 8), against chains
DEFAULT_TREES = ((2, 1, 1), (2, 1, 1, 1), (2, 2), (3, 1), (4, 1))


def efficiency(measured_speedup: float, predicted: float) -> float:
    if predicted <= 0:
        raise ValueError("predicted speedup must be > 0")
    return measured_speedup / predicted


@dataclass(frozen=True)
class Projection:
    c: float
    alphas: tuple[float, ...]
    ks: tuple[int, ...]
    table: list[list[float]]  # [alpha][k] predicted speedup
    best_k: list[int]  # per alpha, the K with the largest speedup

    def to_dict(self) -> dict[str, object]:
        return {"c": self.c, "alphas": list(self.alphas), "ks": list(self.ks), "table": self.table,
                "best_k": self.best_k}


def projection_table(c: float, alphas: Sequence[float] = DEFAULT_ALPHAS, ks: Sequence[int] = DEFAULT_KS,
                     verify_costs: Sequence[float] | None = None) -> Projection:
    """Predicted speedup for each (alpha, K). verify_costs[K] (K = 0..max) switches to the
    generalised factor with measured verification costs; None = the paper's v = 1."""
    if not alphas or not ks:
        raise ValueError("projection_table needs at least one alpha and one K")
    if verify_costs is not None and len(verify_costs) <= max(ks):
        raise ValueError(f"verify_costs must cover K = 0..{max(ks)}, got {len(verify_costs)} entries")
    table = [[walltime_factor(a, k, c, 1.0 if verify_costs is None else verify_costs[k]) for k in ks]
             for a in alphas]
    best = [ks[max(range(len(ks)), key=lambda i: row[i])] for row in table]
    return Projection(c, tuple(alphas), tuple(ks), table, best)


@dataclass(frozen=True)
class TreeProjection:
    c: float
    alphas: tuple[float, ...]
    trees: tuple[tuple[int, ...], ...]
    table: list[list[float]]  # [alpha][tree] predicted speedup
    best_chain: list[float]  # per alpha, the best chain's predicted speedup (K up to the trees' nodes)

    def to_dict(self) -> dict[str, object]:
        return {"c": self.c, "alphas": list(self.alphas), "trees": [",".join(map(str, t)) for t in self.trees],
                "table": self.table, "best_chain": self.best_chain}


def tree_projection(c: float, verify_costs: Sequence[float], alphas: Sequence[float] = DEFAULT_ALPHAS,
                    trees: Sequence[tuple[int, ...]] = DEFAULT_TREES) -> TreeProjection:
    """Predicted speedup of each static tree (speculative/theory.py's tree model: one draft
    step a level, v(N) for its N nodes) beside the best chain of K <= the largest N drafts,
    from measured c and verify_costs[K] (K = 0..max)."""
    sizes = [sum(_level_sizes(t)) for t in trees]
    if not trees or max(sizes) >= len(verify_costs):
        raise ValueError(f"verify_costs must cover the trees' node counts {sizes}, got {len(verify_costs)} entries")
    table = [[tree_walltime_factor(a, t, c, verify_costs[n]) for t, n in zip(trees, sizes, strict=True)]
             for a in alphas]
    chains = [max(walltime_factor(a, k, c, verify_costs[k]) for k in range(1, max(sizes) + 1)) for a in alphas]
    return TreeProjection(c, tuple(alphas), tuple(tuple(t) for t in trees), table, chains)


def round_projection(a: float, branching: Sequence[int], c: float, verify_cost: float,
                     overhead: float = 0.0) -> float:
    """Expected speedup of rounds of one shape (a chain is "1,1,...,1") at acceptance a: the
    expected tokens a round over its cost in target steps: one draft step a level (c each),
    v(N) to verify its N nodes, and `overhead`, the round's measured time beyond those (in
    target steps). With no overhead a chain's is the paper's factor with measured v(K)."""
    if verify_cost + overhead <= 0:
        raise ValueError(f"a round must cost more than nothing: v = {verify_cost}, overhead = {overhead}")
    return tree_walltime_factor(a, branching, c, verify_cost + overhead)


def num_nodes(branching: Sequence[int]) -> int:
    """N, the nodes of a static tree (a chain of K: K)."""
    return sum(_level_sizes(branching))


def _level_sizes(branching: Sequence[int]) -> list[int]:
    """Nodes per depth of a static tree: b_1, b_1 b_2, ..."""
    sizes, width = [], 1
    for b in branching:
        width *= b
        sizes.append(width)
    return sizes


def peak_bf16_flops(gpu: str | None) -> float | None:
    """Peak dense bf16 FLOP/s of the GPU named `gpu` (torch.cuda.get_device_name), None for a
    GPU not in PEAK_BF16_FLOPS (or no GPU)."""
    if not gpu:
        return None
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in gpu), None)


def layer_matmul_params(config: ModelConfig) -> int:
    """Weights every token multiplies in one decoder layer: the q, k, v and o projections and
    the gated MLP's gate, up and down."""
    h, d = config.hidden_size, config.head_dim
    attn = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    return attn + 3 * h * config.intermediate_size


def attention_flops(config: ModelConfig, chunk_len: int, start: int = 0) -> int:
    """FLOPs of causal attention for a chunk of `chunk_len` queries at positions start..: query
    i sees start + i + 1 keys, and each (query head, key) pair costs 2 D for q.k and 2 D for
    p.v, in every layer. Only the visible pairs count (a kernel skipping masked tiles does
    about that much work; full attention: no sliding window)."""
    if chunk_len < 0 or start < 0:
        raise ValueError(f"chunk_len and start must be >= 0, got {chunk_len}, {start}")
    pairs = chunk_len * start + chunk_len * (chunk_len + 1) // 2
    return 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * pairs


def prefill_flops(config: ModelConfig, prompt_lens: Sequence[int]) -> int:
    """Model FLOPs of prefilling prompts of these lengths (nothing cached) up to their first
    token: 2 x the layers' matmul weights x tokens, plus attention (`attention_flops`), plus
    the LM head at each prompt's last token (2 x hidden x vocab; the logits of the other
    positions are never computed). Norms, rotary and the softmax's exponentials are left out."""
    if not prompt_lens or min(prompt_lens) < 1:
        raise ValueError(f"prefill_flops needs prompt lengths >= 1, got {list(prompt_lens)}")
    tokens = sum(prompt_lens)
    dense = 2 * config.num_hidden_layers * layer_matmul_params(config) * tokens
    head = 2 * config.hidden_size * config.vocab_size * len(prompt_lens)
    return dense + head + sum(attention_flops(config, n) for n in prompt_lens)
