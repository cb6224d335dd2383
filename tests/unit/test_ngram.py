"""Tests for n-gram drafting: the chapter's traces, fallback, windowing, rollback, proposer sync."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from infer.engine.request import Request
from infer.sampling import SamplingParams
from infer.speculative.ngram import NgramConfig, NgramProposer, NgramTable, PromptLookupTable
from infer.speculative.tree import Draft, chain_shape

WORDS: dict[str, int] = {}


def chain(proposer: NgramProposer, requests: list[Request], ks: list[int]) -> list[list[int]]:
    """The proposer's chain drafts (over a chain as long as the longest k) as token lists."""
    drafts = proposer.propose(requests, chain_shape(max([*ks, 1])), ks)
    return [[t for t, ok in zip(d.token_ids, d.valid, strict=True) if ok] for d in drafts]


def ids(text: str) -> list[int]:
    """Words -> stable token ids (a toy vocabulary shared by all tests)."""
    return [WORDS.setdefault(w, len(WORDS) + 100) for w in text.split()]


def brute_counts(tokens: list[int], window: int, max_order: int, min_order: int) -> Counter:
    """Every n-gram lying wholly inside the last `window` tokens, counted directly."""
    w = tokens[-window:]
    counts: Counter = Counter()
    for n in range(min_order, max_order + 1):
        for i in range(len(w) - n + 1):
            counts[tuple(w[i : i + n])] += 1
    return counts


def brute_predict(tokens: list[int], context: list[int], window: int, max_order: int, min_order: int):
    """Longest context first; most frequent continuation; ties -> most recently seen."""
    w = tokens[-window:]
    for c in range(max_order - 1, min_order - 2, -1):
        if len(context) < c:
            continue
        ctx = context[len(context) - c :]
        seen: dict[int, tuple[int, int]] = {}
        for i in range(len(w) - c):
            if w[i : i + c] == ctx:
                count, _ = seen.get(w[i + c], (0, -1))
                seen[w[i + c]] = (count + 1, i)
        if seen:
            return max(seen, key=lambda t: seen[t])
    return None


def make_request(prompt: list[int], rid: str = "r0") -> Request:
    return Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=SamplingParams())


# --- the chapter's traces -------------------------------------------------------------------


def test_chapter_prediction_chain_the_cat_sat_on_the_mat() -> None:
    table = NgramTable()  # MAX_ORDER 4: contexts of up to 3 tokens
    table.extend(ids("under the mat . the cat sat on the mat"))
    # the chain as traced: three 4-gram hits, then the 4-gram misses and the 3-gram answers
    assert table.predict(ids("the cat sat")) == ids("on")[0]
    assert table.predict(ids("cat sat on")) == ids("the")[0]
    assert table.predict(ids("sat on the")) == ids("mat")[0]
    assert table.continuations(ids("on the mat")) == {}
    assert table.continuations(ids("the mat")) == {ids(".")[0]: 1}
    assert table.propose(ids("the cat sat"), 4) == ids("on the mat .")


def test_chapter_frequency_table_picks_most_frequent_continuation() -> None:
    table = NgramTable(window=10_000)
    sentences = ["the cat sat on ."] * 47 + ["the cat sat down ."] * 3
    random.Random(0).shuffle(sentences)
    table.extend(ids(" ".join(sentences + ["the cat sat and ."])))  # "and" is the most recent
    expected = {ids("on")[0]: 47, ids("down")[0]: 3, ids("and")[0]: 1}
    assert table.continuations(ids("the cat sat")) == expected
    assert table.predict(ids("the cat sat")) == ids("on")[0]


def test_fallback_to_lower_orders_prefers_longest_context() -> None:
    table = NgramTable()
    # bigram x -> a is the most frequent, but the trigram w x -> b is more specific
    table.extend(ids("x a . x a . x a . w x b . v u x y z"))
    assert table.predict(ids("w x")) == ids("b")[0]  # 3-gram hit
    assert table.predict(ids("q x")) == ids("a")[0]  # (q, x) unseen -> bigram x
    assert table.predict(ids("v u x")) == ids("y")[0]  # 4-gram hit beats both
    assert table.predict(ids("q w x")) == ids("b")[0]  # 4-gram miss -> 3-gram


def test_no_draft_when_nothing_matches() -> None:
    table = NgramTable()
    assert table.propose(ids("a b"), 4) == []  # empty table
    table.extend(ids("a b c d"))
    assert table.predict(ids("d")) is None  # d was never followed by anything
    assert table.propose(ids("z z"), 4) == []
    assert table.propose(ids("c"), 4) == ids("d")  # chain stops at the first miss
    assert table.propose(ids("a"), 0) == []


