"""The one-shot all-reduce (distributed/one_shot.py) on 2 GPUs: run with `pytest -m gpu tests/gpu`.

Two ranks joined with `all_reduce="one-shot"` sum float32 and bf16 messages with exactly the
bits of NCCL's all-reduce, eagerly and replayed from a CUDA graph that captured it; a message
larger than its buffer goes through NCCL; `leave` closes it. An engine at TP=2 with it
gives TP=1's greedy tokens in float32 (test_gpu_tensor_parallel.py's "one-shot" case).
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the one-shot all-reduce needs 2 CUDA devices")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_rank(rank: int, port: int) -> None:
    from infer.distributed.group import join, leave
    from infer.distributed.one_shot import ONE_SHOT_MAX_BYTES, OneShotAllReduce

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    device = torch.device("cuda", rank)
    group = join(rank, 2, device, store, "one-shot")
    collectives = group.collectives
    try:
        reducer = collectives.small
        assert isinstance(reducer, OneShotAllReduce)
        g = torch.Generator().manual_seed(rank)
        for dtype, n in ((torch.float32, 4096), (torch.bfloat16, 3 * 4096), (torch.float32, 16 * 4096)):
            x = torch.randn(n, generator=g).to(device=device, dtype=dtype)
            calls = reducer.calls
            got = collectives.all_reduce_sum(x.clone())
            ref = x.clone()
            dist.all_reduce(ref)
            assert reducer.calls == calls + 1 and torch.equal(got, ref), (dtype, n)
        # captured in a CUDA graph, replayed on new inputs
        static = torch.zeros(8, 4096, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            collectives.all_reduce_sum(static.clone())  # warm-up outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = collectives.all_reduce_sum(static * 1.0)
        for _ in range(3):
            static.copy_(torch.randn(8, 4096, generator=g))
            graph.replay()
            ref = static.clone()
            dist.all_reduce(ref)
            assert torch.equal(out, ref)
        # larger than the buffer: NCCL's
        calls = reducer.calls
        big = torch.ones(ONE_SHOT_MAX_BYTES // 4 + 4, device=device)
        assert torch.equal(collectives.all_reduce_sum(big), torch.full_like(big, 2.0)) and reducer.calls == calls
        torch.cuda.synchronize(device)
        del graph
    finally:
        leave(collectives)
    assert collectives.small is None and not dist.is_initialized()


def test_one_shot_sums_like_nccl_eagerly_and_in_graphs() -> None:
    mp.start_processes(_check_rank, args=(_free_port(),), nprocs=2, join=True, start_method="spawn")
