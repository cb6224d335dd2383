"""Mixed batches on the GPU (run on the GPU machine: `pytest -m gpu tests/gpu`).

A flat forward of decode rows beside prefill chunks through the CUDA attention paths (the
split-KV kernel for short rows, the prefill kernel for long ones) gives each row the logits
of its own forward, and an engine with CUDA graphs and overlapped scheduling gives the same
greedy tokens with mixed batches on and off.
"""

from __future__ import annotations

import random

import pytest
import torch

from infer import SamplingParams
from infer.cache.forward_batch import Row, plan_batch
from infer.cache.paged import PagedKVCachePool
from infer.engine.executor.batch_forward import EagerBatchForward
from infer.models.config import ModelConfig
from infer.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("chunk", [40, 150])  # a short chunk (split-KV kernel), a long one (prefill kernel)
def test_a_mixed_forward_equals_a_forward_each_on_the_gpu(chunk: int) -> None:
    cfg = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval().cuda()
    history, lens = [7, 4, 9, 3], [1, chunk, 1, 5]
    gen = torch.Generator().manual_seed(1)
    prefix = [torch.randint(0, 100, (h,), generator=gen).tolist() for h in history]
    step = [torch.randint(0, 100, (n,), generator=gen).tolist() for n in lens]
    results = []
    for together in (True, False):
        pool = PagedKVCachePool(cfg, 4, 256, torch.float32, "cuda", block_size=16, num_blocks=64)
        forward = EagerBatchForward(model, pool)
        slots = [pool.allocate_slot(h + n) for h, n in zip(history, lens, strict=True)]
        with torch.inference_mode():
            forward.run(plan_batch([Row(s, 0, p, logits=0) for s, p in zip(slots, prefix, strict=True)]))
            rows = [Row(s, h, ids) for s, h, ids in zip(slots, history, step, strict=True)]
            logits = forward.run(plan_batch(rows)) if together else torch.cat([forward.run(plan_batch([r])) for r in rows])
        results.append(logits)  # [4, V]
    torch.testing.assert_close(results[0], results[1], rtol=1e-4, atol=1e-4)


def test_mixed_batches_match_separate_forwards_with_graphs_and_overlap(make_llm, ckpt_a) -> None:
    rng = random.Random(4)
    prompts = [[rng.randrange(2, 90) for _ in range(rng.randint(3, 40))] for _ in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = {}
    for mixed in (True, False):
        llm = make_llm(ckpt_a, device="cuda", dtype="float32", max_batch_size=4, max_seq_len=128,
                       use_cuda_graphs=True, compile_kernels=False, async_scheduling=True, mixed_batches=mixed)
        engine = llm.engine
        requests = []
        for i, p in enumerate(prompts):  # one arrival every other step: prefill meets decode
            requests.append(engine.add_request(p, greedy))
            engine.step()
            if i % 2:
                engine.step()
        while engine.has_unfinished():
            engine.step()
        got[mixed] = [list(r.output_token_ids) for r in requests]
    assert got[True] == got[False]
