"""`n`, `logprobs` / `top_logprobs`, presence / frequency penalties and `echo` through the
server and the official `openai` client, checked against a reference decoded from the
model's own logits (full forwards, no cache; see test_engine_logprobs): greedy, seeded
sampling, and under speculative decoding, streamed and not."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from helpers.reference import reference
from infer import EngineConfig, SamplingParams
from infer.models.loading.loader import load_model
from infer.sampling import derive_seed
from infer.server.launch import LiveServer
from helpers.live import openai_api, serving
from infer.server.logprob_format import LogprobFormatter
from infer.tokenization import Tokenizer


MODEL = "tiny"
PROMPT = "The quick brown fox"
TOKENS = 8


@pytest.fixture(scope="module")
def model(ckpt_a: Path) -> torch.nn.Module:
    return load_model(str(ckpt_a), dtype="float32")[0]


@pytest.fixture(scope="module")
def tok(ckpt_a: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(ckpt_a)


@pytest.fixture(scope="module", params=["plain", "spec"])
def server(request: pytest.FixtureRequest, ckpt_a: Path) -> Iterator[LiveServer]:
    extra = {"use_speculative_decoding": True, "draft_model": str(ckpt_a), "spec_length": 3} \
        if request.param == "spec" else {}
    live = LiveServer.start(EngineConfig(model=str(ckpt_a), device="cpu", max_batch_size=8, **extra), MODEL,
                            max_queued_requests=256)
    live.kind = request.param  # type: ignore[attr-defined]
    yield from serving(live)


api = openai_api


def ref(model: torch.nn.Module, tok: Tokenizer, **params: Any) -> tuple[list[int], list[Any]]:
    return reference(model, tok.encode(PROMPT), SamplingParams(max_tokens=TOKENS, ignore_eos=True, **params))


def test_greedy_logprobs_equal_the_reference(server: LiveServer, model: torch.nn.Module, tok: Tokenizer) -> None:
    tokens, want = ref(model, tok, temperature=0)
    r = api(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0, logprobs=2,
                                       extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    fmt = LogprobFormatter(tok)
    assert lp.tokens == [fmt.token(t) for t in tokens]
    assert lp.token_logprobs == pytest.approx([w[0] for w in want], abs=1e-4)
    assert [list(d) for d in lp.top_logprobs] == [[fmt.token(t) for t in w[1][:2]] for w in want]
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(len(tokens))]
    assert r.choices[0].text == tok.decode(tokens)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_logprobs_equal_the_reference(server: LiveServer, model: torch.nn.Module, tok: Tokenizer,
                                           stream: bool) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    prompt = tok.encode_chat(messages)
    tokens, want = reference(model, prompt, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))
    kwargs = dict(model=MODEL, messages=messages, max_tokens=TOKENS, temperature=0, logprobs=True, top_logprobs=3,
                  extra_body={"ignore_eos": True})
    if stream:
        entries = [e for c in api(server).chat.completions.create(stream=True, **kwargs)
                   if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        entries = api(server).chat.completions.create(**kwargs).choices[0].logprobs.content
    fmt = LogprobFormatter(tok)
    assert [e.token for e in entries] == [fmt.token(t) for t in tokens]
    assert [e.bytes for e in entries] == [list(tok.token_bytes(t) or b"") for t in tokens]
    assert [e.logprob for e in entries] == pytest.approx([w[0] for w in want], abs=1e-4)
    assert [[t.token for t in e.top_logprobs] for e in entries] == [[fmt.token(t) for t in w[1]] for w in want]


def test_n_seeded_choices_equal_the_reference(server: LiveServer, model: torch.nn.Module, tok: Tokenizer) -> None:
    r = api(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0.9, seed=42, n=3,
                                       logprobs=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 3 * TOKENS and r.usage.prompt_tokens == len(tok.encode(PROMPT))
    texts = set()
    for i, choice in enumerate(r.choices):
        tokens, want = ref(model, tok, temperature=0.9, seed=derive_seed(42, i))
        if server.kind == "plain":  # type: ignore[attr-defined]
            assert choice.text == tok.decode(tokens)  # each choice: the reference with its derived seed
        else:  # speculation draws other uniforms: the log-probabilities must still be the target's
            want = reference_along(model, tok, tok.encode(PROMPT), choice.logprobs.tokens)
        assert choice.logprobs.token_logprobs == pytest.approx([w[0] for w in want], abs=1e-4)
        texts.add(choice.text)
    assert len(texts) > 1  # distinct seeds: distinct samples


def reference_along(model: torch.nn.Module, tok: Tokenizer, prompt: list[int],
                    shown: list[str]) -> list[Any]:
    """Log-probabilities along the emitted tokens (found from the strings the server showed)."""
    fmt = LogprobFormatter(tok)
    by_string = {fmt.token(i): i for i in range(tok.vocab_size)}
    ids, out = list(prompt), []
    with torch.no_grad():
        for text in shown:
            token = by_string[text]
            log_probs = torch.log_softmax(model(torch.tensor([ids]))[0, -1].float(), dim=-1)
            out.append((log_probs[token].item(), None))
            ids.append(token)
    return out


def test_n_greedy_choices_are_identical_and_share_the_prompt_cache(server: LiveServer, tok: Tokenizer,
                                                                     model: torch.nn.Module) -> None:
    pool = server.engine.engine.runner.cache_pool
    long_prompt = PROMPT + " jumps over the lazy dog" * 12  # several full KV blocks
    before = pool.prefix_hit_tokens
    r = api(server).completions.create(model=MODEL, prompt=long_prompt, max_tokens=TOKENS, temperature=0, n=4,
                                       extra_body={"ignore_eos": True})
    tokens, _ = reference(model, tok.encode(long_prompt), SamplingParams(temperature=0, max_tokens=TOKENS,
                                                                         ignore_eos=True))
    assert [c.text for c in r.choices] == [tok.decode(tokens)] * 4
    blocks = (len(tok.encode(long_prompt)) - 1) // pool.block_size
    assert pool.prefix_hit_tokens - before >= 3 * blocks * pool.block_size  # choices 1..3 reused choice 0's KV


def test_n_streams_interleave_by_index(server: LiveServer) -> None:
    chunks = list(api(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=1.0,
                                                 seed=3, n=2, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    whole = api(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=1.0, seed=3,
                                           n=2, extra_body={"ignore_eos": True})
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert len(mine) == TOKENS and mine[-1].finish_reason == "length"
        if server.kind == "plain":  # type: ignore[attr-defined]
            assert "".join(c.text for c in mine) == whole.choices[i].text
    assert chunks[-1].usage.completion_tokens == 2 * TOKENS


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_penalties_equal_the_reference(server: LiveServer, model: torch.nn.Module, tok: Tokenizer,
                                       stream: bool) -> None:
    params = dict(presence_penalty=1.5, frequency_penalty=1.0)
    tokens, _ = ref(model, tok, temperature=0, **params)
    plain, _ = ref(model, tok, temperature=0)
    assert tokens != plain  # the penalties matter for this prompt
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True},
                  **params)
    if stream:
        text = "".join(c.choices[0].text for c in api(server).completions.create(stream=True, **kwargs))
    else:
        text = api(server).completions.create(**kwargs).choices[0].text
    assert text == tok.decode(tokens)
    if server.kind == "plain":  # type: ignore[attr-defined]
        seeded, _ = ref(model, tok, temperature=0.8, seed=9, **params)
        r = api(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0.8, seed=9,
                                           extra_body={"ignore_eos": True}, **params)
        assert r.choices[0].text == tok.decode(seeded)


def test_echo_returns_the_prompt_first(server: LiveServer) -> None:
    client = api(server)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True))
    assert streamed == echoed.choices[0].text
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_logprob_values_are_finite_json(server: LiveServer) -> None:
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "logprobs": 5, "temperature": 0})
    values = [v for d in r.json()["choices"][0]["logprobs"]["top_logprobs"] for v in d.values()]
    assert values and all(math.isfinite(v) and v <= 0 for v in values)
