"""Drafts whose tokens stay on the device (an EAGLE head's fused round): the verification
rows take their tokens from there (`chain_tokens`), the flat batch's ids and the verifier's
results are those of the same drafts on the host, and `token_ids` reads the round's tokens
to the host once, only when asked."""

from __future__ import annotations

import torch

from infer.engine.request import Request
from infer.engine.verification import Verification
from infer.sampling import SamplingParams
from infer.speculative.tree import Draft, RoundTokens, chain_shape

CPU = torch.device("cpu")
VOCAB = 11
SHAPE = chain_shape(4)


def _round() -> RoundTokens:
    return RoundTokens(torch.tensor([[3, 1, 4, 1], [5, 9, 2, 6], [8, 7, 10, 2]]))  # [A=3, steps=4]


def _requests(params: list[SamplingParams]) -> list[Request]:
    out = []
    for i, p in enumerate(params):
        r = Request(f"r{i}", [1, 2, 3 + i], p)
        r.slot, r.num_computed_tokens = i, 2
        out.append(r)
    return out


def _host_copy(drafts: list[Draft], tokens: RoundTokens) -> list[Draft]:
    """The drafts with their tokens on the host (read here, leaving the drafts' own unread)."""
    rows = tokens.tokens.tolist()
    return [d if d.on_device is None else Draft.chain(SHAPE, rows[d.on_device[1]][:d.num_proposed], d.probs)
            for d in drafts]


def test_a_device_draft_reads_its_tokens_once_and_only_when_asked() -> None:
    tokens = _round()
    draft = Draft.chain_on_device(SHAPE, tokens, 1, 3)
    assert draft.host_ids is None and tokens._host is None  # (nothing read yet)
    assert draft.token_ids == (5, 9, 2, 0)
    first = tokens._host
    assert Draft.chain_on_device(SHAPE, tokens, 2, 2).token_ids == (8, 7, 0, 0)
    assert tokens._host is first  # (the round's tokens read once for every row)
    assert draft.host_ids is None  # (still a device draft: verification places its tokens from there)
    assert (draft.num_proposed, draft.depth, draft.rows_used) == (3, 3, 4)


def test_chain_tokens_of_every_row_in_order_are_the_rounds_own() -> None:
    tokens = _round()
    drafts = [Draft.chain_on_device(SHAPE, tokens, j, k) for j, k in enumerate((4, 2, 3))]
    block = Verification(VOCAB, CPU, None).block(_requests([SamplingParams(temperature=0)] * 3), drafts)
    assert block.tokens.data_ptr() == tokens.tokens.data_ptr()  # (a view: nothing copied)
    assert block.device_ids is not None
    # rows of 5, 3 and 4 tokens: g, then the drafts from each row's second token
    assert block.device_ids.at == (1, 2, 3, 4, 6, 7, 9, 10, 11)
    assert block.device_ids.ids.tolist() == [3, 1, 4, 1, 5, 9, 8, 7, 10]


def test_a_round_with_rows_past_the_batch_gives_the_batch_its_first_rows() -> None:
    # a round drafted ahead for three requests, the third of which left the batch since
    # (preempted, or stepping plainly): the first two rows, in order, are the whole batch
    tokens = _round()
    drafts = [Draft.chain_on_device(SHAPE, tokens, j, 4) for j in range(2)]
    block = Verification(VOCAB, CPU, None).block(_requests([SamplingParams(temperature=0)] * 2), drafts)
    assert block.tokens.tolist() == [[3, 1, 4, 1], [5, 9, 2, 6]]
    assert block.device_ids is not None and block.device_ids.at == (1, 2, 3, 4, 6, 7, 8, 9)
    assert block.device_ids.ids.tolist() == [3, 1, 4, 1, 5, 9, 2, 6]


