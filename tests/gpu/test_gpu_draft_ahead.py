"""A draft model's rounds drafted ahead on the GPU, under CUDA graphs: each row's feed moved
on the device by the drafts its round did not accept (`DeviceIds.shift` in the draft's
graphs), checked with the target drafting for itself at random acceptance."""

from __future__ import annotations

import random

import pytest
from helpers.draft_ahead import check_drafts_ahead_continue, run_all

from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.speculative.draft_model import DraftModelProposer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_a_self_draft_ahead_drafts_the_continuation_under_graphs(ckpt_a, backend) -> None:
    rng = random.Random(4)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(5, 30))] for _ in range(4)]
    common = dict(model=str(ckpt_a), device="cuda", max_batch_size=4, max_seq_len=256, use_cuda_graphs=True,
                  kv_cache_backend=backend)
    records = run_all(Engine(EngineConfig(**common)), prompts, max_tokens=80)
    engine = Engine(EngineConfig(**common, use_speculative_decoding=True, draft_model=str(ckpt_a), spec_length=4,
                                 spec_batch_gate=False))
    speculation = engine.runner.speculation
    assert speculation is not None and isinstance(speculation.proposer, DraftModelProposer)
    check_drafts_ahead_continue(engine, speculation.proposer, prompts, records, max_tokens=80, near_ties=0.05)
