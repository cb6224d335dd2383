"""Shadow rounds: a free draft scored against the tokens plain steps produce, and the
adaptive policy taking that as evidence, so that speculation resumes where drafts start
to match instead of at the next (ever rarer) probe."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from infer.speculative.ngram import NgramConfig, NgramProposer
from infer.speculative.policy import AdaptiveConfig, AdaptivePolicy
from infer.speculative.policy import ShadowRounds, score
from infer.speculative.tree import Draft, TreeShape


@dataclass
class _Request:
    request_id: str
    text: list[int]  # every token the request will hold
    num_tokens: int
    pending_tokens: int = 0  # the last ones, in flight: counted, not yet known

    def token_slice(self, lo: int, hi: int | None = None) -> list[int]:
        known = self.num_tokens - self.pending_tokens
        return self.text[lo:min(known, len(self.text) if hi is None else hi)]


class _CopyProposer:
    """Proposes the text's true continuation inside [copy_from, len), wrong tokens before."""

    def __init__(self, copy_from: int) -> None:
        self.copy_from, self.calls = copy_from, 0

    def propose(self, requests: Sequence[_Request], shape: TreeShape, depths: Sequence[int]) -> list[Draft]:
        self.calls += 1
        drafts = []
        for r, k in zip(requests, depths, strict=True):
            n = r.num_tokens
            true = r.text[n:n + k]
            drafts.append(Draft.chain(shape, true if n >= self.copy_from else [t + 1 for t in true]))
        return drafts


def test_score_is_the_common_prefix_once_decided() -> None:
    assert score([5, 6, 7], [5, 6, 7, 8]) == 3
    assert score([5, 6, 7], [5, 9]) == 1 and score([5, 6, 7], [4]) == 0
    assert score([5, 6, 7], [5, 6]) is None and score([5], []) is None


def test_a_pending_chain_settles_when_the_tokens_decide_it() -> None:
    text = list(range(100, 140))
    r = _Request("a", text, 10)
    shadow = ShadowRounds(_CopyProposer(copy_from=0), k=4)
    shadow.draft([r])
    assert shadow.settle([r]) == [] and shadow.leak_report() != []
    r.num_tokens = 13  # three of the four drafted tokens produced, all matching: undecided
    assert shadow.settle([r]) == []
    shadow.draft([r])  # one chain pending at a time: not replaced
    r.num_tokens = 14
    assert shadow.settle([r]) == [("a", 4, 4)] and shadow.leak_report() == []
    wrong = ShadowRounds(_CopyProposer(copy_from=100), k=4)
    wrong.draft([r])
    r.num_tokens = 15
    assert wrong.settle([r]) == [("a", 4, 0)]  # decided at the first token
    wrong.draft([r])
    wrong.drop("a")
    assert wrong.leak_report() == []
    with pytest.raises(ValueError, match="k >= 1"):
        ShadowRounds(_CopyProposer(0), k=0)


def test_a_chain_drafted_under_a_token_in_flight_reads_the_known_tokens() -> None:
    # overlapped scheduling: at a plain step the newest token is still on the device
    r = _Request("a", list(range(100, 140)), 10, pending_tokens=1)
    seen = []

    class _Recording(_CopyProposer):
        def propose(self, requests, shape, depths):
            seen.extend((q.num_tokens, q.pending_tokens, q.token_slice(q.num_tokens - 1, q.num_tokens))
                        for q in requests)
            return super().propose(requests, shape, depths)

    shadow = ShadowRounds(_Recording(copy_from=0), k=4)
    shadow.draft([r])
    assert seen == [(9, 0, [108])]  # a history whose count matches what it holds
    r.num_tokens, r.pending_tokens = 13, 1  # tokens 9..11 known, all matching: undecided
    assert shadow.settle([r]) == []
    r.num_tokens = 14  # token 12 known: the chain (tokens 9..12) is decided
    assert shadow.settle([r]) == [("a", 4, 4)]


def test_an_ngram_table_follows_overlapped_shadow_drafts_without_rebuilding() -> None:
    text = [1, 2, 3, 4] * 30
    r = _Request("a", text, 20, pending_tokens=1)
    proposer = NgramProposer(NgramConfig(method="ngram", max_order=3, min_order=2, window=64))
    shadow = ShadowRounds(proposer, k=3)
    shadow.draft([r])
    table = proposer.table("a")
    done = []
    for n in range(21, 60):  # a plain step a token, each under one in flight
        r.num_tokens = n
        done += shadow.settle([r])
        shadow.draft([r])
        assert proposer.table("a") is table  # synced incrementally, never rebuilt
    assert len(done) >= 8 and all(accepted == drafted == 3 for _, drafted, accepted in done), done


def test_observe_moves_the_estimate_and_nothing_else() -> None:
    p = AdaptivePolicy(AdaptiveConfig(k_max=5, c=0.0))
    p.observe("unknown", 5, 5)  # no estimate yet: ignored
    assert p.leak_report() == []
    p.choose([_Request("a", [], 0)])
    before = p.acceptance("a")
    p.observe("a", 5, 5)
    assert p.acceptance("a") > before
    for _ in range(6):
        p.observe("a", 5, 0)
    assert p.acceptance("a") < before


def _plain_steps_in_copy(shadowed: bool, copy_from: int = 300, length: int = 700) -> int:
    """One request through the runner's flow (settle, choose, round or plain step, draft):
    drafts fail before `copy_from` and match after it; rounds cost 0.8 plain steps beyond the
    model. Returns the plain steps taken where drafts would have matched."""
    cfg = AdaptiveConfig(k_max=5, c=0.0, verify_slope=0.05)
    policy, proposer = AdaptivePolicy(cfg), _CopyProposer(copy_from)
    shadow = ShadowRounds(proposer, cfg.k_max) if shadowed else None
    r = _Request("a", list(range(length)), 1)
    plain_in_copy = 0
    while r.num_tokens < length - cfg.k_max - 1:
        if shadow is not None:
            for request_id, drafted, accepted in shadow.settle([r]):
                policy.observe(request_id, drafted, accepted)
        (k,) = policy.choose([r], overhead=0.8)
        if k:
            if shadow is not None:
                shadow.drop(r.request_id)
            (d,) = proposer.propose([r], TreeShape((1,) * k), [k])
            accepted = score(d.token_ids[:d.num_proposed], r.text[r.num_tokens:]) or 0
            policy.update(r.request_id, k, accepted)
            r.num_tokens += accepted + 1
            continue
        if shadow is not None:
            shadow.draft([r])
        plain_in_copy += r.num_tokens >= copy_from
        r.num_tokens += 1
    return plain_in_copy


def test_shadow_rounds_bring_speculation_back_where_drafts_start_to_match() -> None:
    # without them the request waits for probes, whose waits doubled while drafts failed
    with_shadow, without = _plain_steps_in_copy(True), _plain_steps_in_copy(False)
    assert with_shadow <= 12 and without >= 3 * with_shadow, (with_shadow, without)