def test_device_drafts_among_plain_rows_verify_as_their_host_copies() -> None:
    tokens = _round()
    # batch rows 0 and 2 drafted rows 2 and 0 of the round; row 1 drafted nothing
    drafts = [Draft.chain_on_device(SHAPE, tokens, 2, 3), Draft.empty(SHAPE),
              Draft.chain_on_device(SHAPE, tokens, 0, 2)]
    host = _host_copy(drafts, tokens)
    g = torch.Generator().manual_seed(0)
    for params in ([SamplingParams(temperature=0)] * 3,
                   [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]):
        verification = Verification(VOCAB, CPU, None)
        if not params[0].greedy:  # (sampled drafts carry their q)
            q = torch.softmax(torch.randn(3, 4, VOCAB, generator=g), -1)
            drafts = [Draft(d.shape, d.host_ids, d.valid, q[i, :d.num_proposed] if d.num_proposed else None,
                            d.on_device) for i, d in enumerate(drafts)]
            host = [Draft(h.shape, h.host_ids, h.valid, d.probs) for h, d in zip(host, drafts, strict=True)]
        on_device = verification.block(_requests(params), drafts)
        on_host = verification.block(_requests(params), host)
        assert on_host.device_ids is None and on_device.device_ids is not None
        assert on_device.present == on_host.present == [3, 0, 2]
        assert on_host.tokens.tolist() == [[8, 7, 10], [0, 0, 0], [3, 1, 0]]
        assert [row[:k] for row, k in zip(on_device.tokens.tolist(), on_device.present, strict=True)] == \
            [[8, 7, 10], [], [3, 1]]  # (what the verifier reads: a row's first k_b)
        ids = [t for row in on_device.rows for t in row.ids]
        for at, t in zip(on_device.device_ids.at, on_device.device_ids.ids.tolist(), strict=True):
            ids[at] = t
        assert ids == [t for row in on_host.rows for t in row.ids]  # the flat batch the target runs
        logits = torch.randn(on_host.num_logits, VOCAB, generator=g)
        got = verification.verify(_requests(params), drafts, on_device, logits, lambda: None)
        want = verification.verify(_requests(params), host, on_host, logits, lambda: None)
        assert got[0].tokens == want[0].tokens and got[1] == want[1]


def test_rows_verified_as_a_static_tree_read_their_tokens_to_the_host() -> None:
    # a static tree (here the chain "1,1,1,1", as spec_tree gives it) walks the tree
    # verifier, which reads tokens on the host
    requests = _requests([SamplingParams(temperature=0)] * 2)
    first = _round()
    drafts = [Draft.chain_on_device(SHAPE, first, 0, 4), Draft.chain_on_device(SHAPE, first, 1, 2)]
    block = Verification(VOCAB, CPU, SHAPE).block(requests, drafts)
    assert block.device_ids is None
    assert [list(row.ids) for row in block.rows] == [[3, 3, 1, 4, 1], [4, 5, 9]]  # g, then the drafts


def test_drafts_of_two_rounds_stay_on_the_device() -> None:
    # a round drafted ahead for some rows beside one drafted now for the others (rows 2 and
    # 0 of the first, row 1 of a second of other tokens and steps): the flat batch and the
    # verifier's tokens are their host copies'
    first = _round()
    second = RoundTokens(torch.tensor([[6, 6], [7, 2]]))  # [2, steps=2]
    drafts = [Draft.chain_on_device(SHAPE, first, 2, 3), Draft.chain_on_device(SHAPE, second, 1, 2),
              Draft.chain_on_device(SHAPE, first, 0, 3)]
    host = [Draft.chain(SHAPE, [8, 7, 10]), Draft.chain(SHAPE, [7, 2]), Draft.chain(SHAPE, [3, 1, 4])]
    requests = _requests([SamplingParams(temperature=0)] * 3)
    verification = Verification(VOCAB, CPU, None)
    on_device, on_host = verification.block(requests, drafts), verification.block(requests, host)
    assert on_device.device_ids is not None and first._host is None and second._host is None  # (nothing read)
    assert [row[:k] for row, k in zip(on_device.tokens.tolist(), on_device.present, strict=True)] == \
        [[8, 7, 10], [7, 2], [3, 1, 4]]
    ids = [t for row in on_device.rows for t in row.ids]
    on_device.device_ids.place(flat := torch.tensor(ids))
    assert flat.tolist() == [t for row in on_host.rows for t in row.ids]
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(on_host.num_logits, VOCAB, generator=g)
    got = verification.verify(requests, drafts, on_device, logits, lambda: None)
    want = verification.verify(requests, host, on_host, logits, lambda: None)
    assert got[0].tokens == want[0].tokens and got[1] == want[1]