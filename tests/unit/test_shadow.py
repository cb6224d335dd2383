"""Shadow drafts (spec/shadow.py): taken for requests at K = 0 on schedule, checked against
the tokens that follow, reported to the policy as rounds; the policy's use of them."""

from __future__ import annotations

import pytest

from infer import SamplingParams
from infer.engine.request import Request
from infer.spec.policy import AdaptivePolicy, CostModel
from infer.spec.proposer import Draft
from infer.spec.shadow import ShadowDrafts, matched_prefix


@pytest.mark.parametrize("draft, actual, expected", [
    ([1, 2, 3], [1, 2, 3], (3, True)),  # the whole draft came true
    ([1, 2, 3], [1, 2, 3, 4], (3, True)),
    ([1, 2, 3], [1, 9], (1, True)),  # a difference decides it
    ([1, 2, 3], [9], (0, True)),
    ([1, 2, 3], [1, 2], (2, False)),  # too few tokens yet
    ([1, 2, 3], [], (0, False)),
])
def test_matched_prefix(draft, actual, expected):
    assert matched_prefix(draft, actual) == expected


class ScriptedProposer:
    """Proposes the next tokens of a script (what the request will really emit), with
    `wrong` substituted at a chosen draft position; records who was asked."""

    shadow_drafts = True
    catch_up_seconds = 0.0

    def __init__(self, script: list[int]) -> None:
        self.script, self.asked, self.wrong_at, self.lengths = script, [], None, []  # lengths: the ks asked
        self.plan: list[int | None] = []  # wrong_at of the next drafts, used up in order

    def propose(self, requests, ks):
        out = []
        for r, k in zip(requests, ks):
            self.asked.append((r.request_id, r.num_tokens))
            self.lengths.append(k)
            tokens = self.script[r.num_tokens:r.num_tokens + k]
            wrong_at = self.plan.pop(0) if self.plan else self.wrong_at
            if wrong_at is not None and wrong_at < len(tokens):
                tokens[wrong_at] = -1
            out.append(Draft(tokens, None))
        return out


def _request(rid: str, script: list[int], prompt_len: int) -> Request:
    return Request(rid, script[:prompt_len], SamplingParams(max_tokens=100))


def _emit(request: Request, script: list[int]) -> None:
    request.output_token_ids.append(script[request.num_tokens])


def test_shadow_schedule_check_and_backoff():
    script = list(range(100, 400))
    seen = []
    shadow = ShadowDrafts(k=3, observe=lambda rid, k, m: seen.append((rid, k, m)), interval=2, max_interval=16)
    proposer = ScriptedProposer(script)
    r = _request("a", script, 10)

    def step(k=0):
        shadow.take(proposer, [r], [k])
        _emit(r, script)
        shadow.check([r])

    step()  # first sight: a draft of 3 is taken before the step; one of its tokens is out now
    assert proposer.asked == [("a", 10)] and len(shadow) == 1 and seen == []
    step()
    step()  # no new draft while one is pending; the third token resolves it
    assert proposer.asked == [("a", 10)] and seen == [("a", 3, 3)] and len(shadow) == 0
    step()
    step()  # `interval` steps after the resolution: the next draft
    assert proposer.asked == [("a", 10), ("a", 14)]
    step()
    step()
    assert seen[-1] == ("a", 3, 3) and len(shadow) == 0

    # the interval (steps from a draft's resolution to the next draft) doubles while drafts
    # match fewer than 2 tokens (1 is what sampling matches by chance), up to max_interval,
    # and returns to `interval` after 2 or more matched
    proposer.plan = [0, 0, 1, 0, None, 1, 2]
    events = []  # (step, "ask" | matched)
    for i in range(80):
        asked, resolved = len(proposer.asked), len(seen)
        step()
        if len(proposer.asked) > asked:
            events.append((i, "ask"))
        if len(seen) > resolved:
            events.append((i, seen[-1][2]))
    gaps = [(matched, nxt - at) for (at, matched), (nxt, kind) in zip(events, events[1:])
            if matched != "ask" and kind == "ask"]
    assert gaps[:7] == [(0, 4), (0, 8), (1, 16), (0, 16), (3, 2), (1, 4), (2, 2)]
    shadow.release("a")
    assert shadow.leak_report() == []


