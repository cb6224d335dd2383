"""Replay the adaptive speculation policy on the CPU against a simulated draft model.

No model runs: each decode step costs what a cost profile says (in plain-step units), and
each drafted token is accepted with a fixed probability (a geometric acceptance, as the
paper assumes). The real `AdaptivePolicy` and `CostModel` decide and learn, fed wall times
the way `SpeculativeRunner` feeds them (plain steps, rounds, drafting, the draft's
catch-up after plain steps). Generations follow one another on the same policy, as in a
benchmark: the costs it learned carry over, the acceptance estimates do not.

Profiles are fitted to the demo pair on an H100 (sixth pass, `docs/benchmarks.md`): a
round costs `round_base + round_per_k * K` plain steps when speculating back to back,
`probe_extra` more after plain steps, plus the draft's catch-up on the tokens it skipped (a
new request's first round: its whole prompt) in chunks of 128, as `DraftModelProposer`.

    PYTHONPATH=src python scripts/policy_replay.py [--seeds 8] [--generations 20]

Prints, per workload: speed relative to plain decoding (tokens / simulated time), rounds
and probes per generation, and fixed K = k_max for comparison.
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass

from infer.engine.speculative_runner import PLAIN_RESAMPLE_EVERY, PLAIN_SAMPLE_EVERY
from infer.spec.draft_model import DRAFT_MAX_FEED, DraftModelProposer
from infer.spec.policy import AdaptivePolicy, CostModel, FixedPolicy

PLAIN_SECONDS = 0.0004  # a plain demo step on the H100; only ratios matter


@dataclass(frozen=True)
class Profile:
    name: str
    acceptance: float  # per drafted token
    sampled: bool  # the request samples at T > 0 (its prior is the sampled one)
    round_base: float = 2.5
    round_per_k: float = 0.25
    probe_extra: float = 0.4
    switch_fixed: float = 0.2  # the draft's catch-up: a fixed part and a part per 128-token chunk
    switch_per_chunk: float = 0.5
    prompt_tokens: int = 128
    draft_fixed: float = 0.5  # drafting's share of a round: fixed part + per token
    draft_per_k: float = 0.25
    first_rounds_extra: float = 3.0  # the first round of each K after start-up is slow
    tokens: int = 256


PROFILES = (
    Profile("W1 T=0", 0.93, False),
    # refitted on an H100 (2026-11-27, `scripts/round_cost.py`): K=1 rounds 2.35 plain steps
    # back to back, K=5 3.75, a catch-up chunk ~0.9; acceptance when speculating through ~0.94
    Profile("W1 T=0, H100 refit", 0.94, False, round_base=2.0, round_per_k=0.35, switch_per_chunk=0.9,
            draft_fixed=0.7, draft_per_k=0.28),
    Profile("W5 T=0", 0.85, False, prompt_tokens=640),
    Profile("W1 T=1", 0.73, True),
    Profile("W5 T=1", 0.68, True, prompt_tokens=640),
    Profile("random draft", 0.0, False),
    Profile("3B shape, random draft", 0.0, False, round_base=1.1, round_per_k=0.51, probe_extra=0.1,
            switch_fixed=0.3, switch_per_chunk=0.3, draft_fixed=0.1, draft_per_k=0.51),
    # compute-bound pairs where speculation pays: adaptive should stay close to fixed K
    Profile("3B shape, a = 0.8 draft", 0.8, False, round_base=1.1, round_per_k=0.3, probe_extra=0.1,
            switch_fixed=0.3, switch_per_chunk=0.3, draft_fixed=0.1, draft_per_k=0.3),
    Profile("3B shape, a = 0.8 draft, T=1", 0.8, True, round_base=1.1, round_per_k=0.3, probe_extra=0.1,
            switch_fixed=0.3, switch_per_chunk=0.3, draft_fixed=0.1, draft_per_k=0.3),
)


@dataclass
class _Request:
    request_id: str
    num_computed_tokens: int
    sampling_params: object


class _MaxFeed:
    max_feed = DRAFT_MAX_FEED


class _Params:
    def __init__(self, sampled: bool) -> None:
        self.greedy = not sampled


def replay(profile: Profile, policy_factory, seed: int, generations: int, k_max: int = 5) -> dict[str, float]:
    rng = random.Random(seed)
    costs = CostModel(k_max, draft_ratio={1: 0.42}, verify_ratio={1: [1.0, 0.96, 1.0, 1.03, 1.03, 1.04]},
                      forward_seconds={1: 0.6 * PLAIN_SECONDS})
    policy = policy_factory(k_max, costs)
    units = DraftModelProposer.catch_up_units.__get__(_MaxFeed())
    total_time = 0.0
    rounds = probes = 0
    seen_k: dict[int, int] = {}
    plain_steps = sampled_at = 0
    for g in range(generations):
        r = _Request(f"r{g}", 128, _Params(profile.sampled))
        emitted, behind, last_round = 0, r.num_computed_tokens, False
        while emitted < profile.tokens:
            left = profile.tokens - emitted
            k = policy.choose([r], [r.num_computed_tokens], 10_000, [left])[0]
            noise = rng.uniform(0.96, 1.04)  # mean 1: plain decoding is x1.000
            if k == 0:
                t = noise
                plain_steps += 1
                # as the runner: one stretch step in PLAIN_SAMPLE_EVERY (not one right after a
                # round), else only while the baseline is missing or stale
                if ((not last_round and plain_steps % PLAIN_SAMPLE_EVERY == 0) or plain_steps <= 2
                        or plain_steps - sampled_at >= PLAIN_RESAMPLE_EVERY or not costs.has_plain(1, profile.sampled)):
                    costs.observe(1, 0, t * PLAIN_SECONDS, profile.sampled)
                    sampled_at = plain_steps
                emitted += 1
                r.num_computed_tokens += 1
                behind += 1
                last_round = False
                total_time += t
                continue
            probe = not last_round
            probes += probe
            rounds += 1
            switch = 0.0
            chunks = units(behind)
            if chunks:
                switch = profile.switch_fixed + profile.switch_per_chunk * chunks
                costs.observe_switch(1, switch * PLAIN_SECONDS, chunks, profile.sampled)
            accepted = 0
            while accepted < k and rng.random() < profile.acceptance:
                accepted += 1
            t = (profile.round_base + profile.round_per_k * k + (profile.probe_extra if probe else 0.0)) * noise
            seen_k[k] = seen_k.get(k, 0) + 1
            if seen_k[k] <= 1:
                t += profile.first_rounds_extra
            costs.observe_draft(1, k, (profile.draft_fixed + profile.draft_per_k * k) * noise * PLAIN_SECONDS,
                                profile.sampled)
            costs.observe(1, k, t * PLAIN_SECONDS, profile.sampled)
            policy.update(r.request_id, k, accepted)
            n = min(accepted + 1, left)
            emitted += n
            r.num_computed_tokens += n
            behind = 1 if accepted == k else 0  # the draft holds the drafts it accepted
            last_round = True
            total_time += t + switch
        policy.release(r.request_id)
    return {"speed": generations * profile.tokens / total_time, "rounds": rounds / generations,
            "probes": probes / generations}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--generations", type=int, default=20)
    ap.add_argument("--k-max", type=int, default=5)
    args = ap.parse_args()
    units = DraftModelProposer.catch_up_units.__get__(_MaxFeed())
    variants = {"adaptive": lambda k, c: AdaptivePolicy(k, c, catch_up_units=units),
                "fixed": lambda k, c: FixedPolicy(k)}
    for profile in PROFILES:
        cells = []
        for name, factory in variants.items():
            runs = [replay(profile, factory, s, args.generations, args.k_max) for s in range(args.seeds)]
            speed = statistics.median(x["speed"] for x in runs)
            cells.append(f"{name} x{speed:.3f} ({statistics.mean(x['rounds'] for x in runs):.1f} rounds, "
                         f"{statistics.mean(x['probes'] for x in runs):.1f} probes /gen, "
                         f"min x{min(x['speed'] for x in runs):.3f})")
        print(f"{profile.name:24s} " + "; ".join(cells))


if __name__ == "__main__":
    main()
