"""Tensor parallelism on 2 GPUs (NCCL); run on the GPU machine: `pytest -m gpu tests/gpu`.

The CPU suite's parity on GPUs. float32 checkpoint with 8 query heads over 4 KV heads: the
tokens of TP=2 equal TP=1's, with CUDA graphs (which capture the all-reduces and the
lm_head's all-gather) and without: greedy with prefix caching and chunked prefill,
speculation with a draft model (whole on the driver, or sharded: its whole-round graphs
hold collectives, and its step-by-step path sends the previous step's tokens from GPU to
GPU), n-gram speculation, tree speculation (a sharded draft's levels and the verification block
as tree graphs on every rank, the tree verifier on rank 0 alone), seeded sampling, compiled
kernels. A worker captures the forward graphs only: no sampling, acceptance or tree
verification graphs, no draft probabilities (counted from its report). The one-shot
all-reduce for small messages in place of NCCL's gives the same tokens. bf16 on the dummy
Llama-3.2-1B shape: the ranks hold exact parts of the one-GPU dummy model, so TP=2 tokens
equal TP=1's up to bf16 rounding near-ties. Every engine's worker must exit 0 when it
closes (its NCCL communicator destroyed after the CUDA graphs that captured it are freed).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.checkpoints import mixed_prompts
from infer import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs 2 CUDA devices")]

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
# log-probabilities from bf16 logits: one rounding step of a logit near 16-32 is 0.125 (the
# test checkpoint's); the dummy shapes' logits (final-norm gain 20) reach 64-128: 0.5 a step
BF16_TOLERANCE = 0.25
DUMMY_BF16_TOLERANCE = 1.0
BASE: dict[str, Any] = dict(device="cuda", dtype="float32", max_seq_len=256, max_batch_size=8, compile_kernels=False)


@pytest.fixture(scope="module")
def prompts(tp_ckpt: Path) -> list[list[int]]:
    return mixed_prompts(tp_ckpt, seed=7)


def _tokens(model: str, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
            rounds: int = 1, **kwargs: Any) -> list[list[list[int]]]:
    with LLM(model, **{**BASE, **kwargs}) as llm:
        out = [[o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
               for _ in range(rounds)]
        assert llm.engine.leak_report() == []
        parallel = llm.engine.parallel
        if parallel is not None and kwargs.get("use_cuda_graphs"):
            assert parallel.channel.messages > 0 and llm.engine.runner.forward_fn.local.replays > 0
        workers = parallel.workers if parallel is not None else ()
    assert [w.returncode for w in workers] == [0] * len(workers)  # left cleanly, not killed
    return out


CASES: dict[str, dict[str, Any]] = {
    "prefix-chunked": dict(kv_cache_backend="paged", block_size=4, enable_prefix_caching=True,
                           max_num_batched_tokens=8, max_batch_size=4),
    "draft-on-driver": dict(use_speculative_decoding=True, spec_batch_gate=False, spec_length=3),
    "draft-sharded": dict(use_speculative_decoding=True, spec_batch_gate=False, spec_length=3,
                          tensor_parallel_draft="sharded"),
    "ngram": dict(use_speculative_decoding=True, spec_batch_gate=False, speculative_method="ngram", spec_length=3),
    "tree-draft-sharded": dict(use_speculative_decoding=True, spec_batch_gate=False, spec_tree="2,2",
                               tensor_parallel_draft="sharded"),
    "tree-ngram": dict(use_speculative_decoding=True, spec_batch_gate=False, speculative_method="ngram",
                       spec_tree="3,1"),
    "sampled": {},
    "one-shot": dict(tensor_parallel_all_reduce="one-shot"),  # (TP=2 only: TP=1 has no all-reduce)
}


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("case", list(CASES))
def test_tp2_tokens_equal_tp1(tp_ckpt: Path, tp_draft: Path, prompts: list[list[int]], case: str,
                              graphs: bool) -> None:
    kwargs = {**CASES[case], "use_cuda_graphs": graphs}
    params: SamplingParams | list[SamplingParams] = GREEDY
    if case == "draft-on-driver":
        kwargs["draft_model"] = str(tp_draft)
    if kwargs.get("tensor_parallel_draft") == "sharded":  # the target drafting for itself; mixed rows
        kwargs["draft_model"] = str(tp_ckpt)
        params = _mixed(len(prompts))
    if case == "sampled":
        params = [SamplingParams(temperature=0.9, top_p=0.9 if i % 2 else 1.0, seed=100 + i, max_tokens=MAX_NEW,
                                 ignore_eos=True) for i in range(len(prompts))]
    rounds = 2 if case == "prefix-chunked" else 1
    one = _tokens(str(tp_ckpt), prompts, params, rounds,
                  **{k: v for k, v in kwargs.items() if k != "tensor_parallel_all_reduce"})
    two = _tokens(str(tp_ckpt), prompts, params, rounds, tensor_parallel_size=2, **kwargs)
    assert two == one


def _mixed(n: int) -> list[SamplingParams]:
    """Greedy and seeded sampled rows of different lengths."""
    return [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=40 + i, max_tokens=MAX_NEW - (i % 3),
                           ignore_eos=True) for i in range(n)]


@pytest.mark.parametrize("shape", [{"spec_length": 3}, {"spec_tree": "2,2"}], ids=["chain", "tree"])
def test_a_worker_captures_forward_graphs_only(tp_ckpt: Path, prompts: list[list[int]], shape: dict[str, Any]) -> None:
    """Rank 0 samples, accepts and verifies; a worker runs each step's forward only, through
    the same graphs (one per token bucket, with tree rules for trees) as rank 0's."""
    from infer.distributed.worker import capture_counts

    with LLM(str(tp_ckpt), **{**BASE, "use_cuda_graphs": True}, use_speculative_decoding=True, spec_batch_gate=False,
             draft_model=str(tp_ckpt), tensor_parallel_size=2, tensor_parallel_draft="sharded", **shape) as llm:
        llm.generate(prompt_token_ids=prompts, sampling_params=_mixed(len(prompts)))
        runner = llm.engine.runner
        driver = capture_counts([runner.forward_fn.local, runner.speculation.draft.step_forward.local])
        reports = llm.engine.parallel.reports()
    assert driver["forward"] > 0 and (driver["trees"] > 0) == ("spec_tree" in shape)
    assert len(reports) == 1 and reports[0].captures == driver


