"""Kernel timing inside one CUDA graph, for the kernel scripts (bench_gemv.py, bench_matmul.py)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_seconds(calls: list[Callable[[], object]], replays: int) -> float:
    """Seconds per call: the median over `replays` of one graph holding every call once."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / len(calls))
    del graph
    return statistics.median(times)
