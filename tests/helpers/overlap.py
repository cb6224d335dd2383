"""Overlapped against synchronous scheduling: one scenario for the CPU and the GPU tests.

`overlap_parity` runs the same requests on a synchronous and an overlapped engine (greedy,
seeded sampled, a stop id mid-run, a stop string, a short max_tokens, top-p) and checks the
outputs are equal and the finishes are where the plain reference puts them.
`abort_in_flight` aborts a request while a step is in flight and checks the other request
and every resource.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers.checkpoints import encode
from infer import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# the engine configurations the scenario runs under (a draft model: the checkpoint itself)
OVERLAP_CONFIGS: dict[str, dict[str, Any]] = {
    "plain": {},
    "draft": dict(use_speculative_decoding=True, spec_batch_gate=False, spec_length=3),
    "ngram": dict(use_speculative_decoding=True, spec_batch_gate=False, speculative_method="ngram", spec_length=3),
    # (c given: K must not follow the wall clock, for the seeded rows to be comparable)
    "adaptive": dict(use_speculative_decoding=True, spec_batch_gate=False, spec_length=3, spec_policy="adaptive",
                     spec_cost_coefficient=1.0),
    "tree": dict(use_speculative_decoding=True, spec_batch_gate=False, spec_tree="2,1,1", spec_length=3),
    # (its dummy head: random weights beside the target's; greedy rounds draft ahead)
    "eagle3": dict(use_speculative_decoding=True, spec_batch_gate=False, speculative_method="eagle3", spec_length=3),
    "ngram-tree": dict(use_speculative_decoding=True, spec_batch_gate=False, speculative_method="ngram",
                       spec_tree="2,1", spec_length=2),
    "preempt": dict(kv_cache_backend="paged", block_size=4, num_blocks=20, max_num_batched_tokens=8),
}

MakeLLM = Callable[..., LLM]


def overlap_prompts(model: Path) -> list[list[int]]:
    """Six word prompts of 3-20 words (the "preempt" configuration runs out of blocks on them)."""
    rng = random.Random(11)
    words = "the cat sat on the mat and the dog sat on the log while a fox ran".split()
    return [encode(model, " ".join(rng.choice(words) for _ in range(rng.randint(3, 20)))) for _ in range(6)]


def scenario_params(reference: list[list[int]], tokenizer: Any) -> list[SamplingParams]:
    """Greedy, seeded sampled, a stop id mid-run, a stop string, short max_tokens, top-p."""
    stop_id = reference[2][5]
    text = tokenizer.decode(reference[3], skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 2] or "e"
    return [GREEDY,
            SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=7),
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id]),
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
            SamplingParams(temperature=1.3, max_tokens=20, ignore_eos=True, seed=5, top_p=0.9)]


def outputs(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple[Any, ...]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def overlap_parity(make_llm: MakeLLM, model: Path, prompts: list[list[int]], config: str,
                   **engine_kw: Any) -> tuple[LLM, LLM]:
    """The scenario under OVERLAP_CONFIGS[config] (plus `engine_kw`), synchronous and
    overlapped; returns (synchronous engine, overlapped engine) after the checks."""
    kw = dict(max_batch_size=4, max_seq_len=128, **OVERLAP_CONFIGS[config], **engine_kw)
    if kw.get("use_speculative_decoding") and kw.get("speculative_method", "draft_model") == "draft_model":
        kw["draft_model"] = str(model)
    if kw.get("speculative_method") == "eagle3":
        kw["draft_model"] = f"dummy-eagle3:{model}"
    plain = make_llm(model, max_seq_len=128, **engine_kw)
    reference = [o[0] for o in outputs(plain, prompts, [GREEDY] * len(prompts))]
    sync = make_llm(model, async_scheduling=False, **kw)
    params = scenario_params(reference, sync.tokenizer)
    overlapped = make_llm(model, async_scheduling=True, **kw)
    want = outputs(sync, prompts, params)
    assert outputs(overlapped, prompts, params) == want
    stop_id = params[2].stop_token_ids[0]
    assert want[2][2] == "stop" and want[2][0] == reference[2][:reference[2].index(stop_id) + 1]  # mid-run
    assert want[3][2] == "stop" and want[4][0] == reference[4][:5]
    assert overlapped.engine.runner.overlap and not sync.engine.runner.overlap
    if config == "preempt":
        assert overlapped.engine.scheduler.num_preemptions > 0
    return sync, overlapped


def abort_in_flight(make_llm: MakeLLM, model: Path, prompts: list[list[int]], **engine_kw: Any) -> None:
    """Abort one of two requests with a step in flight: it keeps a prefix of its tokens, the
    other finishes as alone, and nothing is left behind."""
    llm = make_llm(model, max_seq_len=128, max_batch_size=4, async_scheduling=True,
                   use_speculative_decoding=True, spec_batch_gate=False, speculative_method="ngram", spec_length=3,
                   **engine_kw)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = outputs(make_llm(model, max_seq_len=128, **engine_kw), prompts[:2], [params] * 2)
    reqs = [engine.add_request(p, params) for p in prompts[:2]]
    for _ in range(4):
        engine.step()
    final = engine.abort(reqs[0].request_id)
    assert final is not None and final.finished and final.finish_reason.value == "abort"
    assert full[0][0][:len(reqs[0].output_token_ids)] == reqs[0].output_token_ids  # what it had: a prefix
    while engine.has_unfinished():
        engine.step()
    assert reqs[1].output_token_ids == full[1][0]
    assert engine.leak_report() == [] and not engine.runner.has_pending()
