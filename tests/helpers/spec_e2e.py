"""Shared setup of the speculation end-to-end tests (chains and trees, CPU).

Eight word prompts on the tiny checkpoint, greedy for `MAX_NEW` tokens (a prefill token and
four full rounds of depth 4), the engine configurations each parity test runs under, the
batch-1 / batched way of running them, and a policy of draft lengths from a fixed cycle.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from helpers.checkpoints import encode, make_checkpoint
from infer import LLM, SamplingParams

DEPTH = 4  # draft length (a chain's K, a tree's depth)
MAX_NEW = 1 + 4 * (DEPTH + 1)  # prefill token + 4 full rounds: every round can draft DEPTH
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
ENGINE_CONFIGS = {
    "contiguous": dict(kv_cache_backend="contiguous"),
    "paged-prefix-small-chunks": dict(kv_cache_backend="paged", block_size=4, max_num_batched_tokens=6),
    "paged-preempt": dict(kv_cache_backend="paged", block_size=4, num_blocks=48, max_num_batched_tokens=16),
}


def random_draft(directory: Path) -> Path:
    """Same tokenizer and vocabulary as checkpoint "a", unrelated weights, fewer layers."""
    return make_checkpoint(directory, variant="a", seed=123, num_hidden_layers=1)


def word_prompts(ckpt: Path, n: int = 8, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    words = "the cat sat on the mat and the dog sat on the log while a fox ran".split()
    return [encode(ckpt, " ".join(rng.choice(words) for _ in range(rng.randint(2, 25)))) for _ in range(n)]


def generated_tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                     ) -> list[list[int]]:
    """Each prompt's first completion's token ids."""
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


def plain_greedy(ckpt: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(ckpt), device="cpu", kv_cache_backend="contiguous", max_seq_len=256)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    assert llm.engine.leak_report() == []
    return outs


def run(llm: LLM, prompts: list[list[int]], batch: int, params: SamplingParams = GREEDY) -> list[Any]:
    """One request at a time (batch 1), or all together."""
    if batch == 1:
        return [llm.generate(prompt_token_ids=[p], sampling_params=params)[0] for p in prompts]
    return llm.generate(prompt_token_ids=prompts, sampling_params=params)


def spec_llm(make_llm: Any, target: Path, draft: Path | None, batch: int, method: str = "draft_model",
             **extra: Any) -> LLM:
    """A speculative LLM of depth DEPTH on `target` (`draft` for the draft_model method)."""
    kw = dict(max_batch_size=batch, max_seq_len=256, use_speculative_decoding=True, spec_length=DEPTH,
              speculative_method=method, **extra)
    if method == "draft_model":
        kw["draft_model"] = str(draft)
    return make_llm(target, **kw)


def check_mixed_rows(llm: LLM, prompts: list[list[int]], plain_outputs: list[list[int]]) -> None:
    """Greedy rows (the even prompts) beside seeded sampled rows with penalties (the odd
    ones) in one generate: the greedy rows keep plain decoding's tokens, the sampled rows
    their length."""
    sampled = SamplingParams(temperature=1.0, presence_penalty=0.5, repetition_penalty=1.2, max_tokens=MAX_NEW,
                             ignore_eos=True, seed=7)
    params = [GREEDY if i % 2 == 0 else sampled for i in range(len(prompts))]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs[::2]] == plain_outputs[::2]
    assert all(len(o.outputs[0].token_ids) == MAX_NEW for o in outs[1::2])


def count_routes(monkeypatch: Any) -> dict[str, int]:
    """Counts the speculation rounds verified as trees and as chains (`Verification.block`)."""
    from infer.engine.verification import Verification
    seen = {"tree": 0, "chain": 0}
    real = Verification.block

    def block(self: Verification, requests: Any, drafts: Any, follows: Any = None) -> Any:
        out = real(self, requests, drafts, follows)
        seen["chain" if out.frame is None else "tree"] += 1
        return out

    monkeypatch.setattr(Verification, "block", block)
    return seen


class CyclePolicy:
    """Draft lengths from a fixed cycle (0: a plain step), every request alike: like an
    adaptive policy that keeps switching, so the draft must catch up on the tokens it skipped."""

    def __init__(self, cycle: list[int]) -> None:
        self.cycle, self.i = cycle, 0

    def choose(self, requests, overhead=0.0):
        k = self.cycle[self.i % len(self.cycle)]
        self.i += 1
        return [k] * len(requests)

    def update(self, request_id, drafted, accepted):
        return None

    def release(self, request_id):
        return None

    def leak_report(self):
        return []
