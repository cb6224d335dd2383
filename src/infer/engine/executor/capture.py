"""What CUDA graphs capture: the token counts (capture sizes) and the context width.

`capture_sizes`: CAPTURE_SIZES (1, 2, 4, ..., MAX_CAPTURE_SIZE) cut at the most tokens (or
rows) a graphed pass holds, plus that number itself. The target's forward graphs are keyed
by token count (a pass replays the smallest size that holds it), an EAGLE head's round
graphs by rows and tokens (`head_graphs.py`); a larger pass runs eagerly.
`graph_context_width`: graphs serve contexts up to min(max_seq_len, MAX_GRAPH_CONTEXT),
the attention's split being fixed at capture; a longer context runs eagerly.
docs/architecture.md, "Executing the model".
"""

from __future__ import annotations

MAX_CAPTURE_SIZE = 1024
CAPTURE_SIZES = tuple(1 << i for i in range(MAX_CAPTURE_SIZE.bit_length()))  # 1, 2, 4, ..., 1024
MAX_GRAPH_CONTEXT = 8192


def capture_sizes(most: int) -> list[int]:
    """The sizes (tokens of a pass, or rows of a round) graphs are captured for (module docstring)."""
    largest = min(most, MAX_CAPTURE_SIZE)
    return [b for b in CAPTURE_SIZES if b < largest] + [largest]


def graph_context_width(max_seq_len: int) -> int:
    """The longest context a graph serves (module docstring)."""
    return min(max_seq_len, MAX_GRAPH_CONTEXT)