def test_shadow_waits_for_requests_whose_proposer_state_is_not_ready():
    # a request whose table is being built (`ready` False) gets no shadow draft (the lookup
    # would build it on the critical path); it is looked at again at the very next step,
    # though the other requests' schedules would skip that step, and drafted once ready
    script = list(range(100, 300))
    ready = {"a": True, "b": False}
    shadow = ShadowDrafts(k=2, observe=lambda *a: None, interval=8)
    proposer = ScriptedProposer(script)
    proposer.ready = lambda r: ready[r.request_id]
    a, b = _request("a", script, 5), _request("b", script, 7)
    shadow.take(proposer, [a, b])
    assert proposer.asked == [("a", 5)]
    shadow.take(proposer, [a, b])
    assert proposer.asked == [("a", 5)]  # b still not ready, a pending
    ready["b"] = True
    shadow.take(proposer, [a, b])
    assert proposer.asked == [("a", 5), ("b", 7)]
    for rid in "ab":
        shadow.release(rid)
    assert shadow.leak_report() == []


def test_shadow_skips_speculating_requests_and_releases():
    script = list(range(100, 300))
    seen = []
    shadow = ShadowDrafts(k=2, observe=lambda rid, k, m: seen.append((rid, k, m)), interval=1)
    proposer = ScriptedProposer(script)
    a, b = _request("a", script, 5), _request("b", script, 7)
    shadow.take(proposer, [a, b], [0, 3])  # b speculates this step: no shadow for it
    assert proposer.asked == [("a", 5)]
    shadow.take(proposer, [a, b], [0, 3])  # a's draft is still pending (no token came)
    assert proposer.asked == [("a", 5)]
    shadow.take(proposer, [a, b], [0, 0])  # b's first plain step: its first shadow
    assert proposer.asked == [("a", 5), ("b", 7)]
    assert shadow.leak_report() != []
    shadow.release("a")
    shadow.release("b")
    assert shadow.leak_report() == [] and seen == []


def test_a_request_that_joins_gets_its_first_shadow_at_once():
    # the others' schedules must not delay a newcomer's first shadow (the policy keeps it
    # plain until that shadow is counted)
    script = list(range(100, 300))
    shadow = ShadowDrafts(k=2, observe=lambda *a: None, interval=8, max_interval=64)
    proposer = ScriptedProposer(script)
    a, b = _request("a", script, 5), _request("b", script, 7)
    shadow.take(proposer, [a], [0])
    _emit(a, script)
    _emit(a, script)
    shadow.check([a])  # a's draft resolved: its next one is 8 steps away
    shadow.take(proposer, [a], [0])
    assert proposer.asked == [("a", 5)]
    shadow.admit("b")
    shadow.take(proposer, [a, b], [0, 0])
    assert proposer.asked == [("a", 5), ("b", 7)]


def test_empty_shadow_draft_waits_an_interval():
    shadow = ShadowDrafts(k=2, observe=lambda *a: None, interval=3)
    proposer = ScriptedProposer([])  # proposes nothing
    r = _request("a", list(range(10)), 10)
    for _ in range(3):
        shadow.take(proposer, [r], [0])  # asked at first sight, then not for `interval` steps
    assert len(proposer.asked) == 1 and len(shadow) == 0
    shadow.take(proposer, [r], [0])
    assert len(proposer.asked) == 2


def test_shadow_config_validation():
    with pytest.raises(ValueError, match="k >= 1"):
        ShadowDrafts(k=0, observe=lambda *a: None)
    with pytest.raises(ValueError, match="interval"):
        ShadowDrafts(k=2, observe=lambda *a: None, interval=9, max_interval=8)


def _measured(costs: CostModel, steps: tuple[tuple[int, float], ...]) -> None:
    """Batch-1 steps (k, seconds) measured in both sampling modes alike."""
    for k, seconds in steps:
        for sampled in (False, True):
            costs.observe(1, k, seconds, sampled)


def _policy(shadowed: bool) -> AdaptivePolicy:
    return AdaptivePolicy(5, CostModel(5), shadowed=shadowed)


def test_full_shadow_match_restarts_a_low_estimate_from_the_prior():
    p = _policy(True)
    for _ in range(20):
        p.update("a", 5, 0)
    low = p.acceptance("a")
    assert low < 0.1
    p.observe_shadow("a", 5, 4)  # a partial match is one more round of evidence
    q = _policy(True)
    for _ in range(20):
        q.update("a", 5, 0)
    q.update("a", 5, 4)
    assert p.acceptance("a") == pytest.approx(q.acceptance("a"))
    assert p.acceptance("a") < p.prior_a
    p.observe_shadow("a", 5, 5)  # the whole draft came true: restart from the prior, then count it
    expected = (p.prior_a * p.prior_weight * p.decay + 5) / (p.prior_weight * p.decay + 5)
    assert p.acceptance("a") == pytest.approx(expected)


