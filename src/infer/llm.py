"""LLM: the offline, synchronous front (vLLM-style); all prompts and samples run at once, continuously batched.

    llm = LLM(model="path-or-hub-id", dtype="bfloat16", device="cuda")   # kwargs = EngineConfig
    outs = llm.generate(["prompt", ...], SamplingParams(temperature=0, max_tokens=64))   # or prompt_token_ids=[[1, 2]]
    outs = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(n=4))   # 4 samples: outs[0].outputs
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.request import Request
from infer.engine.output import CompletionOutput, RequestOutput
from infer.sampling import SamplingParams, derive_seed

Message = dict[str, str]


class LLM:
    """A model loaded for offline generation: `generate` for prompts, `chat` for conversations.

    `model` is a local directory in Hugging Face layout, a hub id, a llama.cpp `.gguf` file,
    a dummy shape such as "dummy:llama-3.2-3b" (random weights, for timing), or None for the
    bundled demo target. Every other keyword is a field of `infer.EngineConfig` (device, threads,
    dtype, max_batch_size, max_seq_len, use_speculative_decoding, speculative_method,
    draft_model, spec_length, tensor_parallel_size, ...), validated: a wrong name or value
    raises ValueError naming it. `with LLM(...) as llm:` closes the engine (and its worker
    processes) at the end of the block; generating after `close()` raises RuntimeError.
    """

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **engine_kwargs)
        self.engine = Engine(self.config)
        self.closed = False

    def close(self) -> None:
        """End the engine's worker processes (tensor parallelism; done too when the LLM is
        garbage-collected, or at exit). Generating afterwards raises RuntimeError."""
        self.closed = True
        self.engine.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this LLM is closed (close() was called, or its `with` block ended): "
                               "create a new LLM to generate")

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def tokenizer(self):  # noqa: ANN201 - Tokenizer | None
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Complete every prompt; one RequestOutput per prompt, in order.

        Give `prompts` (a string or a list of strings, tokenized with the model's tokenizer,
        BOS added as it is configured) or `prompt_token_ids` (lists of ids), not both.
        `sampling_params` is one SamplingParams for all prompts or one per prompt; the
        default is `SamplingParams()` (temperature 1.0, at most 16 tokens). All prompts run
        together with continuous batching. Each output's `outputs` holds `n` samples (one by
        default): the text, token ids, finish reason ("stop" or "length"), log-probabilities
        when asked for, and the speculative acceptance statistics when speculation is on.
        `use_tqdm` is accepted for vLLM compatibility and ignored.
        """
        self._check_open()
        texts, id_lists = self._prompts(prompts, prompt_token_ids)
        return self._complete(id_lists, _per_prompt(sampling_params, len(id_lists)), texts)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of {"role", "content"} dicts) or to several (a
        list of such lists), rendered with the model's chat template; one RequestOutput per
        conversation. `sampling_params` as in `generate`. Special-token strings inside the
        messages are encoded as what they are, text (`Tokenizer.encode_chat`); the
        template's own special tokens stay real.
        """
        self._check_open()
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this model has no tokenizer")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(list(c), add_generation_prompt=add_generation_prompt)
                   for c in conversations]
        ids = [self.tokenizer.encode_chat(list(c), add_generation_prompt=add_generation_prompt)
               for c in conversations]
        return self._complete(ids, _per_prompt(sampling_params, len(ids)), list(prompts))

    def _complete(self, id_lists: list[list[int]], params: list[SamplingParams],
                  texts: list[str | None]) -> list[RequestOutput]:
        """Run every sample of every prompt together; one RequestOutput per prompt. A bad
        prompt leaves nothing queued."""
        for ids, p in zip(id_lists, params, strict=True):
            self.engine.validate_prompt(ids, p)
        requests: list[list[Request]] = []
        try:
            for ids, p in zip(id_lists, params, strict=True):
                requests.append([])
                for i in range(p.n):
                    requests[-1].append(self.engine.add_request(ids, replace(p, n=1, seed=derive_seed(p.seed, i))))
        except BaseException:
            for r in (r for samples in requests for r in samples):
                self.engine.abort(r.request_id)
            raise
        self._run([r for samples in requests for r in samples])
        return [_to_output(samples, t) for samples, t in zip(requests, texts, strict=True)]

    def _prompts(self, prompts: str | Sequence[str] | None,
                 prompt_token_ids: Sequence[Sequence[int]] | Sequence[int] | None
                 ) -> tuple[list[str | None], list[list[int]]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts (text) or prompt_token_ids")
        if prompt_token_ids is not None:
            ids = token_id_lists(prompt_token_ids)
            return [None] * len(ids), ids
        texts = [prompts] if isinstance(prompts, str) else list(prompts or [])
        bad = next((t for t in texts if not isinstance(t, str)), None)
        if bad is not None:
            raise TypeError(f"prompts are strings (got a {type(bad).__name__}): pass token ids as prompt_token_ids")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt_token_ids instead of text")
        return list(texts), [self.tokenizer.encode(t) for t in texts]

    def _run(self, requests: list[Request]) -> None:
        try:
            while any(not r.is_finished for r in requests):
                self.engine.step()
        except BaseException:
            for r in requests:
                self.engine.abort(r.request_id)
            raise


def token_id_lists(prompt_token_ids: Sequence[Sequence[int]] | Sequence[int]) -> list[list[int]]:
    """Prompts of token ids as lists of Python ints: a list of prompts, or one flat prompt (NumPy
    or torch integer arrays too); TypeError naming anything that is not an integer id."""
    if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__len__"):
        raise TypeError(f"prompt_token_ids is a list of prompts, each a list of token ids "
                        f"(got a {type(prompt_token_ids).__name__})")
    items = list(prompt_token_ids)
    if items and _is_id(items[0]):
        items = [items]  # one prompt, given flat
    out = []
    for i, prompt in enumerate(items):
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
            raise TypeError(f"prompt_token_ids[{i}] is {prompt!r}, not a list of token ids: give each prompt as "
                            "a list of ids")
        ids = list(prompt.tolist() if hasattr(prompt, "tolist") else prompt)
        bad = next((t for t in ids if not _is_id(t)), None)
        if bad is not None:
            raise TypeError(f"prompt_token_ids[{i}] holds {bad!r} ({type(bad).__name__}): token ids are integers")
        out.append([int(t) for t in ids])
    return out


def _is_id(value: object) -> bool:
    """An integer token id: an int or a NumPy / torch integer scalar, not a bool."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (hasattr(value, "dtype") and getattr(value, "ndim", 1) == 0
                                      and "int" in str(value.dtype))


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, (str, bytes, dict)) or not isinstance(params, Sequence):
        raise TypeError(f"sampling_params is a SamplingParams or a list of them, one per prompt (got a "
                        f"{type(params).__name__}; build one with SamplingParams(**fields))")
    bad = next((p for p in params if not isinstance(p, SamplingParams)), None)
    if bad is not None:
        raise TypeError(f"sampling_params holds a {type(bad).__name__}: each must be a SamplingParams")
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts: give one, or one per prompt")
    return list(params)


def _completion(index: int, request: Request) -> CompletionOutput:
    return CompletionOutput(
        index=index, text=request.output_text, token_ids=list(request.output_token_ids),
        finish_reason=request.finish_reason.value if request.finish_reason else None,
        logprobs=list(request.output_logprobs) if request.sampling_params.logprobs is not None else None,
        acceptance_rate=request.mean_acceptance_rate(), mean_accepted_length=request.mean_accepted_length())


def _to_output(samples: list[Request], prompt: str | None) -> RequestOutput:
    """One prompt's output: its samples' completions; the timing metrics are the first sample's."""
    request = samples[0]
    completions = [_completion(i, r) for i, r in enumerate(samples)]
    metrics: dict[str, float] = {}
    if request.first_token_time is not None:
        metrics["time_to_first_token_s"] = request.first_token_time - request.arrival_time
    if request.finish_time is not None and request.first_token_time is not None and len(request.output_token_ids) > 1:
        metrics["decode_tokens_per_s"] = (len(request.output_token_ids) - 1) / max(
            request.finish_time - request.first_token_time, 1e-9)
    return RequestOutput(request.request_id, prompt, list(request.prompt_token_ids), completions,
                         finished=all(r.is_finished for r in samples), metrics=metrics)
