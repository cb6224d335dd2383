"""The bundled demo pair: loads in infer and transformers alike, is the default model,
and drives speculative decoding losslessly (greedy parity; sampled marginal of the first
speculative token against the exact target distribution)."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET
from infer.models.loading.loader import load_model

PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\n\n\ndef list_files(directory):\n    ",
    "class Stack:\n    def __init__(self):\n        ",
    "for i in range(10):\n    ",
    "    return self._",
    "if __name__ == '__main__':\n    ",
    "def add(a, b):\n    \"\"\"Return the sum",
    "try:\n    import json\nexcept ImportError:\n    ",
]


@pytest.mark.parametrize("path", [DEMO_TARGET, DEMO_DRAFT], ids=["target", "draft"])
def test_bundled_models_match_transformers(path):
    from transformers import LlamaForCausalLM
    ours, _ = load_model(str(path), dtype="float32")
    ref = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(3, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - ref(ids).logits).abs().max().item() <= 1e-4


def test_default_model_is_the_demo_target(make_llm):
    llm = LLM(device="cpu")
    assert llm.config.model is None
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert len(out.token_ids) > 0 and out.text.strip()
    assert llm.engine.models.target.config.num_hidden_layers == load_model(str(DEMO_TARGET))[0].config.num_hidden_layers
    assert llm.engine.leak_report() == []


@pytest.fixture(scope="module")
def plain_demo():
    llm = LLM(device="cpu", max_seq_len=256)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


CONFIGS = {
    "contiguous": dict(kv_cache_backend="contiguous"),
    "paged-prefix": dict(kv_cache_backend="paged"),
    "paged-preempt": dict(kv_cache_backend="paged", block_size=4, num_blocks=60),  # 8 requests need ~120
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("batch", [1, 8])
def test_demo_pair_greedy_parity(make_llm, plain_demo, config, batch):
    # (the token budget pays each decoding row's round, 5 tokens, first: 48 leaves prefill
    # enough that 8 requests run together and the small pool preempts)
    llm = make_llm(DEMO_TARGET, max_seq_len=256, max_batch_size=batch, use_speculative_decoding=True,
                   draft_model=str(DEMO_DRAFT), spec_length=4, max_num_batched_tokens=48, **CONFIGS[config])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    if batch == 1:
        outs = [llm.generate([p], params)[0] for p in PROMPTS]
    else:
        outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == plain_demo
    rate = llm.engine.runner.stats.acceptance_rate
    assert 0.3 < rate < 1.0  # a trained draft: well above chance, below a copy of the target
    if config == "paged-preempt" and batch == 8:
        assert llm.engine.scheduler.num_preemptions > 0


def test_demo_pair_first_speculative_token_distribution(make_llm):
    """Marginal of the 2nd generated token (the 1st produced by a speculation round; the 1st
    comes from the prefill) vs the exact target marginal sum_t1 p(t1) p(t2 | t1)."""
    prompt = "def fibonacci(n):\n    "
    llm = make_llm(DEMO_TARGET, max_seq_len=64, max_batch_size=64, use_speculative_decoding=True,
                   draft_model=str(DEMO_DRAFT), spec_length=3)
    ids = llm.tokenizer.encode(prompt)
    model = llm.engine.models.target
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([ids]))[0, -1].float(), -1)  # [V]
        top = torch.nonzero(p1 > 1e-4).flatten()  # keeps almost all the mass
        rows = torch.tensor([ids + [t] for t in top.tolist()])
        p2 = torch.softmax(model(rows)[:, -1].float(), -1)  # [n, V]
        exact = (p1[top, None] * p2).sum(0) / p1[top].sum()  # [V]
    n = 3000
    params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=s) for s in range(n)]
    outs = llm.generate(prompt_token_ids=[ids] * n, sampling_params=params)
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[1] for o in outs]), minlength=exact.numel())
    tv = 0.5 * (counts.double() / n - exact.double()).abs().sum().item()
    support = int((exact > 1 / n).sum())
    assert tv < 0.5 * (2 * support / n) ** 0.5 + 0.03, (tv, support)  # a few noise levels
    assert llm.engine.runner.stats.drafts > 0