def test_shadowed_policy_does_not_restart_after_a_probe():
    for shadowed in (False, True):
        p = _policy(shadowed)
        for _ in range(20):
            p.update("a", 5, 0)
        p._est["a"].probing = True
        p.update("a", 1, 1)  # a successful probe
        restarted = p.acceptance("a") > 0.5
        assert restarted is (not shadowed)


def test_shadow_evidence_leaves_the_miss_backoff():
    # a miss backoff is about what the proposer has when really asked; a shadow that had a
    # draft must not make the request ask every step again (update() after a real round does)
    p = _policy(True)
    p.no_proposal("a")
    p.no_proposal("a")
    backoff = (p._est["a"].miss_until, p._est["a"].miss_interval)
    p.observe_shadow("a", 5, 3)
    assert (p._est["a"].miss_until, p._est["a"].miss_interval) == backoff == (4, 4)  # greedy: 2, 4, 8 ...
    p.update("a", 5, 3)
    assert p._est["a"].miss_interval == 0
    p._lookup("s", sampled=True)  # a sampled request waits the longest backoff at once (the watch ends it)
    p.no_proposal("s")
    assert (p._est["s"].miss_until, p._est["s"].miss_interval) == (p.max_probe_interval,) * 2
    p.observe_shadow("s", 5, 3)
    assert p._est["s"].miss_interval == p.max_probe_interval


def test_shadowed_request_decodes_plainly_until_its_first_shadow_is_counted():
    # the prior alone (a = 0.6) makes speculation pay here (verifying costs 1.9 plain steps);
    # a shadowed request still waits for the first shadow draft's evidence, an unshadowed one
    # speculates at once
    def policy(shadowed):
        costs = CostModel(5, draft_ratio={1: 0.0}, verify_ratio={1: [1.0] + [1.9] * 5})
        for k, seconds in ((0, 0.001), (0, 0.001), (5, 0.0019), (5, 0.0019)):
            costs.observe(1, k, seconds)
        return AdaptivePolicy(5, costs, shadowed=shadowed, plain_refresh=10_000)

    r = Request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=100))
    assert policy(False).choose([r], [3], 1000, [100]) == [5]
    p = policy(True)
    assert [p.choose([r], [3], 1000, [100])[0] for _ in range(10)] == [0] * 10
    p.observe_shadow("a", 5, 0)  # evidence that drafts fail (a: 0.6 -> 0.47): still plain
    assert p.choose([r], [3], 1000, [100]) == [0]
    q = policy(True)
    q.choose([r], [3], 1000, [100])
    q.observe_shadow("a", 5, 3)  # evidence that they pay (a -> 0.62)
    assert q.choose([r], [3], 1000, [100]) == [5]


def test_sampled_requests_start_from_a_lower_prior():
    # a sampled request accepts a draft token with probability p(t) at best: its prior (0.3)
    # does not make speculation pay where a greedy request's (0.6) does; evidence still can
    costs = CostModel(5, draft_ratio={1: 0.0}, verify_ratio={1: [1.0] + [1.9] * 5})
    _measured(costs, ((0, 0.001), (0, 0.001), (5, 0.0019), (5, 0.0019)))
    p = AdaptivePolicy(5, costs, plain_refresh=10_000, max_probe_interval=10_000)
    greedy = Request("g", [1, 2, 3], SamplingParams(temperature=0, max_tokens=100))
    sampled = Request("s", [1, 2, 3], SamplingParams(temperature=1.0, max_tokens=100))
    assert p.choose([greedy], [3], 1000, [100]) == [5]  # (costs are measured at batch 1)
    assert p.choose([sampled], [3], 1000, [100]) == [0]
    assert (p.acceptance("g"), p.acceptance("s")) == (0.6, 0.3)
    for _ in range(3):
        p.update("s", 5, 5)  # whole drafts accepted
    assert p.choose([sampled], [3], 1000, [100]) == [5]


