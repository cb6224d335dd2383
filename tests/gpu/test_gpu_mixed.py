"""Mixed batches on the GPU (run on the GPU machine: `pytest -m gpu tests/gpu`).

A packed forward (decode rows beside prefill chunks) through the CUDA attention paths (the
Triton kernels for one-token rows and chunks up to 128 tokens, gather + SDPA above) equals
the padded forward, and an engine with CUDA graphs and overlapped scheduling gives the same
greedy tokens with mixed batches on and off.
"""

from __future__ import annotations

import random

import pytest
import torch

from infer import SamplingParams
from infer.cache.paged import PagedKVCachePool
from infer.cache.view import BatchLayout
from infer.engine.executor.forward import EagerForward
from infer.models.config import ModelConfig
from infer.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("chunk", [40, 150])  # the Triton chunk path, and gather + SDPA
def test_packed_forward_equals_padded_on_the_gpu(chunk: int) -> None:
    cfg = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval().cuda()
    history, lens = [7, 4, 9, 3], [1, chunk, 1, 5]
    ids = torch.randint(0, 100, (4, chunk))
    results = []
    for packed in (False, True):
        pool = PagedKVCachePool(cfg, 4, 256, torch.float32, "cuda", block_size=16, num_blocks=64)
        forward = EagerForward(model, pool)
        slots = [pool.allocate_slot(h + n) for h, n in zip(history, lens, strict=True)]
        torch.manual_seed(1)
        with torch.inference_mode():
            forward(torch.randint(0, 100, (4, 9)), BatchLayout.of(slots, [0] * 4, history), all_logits=False)
            logits = forward(ids, BatchLayout.of(slots, history, lens, packed=packed), all_logits=False)  # [4, V]
        results.append(logits)
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-4)


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