def test_ties_broken_by_most_recent() -> None:
    table = NgramTable()
    table.extend(ids("a b a c"))
    assert table.predict(ids("a")) == ids("c")[0]  # b and c once each; c is newer
    table.extend(ids("a b"))
    assert table.predict(ids("a")) == ids("b")[0]  # b now twice


def test_min_and_max_order_limit_contexts() -> None:
    only_long = NgramTable(max_order=3, min_order=3)
    only_long.extend(ids("p q r s"))
    assert only_long.predict(ids("z r")) is None  # bigram r -> s exists but is not used
    assert only_long.predict(ids("q r")) == ids("s")[0]
    only_bigram = NgramTable(max_order=2, min_order=2)
    only_bigram.extend(ids("p q r s"))
    assert set(only_bigram.counts()) == {tuple(ids("p q")), tuple(ids("q r")), tuple(ids("r s"))}


# --- window ---------------------------------------------------------------------------------


def test_window_evicts_ngrams_that_leave() -> None:
    table = NgramTable(window=6)
    table.extend(ids("a b c d e f"))
    assert table.predict(ids("a")) == ids("b")[0]
    table.extend(ids("g"))  # "a" leaves the window: every n-gram starting at it goes
    assert table.predict(ids("a")) is None
    assert table.continuations(ids("a b c")) == {}
    assert table.history == ids("b c d e f g")
    assert table.predict(ids("b c d")) == ids("e")[0]


@pytest.mark.parametrize(("max_order", "min_order", "window"), [(4, 2, 16), (5, 3, 9), (2, 2, 4)])
def test_windowed_counts_and_predictions_match_brute_force(
    max_order: int, min_order: int, window: int
) -> None:
    rng = random.Random(max_order * 100 + window)
    table = NgramTable(max_order, min_order, window)
    tokens: list[int] = []
    for _ in range(60):
        chunk = [rng.randrange(4) for _ in range(rng.randrange(1, 5))]
        tokens += chunk
        table.extend(chunk)
        assert table.counts() == brute_counts(tokens, window, max_order, min_order)
        assert table.history == tokens[-window:]
        for _ in range(4):
            context = [rng.randrange(5) for _ in range(rng.randrange(0, max_order + 1))]
            assert table.predict(context) == brute_predict(tokens, context, window, max_order, min_order)


@pytest.mark.parametrize("window", [16, 32, 64])
def test_extending_in_chunks_builds_the_same_tables_as_token_by_token(window: int) -> None:
    # chunks of 16 tokens or more that fit in the window go level by level (`_extend_levels`),
    # the part of a chunk past the window's room token by token: the tables (counts, newest
    # positions, cached best continuations) come out exactly as one token at a time
    rng = random.Random(window)
    chunked, single = NgramTable(4, 2, window), NgramTable(4, 2, window)
    tokens: list[int] = []
    bulk = 0
    for i in range(40):
        chunk = [rng.randrange(5) for _ in range(rng.choice([1, 3, 8, 16, 20, 70]) if i else 16)]
        room = window - len(chunked.history)
        bulk += len(chunk) >= 16 and room >= 16
        tokens += chunk
        chunked.extend(iter(chunk))  # (any iterable)
        for t in chunk:
            single.extend([t])
        assert chunked._levels == single._levels and chunked._tail == single._tail
        assert chunked.history == single.history == tokens[-window:]
        assert chunked.counts() == brute_counts(tokens, window, 4, 2)
        for _ in range(4):
            context = [rng.randrange(5) for _ in range(rng.randrange(0, 4))]
            # (both: `predict` fills the cache of best continuations it finds stale)
            assert chunked.predict(context) == single.predict(context) == brute_predict(
                tokens, context, window, 4, 2)
    assert bulk >= (1 if window == 16 else 2)  # the level-by-level path ran


def test_rebuild_from_window_equals_incremental() -> None:
    rng = random.Random(7)
    tokens = [rng.randrange(6) for _ in range(300)]
    incremental = NgramTable(window=32)
    for t in tokens:
        incremental.extend([t])
    rebuilt = NgramTable(window=32)
    rebuilt.extend(tokens[-32:])
    assert incremental.counts() == rebuilt.counts()


# --- rollback -------------------------------------------------------------------------------


def test_propose_does_not_change_the_table() -> None:
    table = NgramTable()
    table.extend(ids("the cat sat on the mat . the cat sat on the"))
    before, history = table.counts(), table.history
    draft = table.propose(ids("the cat sat"), 4)
    assert draft == ids("on the mat .")
    assert table.counts() == before
    assert table.history == history