def test_shadow_evidence_keeps_a_standing_plain_decision_unless_it_changes_it():
    # the runner skips `choose` while an all-plain decision stands (`quiet`); a shadow draft
    # that leaves the request at K = 0 must not end it (every end costs a full `choose`),
    # one that makes speculation pay must
    costs = CostModel(5, draft_ratio={1: 0.0}, verify_ratio={1: [1.0] + [1.9] * 5})
    for k, seconds in ((0, 0.001), (0, 0.001), (5, 0.0019), (5, 0.0019)):
        costs.observe(1, k, seconds)
    p = AdaptivePolicy(5, costs, shadowed=True, plain_refresh=10_000)
    r = Request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=1000))
    p.observe_shadow("a", 5, 0)
    for _ in range(20):
        p.observe_shadow("a", 5, 0)
    assert p.choose([r], [3], 10_000, [1000]) == [0]
    assert p.quiet([r])
    p.observe_shadow("a", 5, 1)  # still far below paying
    assert p.quiet([r])
    for _ in range(3):
        p.observe_shadow("a", 5, 4)  # now it pays
    assert p.acceptance("a") > 0.5
    assert not p.quiet([r])
    assert p.choose([r], [3], 10_000, [1000]) == [5]


def test_checking_in_the_next_step_changes_no_schedule():
    # a plain stretch checks pending drafts in the next step's `_in_flight`, before that
    # step's take, not right after the step: drafts must be asked at the same steps and
    # report the same matches, and `check` counts the drafts it resolved
    script = list(range(100, 400))

    def run(late: bool) -> tuple[list, list, int]:
        seen: list[tuple[int, int]] = []
        shadow = ShadowDrafts(k=3, observe=lambda rid, k, m: seen.append((k, m)), interval=2, max_interval=16)
        proposer = ScriptedProposer(script)
        proposer.plan = [0, 0, 1, None, 0, 2, 0, 0, 0, None]
        r = _request("a", script, 10)
        resolved = 0
        while r.num_tokens < 90:
            if late:
                resolved += shadow.check([r])
            shadow.take(proposer, [r], [0])
            _emit(r, script)
            if not late:
                resolved += shadow.check([r])
        if late:  # the step after the last
            resolved += shadow.check([r])
        return proposer.asked, seen, resolved

    asked, seen, resolved = run(late=True)
    assert (asked, seen) == run(late=False)[:2]
    assert len(seen) >= 8 and resolved == len(seen)
    assert {m for _, m in seen} >= {0, 1, 2, 3}  # backoffs and returns to `interval` both ran


def test_shadowed_probes_get_a_tenth_of_the_budget():
    # shadow drafts measure a shadowed request's acceptance for free, so its probes can only
    # re-measure the costs: priced at acceptance 0, paid from a tenth of the 1 % budget
    costs = CostModel(5, draft_ratio={1: 0.0}, verify_ratio={1: [1.0] * 6})
    for k, seconds in ((0, 0.001), (0, 0.001), (1, 0.0013), (1, 0.0013)):
        costs.observe(1, k, seconds)
    for _ in range(2):
        costs.observe_switch(1, 0.0005)
    p = AdaptivePolicy(5, costs, shadowed=True, plain_refresh=10_000)
    r = Request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=10_000))
    for _ in range(10):
        p.observe_shadow("a", 5, 0)
    ks = []
    for _ in range(4000):
        ks.append(p.choose([r], [3], 100_000, [10_000])[0])
        if ks[-1]:
            p.update("a", ks[-1], 0)
    probes = [i for i, k in enumerate(ks) if k]
    # a probe's round (1.3) and catch-up (0.5) less its one sure token: 0.8 plain steps lost,
    # at 0.1 % of the time one per 800 steps (at 1 %, one per 80)
    assert set(ks) == {0, 1}
    assert 4000 // 800 - 1 <= len(probes) <= 4000 // 800 + 1
    assert min(b - a for a, b in zip(probes, probes[1:])) >= 799


