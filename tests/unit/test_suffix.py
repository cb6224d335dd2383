"""Suffix decoding's pure parts (CPU, no model): the bounded-depth suffix trie against counts
taken by brute force (extended token by token and in pieces, several sequences, removal),
its node accounting; the shared cache's token bound and oldest-first eviction; the draft
trees' growth (budget, probability floor, children per node, depth, breadth-first order);
the proposer's drafts (chains, trees, the cache's, depth limits), its tries' life (prompt
built at prefill, extended incrementally, rebuilt on a replaced history, finished outputs
into the cache, leak report); the engine config's checks."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from infer import EngineConfig, SamplingParams
from infer.engine.request import Request, RequestState
from infer.speculative.node_tree import DynamicShape, NodeTree
from infer.speculative.suffix import SuffixConfig, SuffixProposer
from infer.speculative.suffix_draft import grow_tree
from infer.speculative.suffix_trie import ROOT, SuffixCache, SuffixTrie


def _occurrences(seqs: list[list[int]], depth: int) -> Counter:
    occ: Counter = Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(i + depth, len(s)) + 1):
                occ[tuple(s[i:j])] += 1
    return occ


def _assert_counts(trie: SuffixTrie, seqs: list[list[int]]) -> None:
    """Every string shorter than D: found, its next tokens with their brute-force counts."""
    occ = _occurrences(seqs, trie.max_depth)
    for string in occ:
        if len(string) >= trie.max_depth:
            continue
        pos = trie.walk(string)
        assert pos is not None, string
        total, kids = trie.children(pos, len(string), 10**6)
        want = {s[-1]: c for s, c in occ.items() if len(s) == len(string) + 1 and s[:-1] == string}
        assert {t: c for t, c, _ in kids} == want, string
        assert total == sum(want.values()) and trie.has_next(pos, len(string)) == bool(want)
    assert trie.walk([1 + max((t for s in seqs for t in s), default=0)]) is None  # (a token never seen)
    assert trie.num_nodes == _nodes_below(trie, trie.walk([]), 0)  # (every node counted, none leaked)


def _nodes_below(trie: SuffixTrie, pos: int, depth: int) -> int:
    """Nodes (not tails: positions >= 0) reachable below `pos`."""
    _, kids = trie.children(pos, depth, 10**6)
    return sum(1 + _nodes_below(trie, kid, depth + 1) for _, _, kid in kids if kid < 0)


@pytest.mark.parametrize("seed", range(4))
def test_trie_counts_every_substring_as_brute_force_does(seed):
    rng = random.Random(seed)
    for _ in range(25):
        trie = SuffixTrie(rng.randint(2, 6))
        seqs: dict[int, list[int]] = {}
        closed: set[int] = set()
        for _ in range(rng.randint(1, 8)):
            action = rng.random()
            if action < 0.65 or not seqs:  # grow a sequence (several may grow interleaved), in pieces
                seq = rng.randrange(4)
                if seq in closed:
                    continue
                piece = [rng.randrange(rng.randint(1, 3)) for _ in range(rng.randint(0, 9))]
                trie.extend(seq, piece)
                seqs.setdefault(seq, []).extend(piece)
            elif action < 0.75:
                seq = rng.choice(list(seqs))
                trie.close(seq)
                closed.add(seq)
            else:
                seq = rng.choice(list(seqs))
                trie.remove(seq)
                del seqs[seq]
                closed.discard(seq)
            _assert_counts(trie, list(seqs.values()))
            assert trie.num_tokens == sum(len(s) for s in seqs.values())
        for seq in list(seqs):
            trie.remove(seq)
        assert trie.num_nodes == 0 and not trie.has_next(ROOT, 0)  # every node and tail went with its sequence


def test_a_closed_sequence_takes_no_more_tokens_and_ids_are_checked():
    trie = SuffixTrie(4)
    trie.extend(1, [1, 2])
    trie.close(1)
    with pytest.raises(ValueError, match="closed"):
        trie.extend(1, [3])
    with pytest.raises(ValueError, match="sequence ids"):
        trie.extend(-1, [3])
    with pytest.raises(ValueError, match="max_depth"):
        SuffixTrie(0)


def test_strings_seen_once_take_no_node():
    trie = SuffixTrie(8)
    trie.extend(0, list(range(100)))  # all distinct: every string seen once
    assert trie.num_nodes == 0 and trie.children(trie.walk([]), 0, 1000)[0] == 100
    trie.extend(0, [5, 6, 7])  # "5 6 7" again: nodes for it, its prefixes' suffixes included
    assert trie.num_nodes == 6  # 5, 5 6, 5 6 7, 6, 6 7, 7
    total, kids = trie.children(trie.walk([5, 6]), 2, 4)
    assert (total, [(t, c) for t, c, _ in kids]) == (2, [(7, 2)])
    total, kids = trie.children(trie.walk([5, 6, 7]), 3, 4)
    assert (total, [(t, c) for t, c, _ in kids]) == (1, [(8, 1)])  # the second occurrence is at the end


def test_longest_match_needs_a_next_token_and_leaves_room():
    trie = SuffixTrie(6)
    trie.extend(0, [1, 2, 3, 4, 9, 2, 3, 4])
    m, pos = trie.longest_match([7, 2, 3, 4], max_len=5)
    assert m == 3 and trie.children(pos, m, 4)[1][0][0] == 9  # "2 3 4" went on with 9 once
    assert trie.longest_match([3, 4, 1], 5)[0] == 1  # "1" went on with 2
    assert trie.longest_match([8], 5) is None  # never seen
    assert trie.longest_match([9, 2, 3, 4], 2)[0] == 2  # capped by max_len
    assert trie.longest_match([2, 3, 4], 5)[0] == 3 and SuffixTrie(6).longest_match([1], 5) is None


def test_the_cache_holds_at_most_its_capacity_and_evicts_the_oldest():
    rng = random.Random(0)
    cache = SuffixCache(max_depth=5, capacity=60)
    added = []
    for i in range(40):
        seq = [100 + i] + [rng.randrange(3) for _ in range(rng.randint(1, 25))]  # a first token of its own
        cache.add(seq)
        added.append(seq)
        assert cache.num_tokens == cache.trie.num_tokens <= 60
        assert cache.trie.num_nodes <= 60 * 5  # at most D nodes a token held
        held = [s for s in added if cache.trie.walk(s[:1]) is not None]
        assert held == added[len(added) - len(held):]  # the newest, in order: the oldest went first
        assert sum(map(len, held)) == cache.num_tokens
    _assert_counts(cache.trie, [cache.trie.tokens(seq) for seq in cache._order])
    cache.add(list(range(200, 300)))  # longer than the capacity: its last 60 tokens
    assert len(cache) == 1 and cache.trie.walk([239]) is None and cache.trie.walk([240]) is not None
    cache.clear()
    assert len(cache) == 0 and cache.num_tokens == 0 and cache.trie.num_nodes == 0 and not cache.trie.has_next(ROOT, 0)
    empty = SuffixCache(5, 0)
    empty.add([1, 2, 3])
    assert len(empty) == 0 and empty.trie.num_tokens == 0


def _trie_of(*seqs: list[int], depth: int = 8) -> SuffixTrie:
    trie = SuffixTrie(depth)
    for i, s in enumerate(seqs):
        trie.extend(i, s)
        trie.close(i)
    return trie


def test_grow_tree_takes_the_likeliest_nodes_breadth_first():
    # after "1 2": 3 (x3, then 4 5) or 7 (x1, then 8)
    trie = _trie_of([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 7, 8])
    pos = trie.walk([1, 2])
    tree = grow_tree(trie, pos, 2, max_depth=4, budget=10, branch=4, min_prob=0.0)
    # probabilities: 3 .75, 4 .75, 5 .5, 6 .25, 7 .25, 8 .25; breadth-first, siblings by count
    assert tree.parents == (-1, -1, 0, 1, 2, 2) and tree.tokens == (3, 7, 4, 8, 5, 6)
    assert tree.score == pytest.approx(0.75 * 2 + 0.5 + 0.25 * 3) and not tree.is_path
    assert grow_tree(trie, pos, 2, 4, budget=3, branch=4, min_prob=0.0).tokens == (3, 4, 5)  # the best 3
    assert grow_tree(trie, pos, 2, 4, budget=10, branch=4, min_prob=0.3).tokens == (3, 4, 5)  # 0.25s cut
    assert grow_tree(trie, pos, 2, 4, budget=10, branch=1, min_prob=0.0).tokens == (3, 4, 5)  # one child each
    assert grow_tree(trie, pos, 2, 2, budget=10, branch=4, min_prob=0.0).tokens == (3, 7, 4, 8)  # depth 2
    assert grow_tree(trie, pos, 2, 0, budget=10, branch=4, min_prob=0.0).tokens == ()
    path = grow_tree(trie, pos, 2, 4, budget=3, branch=4, min_prob=0.0)
    assert path.is_path and path.parents == (-1, 0, 1)


def test_grow_tree_stops_at_the_tries_depth():
    trie = _trie_of([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], depth=4)
    tree = grow_tree(trie, trie.walk([1, 2]), 2, max_depth=4, budget=10, branch=2, min_prob=0.0)
    assert tree.tokens == (3, 4)  # strings of at most 4 tokens are counted


SHAPE = DynamicShape(nodes=8, branch=2, depth=4)


def _request(rid: str, prompt: list[int], output: list[int] = (), params: SamplingParams | None = None) -> Request:
    r = Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=params or SamplingParams())
    r.output_token_ids = list(output)
    return r


def test_a_repeat_is_drafted_as_a_chain_and_a_fork_as_a_tree():
    proposer = SuffixProposer(SuffixConfig(max_depth=12, cache_tokens=0))
    chain_req = _request("a", [5, 6, 7, 8, 9, 10, 11, 5, 6, 7])  # "5 6 7" went on with 8 9 10 11
    (draft,) = proposer.propose([chain_req], SHAPE, [4])
    assert draft.shape.is_chain and draft.token_ids[:3] == (8, 9, 10) and draft.probs is None
    assert draft.num_proposed == 3  # a 3-token match: 3 nodes
    fork = _request("b", [5, 6, 7, 1, 2, 3, 9, 5, 6, 7, 1, 2, 4, 8, 5, 6, 7, 1, 2])  # "5 6 7 1 2": 3 | 4
    drafts = proposer.propose([chain_req, fork], SHAPE, [4, 4])
    tree = drafts[1].shape
    assert isinstance(tree, NodeTree) and tree.widths == SHAPE.widths and tree.root_children == (0, 1)
    # 5 nodes (a 5-token match): 3's line down to the round's depth first (a tie), then 4
    assert drafts[1].token_ids[:5] == (3, 4, 9, 5, 6) and tree.parents == (-1, -1, 0, 2, 3)
    assert isinstance(drafts[0].shape, NodeTree)  # a round with a tree: every row's draft is a NodeTree
    assert drafts[0].token_ids[:3] == (8, 9, 10) and drafts[0].shape.parents == (-1, 0, 1)
    short = proposer.propose([chain_req], SHAPE, [2])[0]
    assert short.token_ids[:2] == (8, 9) and short.num_proposed == 2  # cut to the row's depth
    assert proposer.propose([chain_req], SHAPE, [0])[0].num_proposed == 0
    nothing = proposer.propose([_request("c", [1, 2, 3])], SHAPE, [4])[0]
    assert nothing.num_proposed == 0
    for rid in "abc":
        proposer.release(_request(rid, [1]))
    assert proposer.leak_report() == []


def test_drafts_follow_the_requests_tokens_incrementally():
    proposer = SuffixProposer(SuffixConfig(max_depth=12, cache_tokens=0))
    r = _request("a", [1, 2, 3, 4])
    proposer.prefilled([r])
    trie = proposer.trie("a")
    assert trie is not None and trie.tokens(0) == [1, 2, 3, 4]
    assert proposer.propose([r], SHAPE, [4])[0].num_proposed == 0
    r.output_token_ids += [1, 2]  # "1 2" again: its continuation was 3 4
    draft = proposer.propose([r], SHAPE, [4])[0]
    assert proposer.trie("a") is trie and trie.tokens(0) == [1, 2, 3, 4, 1, 2]  # extended, not rebuilt
    assert draft.token_ids[:2] == (3, 4)
    r.output_token_ids[:] = [7, 7]  # a replaced history: rebuilt from the request's tokens
    proposer.propose([r], SHAPE, [4])
    assert proposer.trie("a") is not trie and proposer.trie("a").tokens(0) == [1, 2, 3, 4, 7, 7]
    proposer.release(r)  # preempted (still running): no cache, no trie
    assert proposer.trie("a") is None and len(proposer.cache) == 0 and proposer.leak_report() == []


def test_finished_outputs_join_the_cache_and_draft_for_later_requests():
    proposer = SuffixProposer(SuffixConfig(max_depth=6, cache_tokens=100))
    done = _request("a", [40, 41, 42, 43, 44, 45, 46], [50, 51, 52, 53])
    proposer.propose([done], SHAPE, [2])
    assert proposer.leak_report() != []  # its trie is held while it runs
    done.state = RequestState.FINISHED
    proposer.release(done)
    # its output after its prompt's last D - 1 = 5 tokens
    assert len(proposer.cache) == 1 and proposer.cache.trie.tokens(0) == [42, 43, 44, 45, 46, 50, 51, 52, 53]
    later = _request("b", [9, 9, 45, 46])  # a new request whose prompt ends as that one's did
    draft = proposer.propose([later], SHAPE, [3])[0]
    assert draft.token_ids[:2] == (50, 51) and draft.num_proposed == 2  # a 2-token match in the cache
    proposer.reset_history()
    assert len(proposer.cache) == 0 and proposer.propose([later], SHAPE, [3])[0].num_proposed == 0
    proposer.release(later)
    assert proposer.leak_report() == []


def test_the_better_scored_trie_drafts():
    proposer = SuffixProposer(SuffixConfig(max_depth=8, cache_tokens=100, min_prob=0.0))
    for i in range(3):  # the cache: "1 2" went on with 3 three times
        r = _request(f"old{i}", [1, 2], [3, 4])
        r.state = RequestState.FINISHED
        proposer.release(r)
    own = _request("new", [1, 2, 5, 1, 2, 6, 1, 2])  # its own history: "1 2" went on with 5, then 6
    draft = proposer.propose([own], SHAPE, [2])[0]
    assert draft.token_ids[:2] == (3, 4)  # both match "1 2": the cache's sure path (score 2) beats 5 | 6 (1)


def test_suffix_config_and_proposer_refuse_bad_values():
    for bad, word in ((dict(max_depth=1), "max_depth"), (dict(cache_tokens=-1), "cache_tokens"),
                      (dict(min_prob=1.5), "min_prob"), (dict(max_depth=True), "max_depth")):
        with pytest.raises(ValueError, match=word):
            SuffixConfig(**bad)
    proposer = SuffixProposer()
    r = _request("a", [1, 2])
    with pytest.raises(ValueError, match="DynamicShape"):
        from infer.speculative.tree import chain_shape
        proposer.propose([r], chain_shape(2), [2])
    with pytest.raises(ValueError, match="one depth per request"):
        proposer.propose([r], SHAPE, [])
    with pytest.raises(ValueError, match="integers >= 0"):
        proposer.propose([r], SHAPE, [-1])


def test_engine_config_of_suffix_decoding():
    config = EngineConfig(speculative_method="suffix")
    assert config.use_speculative_decoding and config.spec_tree == "dynamic:24:1" and config.spec_length == 24
    assert config.speculative_part().suffix == SuffixConfig()  # (the engine's defaults are the tries')
    given = EngineConfig(speculative_method="suffix", spec_tree="dynamic:6:2", spec_length=3,
                         spec_suffix_max_depth=10, spec_suffix_cache_tokens=0, spec_suffix_min_prob=0.0)
    assert (given.spec_tree, given.spec_length) == ("dynamic:6:2", 3)
    assert EngineConfig(spec_suffix_cache_tokens=10, speculative_method="suffix").use_speculative_decoding
    bad = [(dict(speculative_method="suffix", spec_tree="3,1"), "grows its own trees"),
           (dict(speculative_method="suffix", spec_policy="adaptive"), "spec_policy='fixed'"),
           (dict(speculative_method="suffix", spec_length=8, spec_suffix_max_depth=8), "must exceed spec_length"),
           (dict(speculative_method="suffix", spec_suffix_max_depth=1), "spec_suffix_max_depth"),
           (dict(speculative_method="suffix", spec_suffix_cache_tokens=-5), "spec_suffix_cache_tokens"),
           (dict(speculative_method="suffix", spec_suffix_min_prob=2.0), "spec_suffix_min_prob"),
           (dict(speculative_method="suffix", tensor_parallel_size=2), "tensor_parallel_size=1"),
           (dict(speculative_method="ngram", spec_suffix_cache_tokens=0), "apply to speculative_method='suffix'"),
           (dict(spec_suffix_min_prob=0.5), "apply to speculative_method='suffix'"),
           (dict(speculative_method="prompt_lookup", spec_tree="dynamic:4"), "draft model or grown")]
    for kwargs, words in bad:
        with pytest.raises(ValueError, match=words.replace("(", r"\(")):
            EngineConfig(**kwargs)
