"""What CUDA graphs capture: the token counts (capture sizes) and the context width.

A larger pass or a longer context runs eagerly. docs/architecture.md, "Executing the model".
"""

from __future__ import annotations

MAX_CAPTURE_SIZE = 1024
CAPTURE_SIZES = tuple(1 << i for i in range(MAX_CAPTURE_SIZE.bit_length()))  # 1, 2, 4, ..., 1024
MAX_GRAPH_CONTEXT = 8192


def capture_sizes(most: int) -> list[int]:
    """Sizes (tokens of a pass, or rows of a round) graphs are captured for: CAPTURE_SIZES below
    min(most, MAX_CAPTURE_SIZE), then that bound itself."""
    largest = min(most, MAX_CAPTURE_SIZE)
    return [b for b in CAPTURE_SIZES if b < largest] + [largest]


def graph_context_width(max_seq_len: int) -> int:
    """The longest context a graph serves (the attention's split is fixed at capture)."""
    return min(max_seq_len, MAX_GRAPH_CONTEXT)