def test_a_watched_request_is_looked_up_every_step_until_a_draft_comes_true():
    # a request that missed (the proposer had nothing) is looked up at every step, not on the
    # shadow schedule; `found` is reported once a draft's first token is the one emitted
    script = list(range(100, 400))
    found, seen = [], []
    shadow = ShadowDrafts(k=3, observe=lambda rid, k, m: seen.append(m), interval=8, found=found.append)
    proposer = ScriptedProposer(script)
    proposer.wrong_at = 0  # drafts whose first token is wrong: never found
    r = _request("a", script, 10)
    shadow.take(proposer, [r], [0])  # first sight: a scheduled shadow
    _emit(r, script)
    shadow.check([r])
    assert len(proposer.asked) == 1 and seen == [0]
    schedule = (shadow._schedule["a"].due, shadow._schedule["a"].interval)
    shadow.watch("a")
    for _ in range(5):
        shadow.take(proposer, [r], [0])
        _emit(r, script)
        # resolved at once (its first token was wrong): no `found`, and no evidence (a watch
        # looks up at every step while the text has no match: it would flood the estimate)
        assert shadow.check([r]) == 0
    assert len(proposer.asked) == 6 and not found and seen == [0]  # asked every step while watched
    assert proposer.lengths == [3] + [2] * 5  # a watch's lookups draft the two tokens `found` reads
    assert (shadow._schedule["a"].due, shadow._schedule["a"].interval) == schedule  # the schedule's own
    proposer.wrong_at = 1  # the first token comes true
    shadow.take(proposer, [r], [0])
    _emit(r, script)
    assert shadow.check([r]) == 1 and found == ["a"]  # found at its first token (it is still pending)
    _emit(r, script)
    assert shadow.check([r]) == 0 and seen == [0] and found == ["a"]  # resolved quietly
    asked = len(proposer.asked)
    for _ in range(3):  # no longer watched: back on the schedule (not due for a while)
        shadow.take(proposer, [r], [0])
        _emit(r, script)
        shadow.check([r])
    assert len(proposer.asked) == asked and found == ["a"]
    shadow.watch("a")
    assert shadow.leak_report() == ["shadow schedules kept for ['a']", "shadow watches kept for ['a']"]
    shadow.release("a")
    assert shadow.leak_report() == []


def test_a_watched_request_with_nothing_to_draft_is_asked_again_next_step():
    shadow = ShadowDrafts(k=2, observe=lambda *a: None, interval=8, found=lambda rid: None)
    proposer = ScriptedProposer([])  # proposes nothing
    r = _request("a", list(range(10)), 10)
    shadow.watch("a")
    for _ in range(4):
        shadow.take(proposer, [r], [0])
    assert len(proposer.asked) == 4 and len(shadow) == 0


def test_proposal_ready_ends_the_miss_wait_and_a_plain_decision_only_if_the_request_would_speculate():
    # shadowed: a miss waits the longest backoff (the runner watches the request); the watch's
    # `proposal_ready` ends it, and ends a standing all-plain decision when the request's
    # estimate would have it speculate (not when it would stay plain anyway)
    costs = CostModel(5, draft_ratio={1: 0.0}, verify_ratio={1: [1.0] + [1.1] * 5})
    _measured(costs, ((0, 0.001), (0, 0.001), (5, 0.0012), (5, 0.0012)))
    p = AdaptivePolicy(5, costs, shadowed=True, plain_refresh=10_000)
    r = _request("a", list(range(10)), 10)
    p._lookup("a", sampled=True)  # (a greedy request also asks again on its 2, 4, 8 ... backoff)
    p.observe_shadow("a", 5, 5)  # evidence: speculating pays
    assert p.choose([r], [10], 10_000, [50])[0] > 0
    p.no_proposal("a")
    p.observe_shadow("a", 5, 5)  # evidence for speculating does not end the wait: `choose` would not
    waited = 0
    while p.quiet([r]) and waited < 20:
        waited += 1
    assert waited == 20  # waits for the watch, not 2, 4, 8 ... steps
    p.proposal_ready("a")
    assert not p.quiet([r]) and p.choose([r], [10], 10_000, [50])[0] > 0
    p.no_proposal("a")
    for _ in range(30):
        p.observe_shadow("a", 5, 0)  # drafts fail: it would stay plain
    assert p.choose([r], [10], 10_000, [50]) == [0] and p.quiet([r])
    p.proposal_ready("a")
    assert p.quiet([r])  # the decision stands
    p.proposal_ready("unknown")  # a request the policy never saw: nothing to do


class ShortProposer(ScriptedProposer):
    """Right drafts, but never longer than `length` tokens (the n-gram chain ends there)."""

    length = 2

    def propose(self, requests, ks):
        return [Draft(d.token_ids[:self.length], None) for d in super().propose(requests, ks)]


