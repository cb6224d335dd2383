"""What CUDA graphs capture: the token counts (capture sizes) and the context width.

Capture sizes: CAPTURE_SIZES (1, 2, 4, ..., MAX_CAPTURE_SIZE) cut at the most tokens a
graphed pass holds, plus that number itself when the list lacks it. The target's forward
graphs are keyed by token count (`batch_forward.GraphBatchForward`: a pass of n tokens
replays the smallest captured size >= n, its padding tokens writing the pool's scratch
row); an EAGLE head's round graphs by rows and tokens (`head_graphs.py`). A larger pass
(vLLM's cap too) runs eagerly: what start-up captures grows with about log2 of the sizes,
not with the batch.

Context width: the attention kernel's split of each context into chunks is fixed when a
graph is captured, for contexts up to min(max_seq_len, MAX_GRAPH_CONTEXT); a pass whose
longest context is longer runs eagerly, through the same kernels, with a split of its own.
"""

from __future__ import annotations

MAX_CAPTURE_SIZE = 512
CAPTURE_SIZES = tuple(1 << i for i in range(MAX_CAPTURE_SIZE.bit_length()))  # 1, 2, 4, ..., 512
MAX_GRAPH_CONTEXT = 8192


def capture_sizes(most: int) -> list[int]:
    """The sizes (tokens of a pass, or rows of a round) graphs are captured for (module docstring)."""
    largest = min(most, MAX_CAPTURE_SIZE)
    return [b for b in CAPTURE_SIZES if b < largest] + [largest]


def graph_context_width(max_seq_len: int) -> int:
    """The longest context a graph serves (module docstring)."""
    return min(max_seq_len, MAX_GRAPH_CONTEXT)
