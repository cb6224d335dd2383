"""Same-process A/B of the verification path on W5 (n-gram, fixed K=5): at T=0 the captured
acceptance step against the former eager argmax shortcut, at T=1 against the general eager
pipeline (logits_to_probs + verify); a torch.profiler kernel summary of each at T=0.
Diagnosis only.

    PYTHONPATH=src python scripts/verify_ab.py
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from infer import SamplingParams
from infer.bench.workloads import WORKLOADS, build_requests
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.loading import DEMO_TARGET
from infer.spec.rejection import VerifyResult
from infer.tokenizer import Tokenizer
from infer.transfer import tensor_on, to_device


def old_greedy_verify(runner, requests, drafts):  # noqa: ANN001, ANN201
    """The shortcut before the fused path: verification logits, argmax, prefix match."""
    from infer.cache.view import BatchLayout
    num_draft = [len(d.token_ids) for d in drafts]
    layout = BatchLayout.of([r.slot for r in requests], [r.num_computed_tokens for r in requests],
                            [k + 1 for k in num_draft])
    ids = torch.zeros((len(requests), layout.width), dtype=torch.long)
    for b, d in enumerate(drafts):
        row = [requests[b].last_token_id, *d.token_ids]
        ids[b, :len(row)] = torch.tensor(row)
    logits = runner.forward(ids, layout, all_logits=True)
    k = layout.width - 1
    draft_tokens = torch.zeros((len(requests), k), dtype=torch.long)
    for i, d in enumerate(drafts):
        draft_tokens[i, :len(d.token_ids)] = torch.tensor(d.token_ids)
    draft_tokens = to_device(draft_tokens, runner.device)
    target_argmax = logits.argmax(dim=-1)
    match = (draft_tokens == target_argmax[:, :k]).long()
    limit = tensor_on(num_draft, draft_tokens.device)[:, None]
    match = match * (torch.arange(k, device=draft_tokens.device)[None, :] < limit)
    accepted = match.cumprod(dim=1).sum(dim=1)
    both = torch.cat([draft_tokens, target_argmax, accepted[:, None]], dim=1).tolist()
    return VerifyResult(tokens=[row[:row[-1]] + [row[k + row[-1]]] for row in both], num_accepted=[r[-1] for r in both])


def run(engine: Engine, prompt: list[int], temperature: float) -> float:
    engine.add_request(prompt, SamplingParams(temperature=temperature, max_tokens=256, ignore_eos=True, seed=0))
    engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 255 * 1e3


def main() -> None:
    tok = Tokenizer.from_pretrained(DEMO_TARGET)
    prompt = build_requests(WORKLOADS["W5"], 8192, tok).requests[0].prompt_ids
    cfg = dict(model=str(DEMO_TARGET), use_cuda_graphs=torch.cuda.is_available(), max_batch_size=1,
               max_seq_len=1024, use_speculative_decoding=True, speculative_method="ngram", spec_length=5)
    fused, old, general = (Engine(EngineConfig(**cfg)) for _ in range(3))
    r = old.runner
    r._verify = lambda requests, drafts: old_greedy_verify(r, requests, drafts)
    general.runner.forward.verify = None  # the runner then takes the general pipeline
    for t, engines in ((0.0, {"captured": fused, "eager-argmax": old}), (1.0, {"captured": fused,
                                                                               "eager-general": general})):
        times = {n: [] for n in engines}
        for e in engines.values():
            run(e, prompt, t)
        for _ in range(5):
            for n, e in engines.items():
                times[n].append(run(e, prompt, t))
        for n, ts in times.items():
            print(f"T={t:g} {n}: {statistics.median(ts):.3f} ms/token, runs " + " ".join(f"{x:.3f}" for x in ts),
                  flush=True)
    for n, e in {"captured": fused, "eager-argmax": old}.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(e, prompt, 0.0)
        print(f"== T=0 {n}: GPU kernels")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=50))


if __name__ == "__main__":
    main()