def test_rejected_drafts_never_enter_the_proposer_table() -> None:
    proposer = NgramProposer(NgramConfig(window=64))
    request = make_request(ids("a b c d a b c d a b"))
    (draft,) = proposer.propose([request], chain_shape(3), [3])
    assert draft == Draft.chain(chain_shape(3), ids("c d a")) and draft.probs is None
    # the target accepts "c", rejects "d" and emits the bonus "x" instead
    request.output_token_ids += ids("c x")
    proposer.on_accepted([request], [[0]])
    proposer.prefilled([request])  # (a table takes the tokens at its next lookup)
    counts = proposer.table("r0").counts()
    assert counts == brute_counts(request.all_token_ids, 64, 4, 2)
    assert tuple(ids("b c x")) in counts
    assert tuple(ids("a b c d")) in counts and counts[tuple(ids("a b c d"))] == 2  # not 3


# --- prompt lookup --------------------------------------------------------------------------


def test_prompt_lookup_prefers_longest_earlier_occurrence() -> None:
    table = PromptLookupTable()  # suffixes of 3 down to 1 tokens
    history = ids("p q r A B C . s r D E . p q r")
    table.extend(history)
    # "r" alone last continued with "D", but the 3-token suffix "p q r" matches earlier
    assert table.find(history) == (3, 3)
    assert table.propose(history, 3) == ids("A B C")
    assert table.propose(ids("z z r"), 2) == ids("D E")  # only "r" matches: its newest follower
    assert table.propose(ids("z z z"), 3) == []  # nothing matches: no draft


def test_prompt_lookup_copies_past_the_end_by_rematching() -> None:
    table = PromptLookupTable()
    history = ids("a b c a b c")
    table.extend(history)
    assert table.propose(history, 5) == ids("a b c a b")
    before = table.history
    table.propose(history, 5)
    assert table.history == before


def test_prompt_lookup_window_matches_brute_force() -> None:
    rng = random.Random(3)
    window, table, tokens = 12, PromptLookupTable(window=12), []
    for _ in range(80):
        tokens.append(rng.randrange(4))
        table.extend(tokens[-1:])
        w, offset = tokens[-window:], len(tokens) - len(tokens[-window:])
        context = [rng.randrange(4) for _ in range(3)]
        expected = None
        for c in (3, 2, 1):
            hits = [i for i in range(len(w) - c) if w[i : i + c] == context[-c:]]
            if hits:
                expected = (c, offset + hits[-1] + c)
                break
        assert table.find(context) == expected


# --- proposer -------------------------------------------------------------------------------


def test_proposer_syncs_incrementally_across_calls() -> None:
    proposer = NgramProposer()
    request = make_request(ids("one two three one two"))
    assert chain(proposer, [request], [2])[0] == ids("three one")
    table = proposer.table("r0")
    request.output_token_ids += ids("three four")
    chain(proposer, [request], [2])
    assert proposer.table("r0") is table  # extended in place, not rebuilt
    assert table.history == request.all_token_ids
    assert table.counts() == brute_counts(request.all_token_ids, 512, 4, 2)


def test_prefilled_builds_and_syncs_tables() -> None:
    # the runner builds the tables under the prefill's forward: a later proposal then has
    # only its lookup left to do
    proposer = NgramProposer()
    a, b = make_request(ids("one two three one two")), make_request(ids("four five four"))
    b.request_id = "r1"
    chain(proposer, [a], [2])
    table = proposer.table("r0")
    a.output_token_ids += ids("three four five one")
    proposer.prefilled([a, b])
    assert proposer.table("r0") is table and table.history == a.all_token_ids
    assert table.counts() == brute_counts(a.all_token_ids, 512, 4, 2)
    assert proposer.table("r1").history == b.all_token_ids  # built
    assert chain(proposer, [a], [2])[0] == ids("two three")


def test_a_request_given_k_zero_is_not_looked_up_nor_synced() -> None:
    # a round's propose gets every request of the batch, most at k = 0 at a large batch:
    # those cost nothing (their tables catch up when they draft, or under a forward)
    proposer = NgramProposer()
    a, b = make_request(ids("one two three one two")), make_request(ids("four five four five"), "r1")
    proposer.prefilled([a, b])
    b.output_token_ids += ids("four five")
    drafts = chain(proposer, [a, b], [2, 0])
    assert drafts[0] == ids("three one") and drafts[1] == []
    assert proposer.table("r1").history == ids("four five four five")  # untouched
    proposer.on_accepted([b], [[]])  # (nor after the round: the runner calls it for every request)
    assert proposer.table("r1").history == ids("four five four five")
    assert chain(proposer, [b], [1])[0] == ids("four")
    assert proposer.table("r1").history == b.all_token_ids


