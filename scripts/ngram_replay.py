"""Replay n-gram adaptive speculation on the CPU: real tokens, simulated GPU step costs.

The demo target decodes for real on the CPU (eager), through the real `SpeculativeRunner`,
n-gram proposer, shadow drafts and `AdaptivePolicy`; only the clock is simulated. The
cost model is fed what each step would cost on the GPU, from a profile fitted to the H100
(plain step = 1; a round of longest draft k: `round_base + round_per_k * k` plain steps,
sampled rounds `sampled_extra` more; a step whose lookups all missed: `miss` plain steps).
The output is lossless whatever the policy decides, so the tokens follow the same
distribution in every variant, and the simulated time tells what the policy's decisions
cost or gain without the GPU's run-to-run noise.

    PYTHONPATH=src python scripts/ngram_replay.py [--generations 12] [--workload W1 W5] [--temperature 0 1]

Prints, per workload and temperature: simulated speed relative to plain decoding, rounds
and misses a generation, tokens a round.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

import torch

from infer import SamplingParams
from infer.bench.workloads import WORKLOADS, build_requests
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.loading import DEMO_TARGET
from infer.spec.costs import CostModel

PLAIN_SECONDS = 0.0004  # only ratios matter


@dataclass(frozen=True)
class Profile:
    round_base: float = 1.45  # a greedy round of k drafts: round_base + round_per_k * k plain steps
    round_per_k: float = 0.03
    sampled_extra: float = 0.15  # a sampled round's verification costs this much more
    miss: float = 1.05  # a step that asked for drafts and got none
    # a plain step outside a plain stretch (the policy asked, or a quiet step on the thin
    # path): the loop's rhythm broken costs host time (H100 ledger: choose steps ~0.24 of a
    # plain step more, quiet steps ~0.05)
    boundary: float = 0.2

    def round(self, k: int, sampled: bool) -> float:
        return self.round_base + self.round_per_k * k + (self.sampled_extra if sampled else 0.0)


class SimulatedCosts(CostModel):
    """A CostModel fed the profile's costs instead of the wall times it is given."""

    def __init__(self, k_max: int, profile: Profile, sampled: bool) -> None:
        super().__init__(k_max, draft_ratio={1: 0.0}, verify_ratio={1: [1.0] * (k_max + 1)},
                         forward_seconds={1: 0.7 * PLAIN_SECONDS})
        self.profile, self.sampled = profile, sampled

    def observe(self, batch_size: int, k: int, seconds: float, sampled: bool = False) -> None:
        cost = 1.0 if k == 0 else self.profile.round(k, self.sampled)
        super().observe(batch_size, k, cost * PLAIN_SECONDS, sampled)

    def observe_draft(self, batch_size: int, k: int, seconds: float, sampled: bool = False) -> None:
        super().observe_draft(batch_size, k, 0.02 * PLAIN_SECONDS, sampled)


def replay(engine: Engine, prompt: list[int], temperature: float, profile: Profile, generations: int,
           seed0: int) -> dict[str, float]:
    runner = engine.runner
    sampled = temperature > 0
    runner.cost_model = runner.policy.costs = SimulatedCosts(runner.spec_length, profile, sampled)
    policy = runner.policy
    # episodes time the CPU's real steps against the simulated plain step: their kappa
    # would mean nothing here (spec/episodes.py), so rounds are priced as simulated
    policy.calibration = None
    asked = {"misses": 0}
    no_proposal = policy.no_proposal

    def counting(request_id: str) -> bool:
        asked["misses"] += 1
        return no_proposal(request_id)

    policy.no_proposal = counting
    clock = tokens = rounds = misses = boundaries = 0.0
    stats = runner.stats
    for g in range(generations):
        engine.add_request(prompt, SamplingParams(temperature=temperature, max_tokens=256, ignore_eos=True,
                                                  seed=seed0 + g))
        engine.step()  # prefill: the same in both
        while engine.has_unfinished():
            before_rounds, before_misses = stats.drafts, asked["misses"]
            drafted = stats.draft_tokens
            stretch = runner._stretch.active
            out = engine.step()
            tokens += len(out)
            if stats.drafts > before_rounds:
                rounds += 1
                clock += profile.round(stats.draft_tokens - drafted, sampled)
            elif asked["misses"] > before_misses:  # (batch 1) asked for drafts, got none
                misses += 1
                clock += profile.miss
            else:
                clock += 1.0 if stretch else 1.0 + profile.boundary
                boundaries += not stretch
    del policy.no_proposal
    return {"speed": tokens / clock, "rounds": rounds / generations, "misses": misses / generations,
            "boundaries": boundaries / generations,
            "tokens_per_round": (stats.emitted_tokens / stats.drafts) if stats.drafts else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generations", type=int, default=12)
    ap.add_argument("--seeds", type=int, default=2, help="independent engines (policy state) per cell")
    ap.add_argument("--workload", nargs="+", default=["W1", "W5"], choices=["W1", "W5"])
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--round-base", type=float, default=Profile.round_base)
    ap.add_argument("--sampled-extra", type=float, default=Profile.sampled_extra)
    ap.add_argument("--boundary", type=float, default=Profile.boundary,
                    help="extra cost of a plain step outside a plain stretch, in plain steps")
    args = ap.parse_args()
    torch.manual_seed(0)
    profile = Profile(round_base=args.round_base, sampled_extra=args.sampled_extra, boundary=args.boundary)
    config = EngineConfig(model=str(DEMO_TARGET), use_cuda_graphs=False, max_batch_size=1, max_seq_len=1024,
                          use_speculative_decoding=True, speculative_method="ngram", spec_length=5,
                          spec_policy="adaptive")
    for workload in args.workload:
        for t in args.temperature:
            runs = []
            for s in range(args.seeds):
                engine = Engine(config)
                prompt = build_requests(WORKLOADS[workload], engine.vocab_size,
                                        engine.tokenizer).requests[0].prompt_ids
                runs.append(replay(engine, prompt, t, profile, args.generations, 1000 * s))
            print(f"{workload} T={t:g}: x{statistics.mean(r['speed'] for r in runs):.3f} "
                  f"(per engine {' '.join(format(r['speed'], '.3f') for r in runs)}), "
                  f"{statistics.mean(r['rounds'] for r in runs):.1f} rounds, "
                  f"{statistics.mean(r['misses'] for r in runs):.1f} misses, "
                  f"{statistics.mean(r['boundaries'] for r in runs):.1f} plain steps outside stretches a generation, "
                  f"{statistics.mean(r['tokens_per_round'] for r in runs):.2f} tokens a round", flush=True)


if __name__ == "__main__":
    main()