@pytest.mark.parametrize("k, length, found_expected", [(5, 1, False), (5, 2, True), (2, 2, True), (1, 1, True)])
def test_a_watch_finds_only_drafts_whose_chain_goes_on(k, length, found_expected):
    # the real lookup at the next step continues the draft past its first token: a draft
    # whose chain ended there would miss, so it is not `found` (with k = 1, the whole draft
    # is all there is to go by)
    script = list(range(100, 400))
    found = []
    shadow = ShadowDrafts(k=k, observe=lambda *a: None, interval=8, found=found.append)
    proposer = ShortProposer(script)
    proposer.length = length
    r = _request("a", script, 10)
    shadow.watch("a")
    for _ in range(4):
        shadow.take(proposer, [r], [0])
        _emit(r, script)
        shadow.check([r])
    assert (found == ["a"]) == found_expected


def test_a_short_draft_is_not_found_and_a_watch_runs_out():
    # a draft of one token: the proposer's chain ended there, the real lookup would miss;
    # not `found`. A watch lasts `max_interval` steps (the policy asks by then)
    script = list(range(100, 400))
    found = []
    shadow = ShadowDrafts(k=3, observe=lambda *a: None, interval=8, max_interval=16, found=found.append)
    proposer = ShortProposer(script)  # one-token drafts, always right
    proposer.length = 1
    r = _request("a", script, 10)
    shadow.take(proposer, [r], [0])  # first sight
    _emit(r, script)
    shadow.check([r])
    shadow.watch("a")
    asked = []
    for _ in range(40):
        before = len(proposer.asked)
        shadow.take(proposer, [r], [0])
        asked.append(len(proposer.asked) - before)
        _emit(r, script)
        shadow.check([r])
    assert not found
    assert sum(asked[:15]) == 15  # watched: at every step
    assert sum(asked[17:]) <= 4  # then the schedule (every 8 steps)
    assert shadow.leak_report() == ["shadow schedules kept for ['a']"]  # the watch ran out


def test_check_found_reports_right_after_the_step_and_only_once():
    # in a plain stretch the other checks wait for the next step's forward; `found` must not
    # (a step later the next token would have to continue the draft as well)
    script = list(range(100, 400))
    found, seen = [], []
    shadow = ShadowDrafts(k=3, observe=lambda rid, k, m: seen.append(m), interval=8, found=found.append)
    proposer = ScriptedProposer(script)
    r, other = _request("a", script, 10), _request("b", script, 12)
    proposer.wrong_at = 0
    shadow.take(proposer, [r, other], [0, 0])  # first sight: scheduled drafts for both (wrong)
    _emit(r, script)
    _emit(other, script)
    assert shadow.check([r, other]) == 2 and not found
    proposer.wrong_at = None
    shadow.watch("a")
    shadow.watch("b")
    assert shadow.check_found([r]) == 0  # nothing pending yet
    shadow.take(proposer, [r, other], [0, 0])
    assert shadow.check_found([r, other]) == 0  # taken, its tokens not emitted yet
    _emit(r, script)
    _emit(other, script)
    assert shadow.check_found([r]) == 1 and found == ["a"]  # only the requests passed are looked at
    assert shadow.check_found([r]) == 0 and found == ["a"]  # once: the watch ended
    assert shadow.check([r, other]) == 1 and found == ["a", "b"]  # `check` finds "b" as well
    assert seen == [0, 0]  # the watches' lookups are no evidence (the first-sight drafts were)


def test_a_request_the_proposer_keeps_no_state_for_is_asked_again_only_after_the_interval():
    # `admits` False (n-gram: no table worth its cost): no shadow draft, no watch, and no
    # `ready` asked at every step (it would be False: the scan would run each step); asked
    # again after `interval` steps, and drafted once admitted
    script = list(range(100, 300))
    admitted, asks = {"a": False}, []
    shadow = ShadowDrafts(k=2, observe=lambda *a: None, interval=4)
    proposer = ScriptedProposer(script)
    proposer.admits = lambda r: (asks.append(shadow._step), admitted[r.request_id])[1]
    proposer.ready = lambda r: False  # (a request turned down is never ready)
    a = _request("a", script, 5)
    shadow.watch("a")  # a miss while it had no table: nothing to watch
    for _ in range(9):
        shadow.take(proposer, [a])
    assert proposer.asked == [] and asks == [1, 5, 9] and "a" not in shadow._watched
    admitted["a"] = True
    proposer.ready = lambda r: True
    for _ in range(4):
        shadow.take(proposer, [a])
    assert proposer.asked == [("a", 5)]
    shadow.release("a")
    assert shadow.leak_report() == []