def test_leak_report_names_tables_still_held() -> None:
    proposer = NgramProposer()
    request = make_request(ids("one two three"))
    proposer.prefilled([request])
    assert proposer.leak_report() == ["n-gram tables kept for ['r0']"]
    proposer.release(request)
    assert proposer.leak_report() == []


def test_proposer_keeps_only_the_window_of_a_long_history() -> None:
    rng = random.Random(1)
    proposer = NgramProposer(NgramConfig(window=50))
    request = make_request([rng.randrange(10) for _ in range(200)])
    chain(proposer, [request], [4])
    for _ in range(30):
        request.output_token_ids.append(rng.randrange(10))
        chain(proposer, [request], [4])
    assert proposer.table("r0").history == request.all_token_ids[-50:]
    assert proposer.table("r0").counts() == brute_counts(request.all_token_ids, 50, 4, 2)


@pytest.mark.parametrize("gap", [49, 50, 120])  # shorter than, equal to, longer than the window
def test_proposer_catches_up_after_plain_steps(gap: int) -> None:
    # plain decode steps between proposals leave the table behind by `gap` tokens
    rng = random.Random(gap)
    proposer = NgramProposer(NgramConfig(window=50))
    request = make_request([rng.randrange(6) for _ in range(80)])
    chain(proposer, [request], [4])
    old = proposer.table("r0")
    request.output_token_ids += [rng.randrange(6) for _ in range(gap)]
    (draft,) = chain(proposer, [request], [4])
    assert (proposer.table("r0") is old) == (gap < 50)  # a long gap rebuilds from the window
    assert proposer.table("r0").counts() == brute_counts(request.all_token_ids, 50, 4, 2)
    fresh = NgramTable(window=50)
    fresh.extend(request.all_token_ids)
    assert draft == fresh.propose(request.all_token_ids, 4)


@pytest.mark.parametrize("new_output", ["", "x y z", "x y z w v"])  # shorter, same length, longer
def test_proposer_rebuilds_after_preemption_changes_history(new_output: str) -> None:
    proposer = NgramProposer()
    request = make_request(ids("k l m k l"))
    request.output_token_ids += ids("m n o")
    chain(proposer, [request], [3])
    old = proposer.table("r0")
    request.output_token_ids = ids(new_output)  # restarted: a different history
    (draft,) = chain(proposer, [request], [3])
    assert proposer.table("r0") is not old
    assert proposer.table("r0").counts() == brute_counts(request.all_token_ids, 512, 4, 2)
    fresh = NgramTable()
    fresh.extend(request.all_token_ids)
    assert draft == fresh.propose(request.all_token_ids, 3)


def test_proposer_batch_lengths_and_release() -> None:
    proposer = NgramProposer()
    a = make_request(ids("u v u v u"), "a")
    b = make_request(ids("novel tokens only"), "b")
    proposer.prefilled([a, b])  # (built under the prefill)
    drafts = chain(proposer, [a, b], [3, 2])
    assert drafts[0] == ids("v u v")
    assert drafts[1] == []  # nothing repeats: a plain decode step
    assert chain(proposer, [a], [0])[0] == []
    assert len(proposer) == 2
    proposer.release(a)
    assert proposer.table("a") is None and len(proposer) == 1
    proposer.release(a)  # releasing twice is harmless
    proposer.on_accepted([a], [[]])  # a released request is not resurrected
    assert proposer.table("a") is None


def test_proposer_prompt_lookup_method() -> None:
    proposer = NgramProposer(NgramConfig(method="prompt_lookup"))
    request = make_request(ids("def f ( x ) : return x def f ("))
    assert chain(proposer, [request], [4])[0] == ids("x ) : return")
    assert isinstance(proposer.table("r0"), PromptLookupTable)


def test_proposer_rejects_bad_depths() -> None:
    proposer = NgramProposer()
    request = make_request(ids("a b"))
    with pytest.raises(ValueError, match="one depth per request"):
        chain(proposer, [request], [1, 2])
    with pytest.raises(ValueError, match="depths must hold integers >= 0"):
        chain(proposer, [request], [-1])


# --- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "eagle"}, "method must be one of"),
        ({"min_order": 1}, "min_order must be an integer >= 2"),
        ({"max_order": 3, "min_order": 4}, r"max_order must be an integer >= min_order \(4\)"),
        ({"max_order": 2.5}, "max_order must be an integer"),
        ({"window": 3}, r"window must be an integer >= max_order \(4\)"),
        ({"window": True}, "window must be an integer"),
    ],
)
def test_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NgramConfig(**kwargs)


def test_tables_validate_their_arguments() -> None:
    with pytest.raises(ValueError, match="min_order"):
        NgramTable(min_order=1)
    with pytest.raises(ValueError, match="window"):
        PromptLookupTable(window=2)


