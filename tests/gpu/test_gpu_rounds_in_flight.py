"""GPU tests of rounds in flight (`pytest -m gpu tests/gpu/test_gpu_rounds_in_flight.py`): an
EAGLE-3 head's greedy rounds queued before the host reads the verdict before them, through
the target's and the head's CUDA graphs (rows moved on the device), give plain decoding's
tokens at acceptance 0.5 and 0.9 (the benchmark's oracle replacing drafts on the device),
beside a synchronous engine that never follows a round; nothing leaks."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.eagle_heads import write_head
from helpers.spec_e2e import word_prompts
from infer import LLM, SamplingParams
from infer_bench.oracle import OracleProposer

pytestmark = pytest.mark.gpu

OUTPUT = 48


@pytest.fixture(scope="module")
def head(ckpt_a: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_head(tmp_path_factory.mktemp("gpu_head") / "eagle3", ckpt_a, "eagle3", draft_vocab=120,
                      aux_layers=[0, 1, 1])


def _llm(ckpt: Path, **options) -> LLM:
    return LLM(str(ckpt), device="cuda", dtype="float32", max_batch_size=8, max_seq_len=256, use_cuda_graphs=True,
               compile_kernels=False, **options)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]


@pytest.mark.parametrize("alpha", [0.5, 0.9])
def test_rounds_in_flight_through_graphs_give_plain_tokens(ckpt_a, head, alpha) -> None:
    prompts = word_prompts(ckpt_a, 6)
    records = _greedy(_llm(ckpt_a), prompts)
    followed = {}
    for overlap in (True, False):
        llm = _llm(ckpt_a, use_speculative_decoding=True, speculative_method="eagle3", draft_model=str(head),
                   spec_length=3, spec_batch_gate=False, async_scheduling=overlap)
        speculation = llm.engine.runner.speculation
        oracle = OracleProposer(speculation.proposer, records, llm.engine.vocab_size, alpha, seed=3)
        speculation.proposer = oracle
        assert _greedy(llm, prompts) == records
        assert oracle.counts.off_record_rounds == 0 and 0 < oracle.counts.accepted < oracle.counts.tried
        assert llm.engine.leak_report() == [] and not llm.engine.runner.has_pending()
        followed[overlap] = llm.engine.runner.stats.followed
    assert followed[True] > 0 and followed[False] == 0