def _bf16_outputs(model: str, prompts: list[list[int]], max_tokens: int, **kwargs: Any) -> list[Any]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    with LLM(model, **{**BASE, "dtype": "bfloat16", "use_cuda_graphs": True, "compile_kernels": True,
                       **kwargs}) as llm:
        outs = [o.outputs[0] for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        parallel = llm.engine.parallel
        workers = parallel.workers if parallel is not None else ()
    assert [w.returncode for w in workers] == [0] * len(workers)
    return outs


def _agree_up_to_rounding(one: list[Any], two: list[Any], tolerance: float) -> None:
    """bf16 cannot be compared bit for bit (the all-reduce adds two rounded partial sums
    where one GPU rounds once). Where the tokens agree, their log-probabilities must agree
    within `tolerance`; where they first differ, TP=1 must have seen TP=2's token as a near
    tie: among its two most likely, within 2 * tolerance of its own choice."""
    for a, b in zip(one, two, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        gaps = [abs(x.logprob - y.logprob) for x, y in zip(a.logprobs[:n], b.logprobs[:n], strict=True)]
        print(f"agree on {n}/{len(a.token_ids)} tokens, largest log-probability gap {max(gaps, default=0):.4f}")
        assert max(gaps, default=0.0) <= tolerance
        if n < len(a.token_ids):
            top = dict(a.logprobs[n].top)  # TP=1's two most likely tokens there
            chosen = b.token_ids[n]
            assert chosen in top, f"TP=2 chose {chosen} at {n}, not among TP=1's top two {top}"
            tie = abs(top[chosen] - a.logprobs[n].logprob)
            print(f"  diverged at {n}: TP=1's gap between the two tokens {tie:.4f}")
            assert tie <= 2 * tolerance


def test_tp2_fp8_with_compiled_kernels_follows_tp1(tp_ckpt: Path, prompts: list[list[int]]) -> None:
    # FP8 decode steps in bf16 take the Triton matmul: the row-parallel layers' residual add
    # comes after their all-reduce, not in the matmul's epilogue (else the logits would be off)
    one = _bf16_outputs(str(tp_ckpt), prompts, MAX_NEW, quantization="fp8")
    two = _bf16_outputs(str(tp_ckpt), prompts, MAX_NEW, quantization="fp8", tensor_parallel_size=2)
    _agree_up_to_rounding(one, two, tolerance=BF16_TOLERANCE)


DUMMY_1B = "dummy:llama-3.2-1b"
DUMMY_KW: dict[str, Any] = dict(max_batch_size=4, max_seq_len=512)


@pytest.fixture(scope="module")
def dummy_prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(128000) for _ in range(n)] for n in (16, 50, 120, 7)]


@pytest.fixture(scope="module")
def dummy_tp1(dummy_prompts: list[list[int]]) -> list[Any]:
    return _bf16_outputs(DUMMY_1B, dummy_prompts, 32, **DUMMY_KW)


@pytest.mark.parametrize("lm_head", ["vocab_parallel", "replicated"])
def test_bf16_dummy_1b_shape_tp2_follows_tp1(dummy_prompts: list[list[int]], dummy_tp1: list[Any],
                                             lm_head: str) -> None:
    """The real head layout (32 query heads over 8 KV heads, head_dim 64, tied 128k
    vocabulary), bf16, CUDA graphs, compiled kernels; the dummy weights shard exactly."""
    two = _bf16_outputs(DUMMY_1B, dummy_prompts, 32, tensor_parallel_size=2, tensor_parallel_lm_head=lm_head,
                        **DUMMY_KW)
    _agree_up_to_rounding(dummy_tp1, two, tolerance=DUMMY_BF16_TOLERANCE)


def test_more_ranks_than_gpus_is_a_clear_error() -> None:
    count = torch.cuda.device_count()
    n = 1 << count.bit_length()  # the next power of two: the 8B shape's heads divide by it (up to 8)
    if n > 8:
        pytest.skip("this machine has 8 GPUs or more")
    with pytest.raises(ValueError, match=f"tensor_parallel_size={n} needs {n} CUDA devices .* has {count}"):
        LLM("dummy:llama-3.1-8b", device="cuda", tensor_parallel_size=n)
