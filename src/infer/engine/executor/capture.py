"""What CUDA graphs capture: the batch sizes (capture sizes) and the context width.

Capture sizes: CAPTURE_SIZES (1, 2, 4, ..., MAX_CAPTURE_SIZE) cut at max_batch_size, plus
max_batch_size itself when the list lacks it. A step of n rows replays the smallest captured
size >= n (its padding rows write to the pool's scratch row); a batch above the largest
(max_batch_size above MAX_CAPTURE_SIZE, vLLM's cap too) runs eagerly. Each step shape
(plain decode, each verification width, a draft model's feeds, ...) is captured once per
size, sampling and acceptance graphs and draft rounds only up to
`cuda_graph_sampling_batch_max` (executor/spec.py): what start-up captures grows with the
number of sizes, about log2(max_batch_size), not with the batch.

Context width: a graph's index buffers hold batch x width positions (the storage row of
every context position, staged and copied at each replay), so graphs are captured for
contexts up to min(max_seq_len, MAX_GRAPH_CONTEXT): a step whose longest context is longer
runs eagerly, through the same kernels.
"""

from __future__ import annotations

MAX_CAPTURE_SIZE = 512
CAPTURE_SIZES = tuple(1 << i for i in range(MAX_CAPTURE_SIZE.bit_length()))  # 1, 2, 4, ..., 512
MAX_GRAPH_CONTEXT = 8192


def capture_sizes(max_batch_size: int) -> list[int]:
    """The batch sizes graphs are captured for (module docstring)."""
    largest = min(max_batch_size, MAX_CAPTURE_SIZE)
    return [b for b in CAPTURE_SIZES if b < largest] + [largest]


def graph_context_width(max_seq_len: int) -> int:
    """The longest context a graph serves (module docstring)."""
    return min(max_seq_len, MAX_GRAPH_CONTEXT)
