"""A head round drafted ahead (`AheadFeed`): each row fed its whole verification block, the
ids and the accepted counts on the device, drafts what a round fed only the accepted
positions drafts, and writes the same KV there; rows accepting none, some and all drafts.
The engine's rounds drafted ahead: tests/integration/test_eagle_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.eagle_heads import write_head

from infer.cache.factory import make_cache_pool
from infer.cache.forward_batch import Row, plan_batch
from infer.models.loading.eagle_files import load_eagle_head
from infer.models.loading.loader import load_model
from infer.speculative.eagle_round import AheadFeed, EagerHeadRound

K = 3  # drafts a block verified: its feed K + 1 tokens


@pytest.fixture(scope="module")
def head(ckpt_a: Path, tmp_path_factory: pytest.TempPathFactory):
    target = load_model(str(ckpt_a), dtype="float32", device="cpu")[0]
    path = write_head(tmp_path_factory.mktemp("ahead_head"), ckpt_a, "eagle3", draft_vocab=120, aux_layers=[0, 1, 1])
    return load_eagle_head(str(path), "eagle3", target)


@pytest.mark.parametrize("accepted", [(0, K, 1), (2, 0, K)])
@pytest.mark.parametrize("greedy", [True, False])
def test_round_drafted_ahead_drafts_as_a_round_of_the_accepted_feed(head, accepted, greedy) -> None:
    gen = torch.Generator().manual_seed(3)
    pools = [make_cache_pool("paged", head.config, max_batch_size=4, max_seq_len=64, dtype=torch.float32,
                             device="cpu", block_size=4, num_blocks=64) for _ in range(2)]
    starts, steps = (9, 3, 17), K
    slots = [[pool.allocate_slot(s + 2 * K) for s in starts] for pool in pools][0]
    kv = torch.randn(pools[0].k_cache.shape, generator=gen)
    for pool in pools:
        for slot, s in zip(slots, starts):
            pool.set_length(slot, s)
        pool.k_cache.copy_(kv)
        pool.v_cache.copy_(kv.flip(0))
    ids = torch.randint(0, 100, (3, K + 1), generator=gen)  # [B, K + 1]
    features = torch.randn(3, K + 1, head.spec.hidden_size, generator=gen)
    temperatures, flags = [1.0, 0.7, 1.3], [greedy] * 3
    uniforms = torch.rand(3, steps, dtype=torch.float64, generator=gen)
    with torch.inference_mode():
        whole = plan_batch([Row(slot, s, [0] * (K + 1)) for slot, s in zip(slots, starts)])
        got = EagerHeadRound(head, pools[0])(whole, features.reshape(-1, features.shape[-1]), steps, temperatures,
                                             uniforms, flags, AheadFeed(ids.reshape(-1), torch.tensor(accepted)))
        fed = plan_batch([Row(slot, s, ids[b, :a + 1].tolist()) for b, (slot, s, a) in
                          enumerate(zip(slots, starts, accepted))])
        want = EagerHeadRound(head, pools[1])(fed, torch.cat([features[b, :a + 1] for b, a in enumerate(accepted)]),
                                              steps, temperatures, uniforms, flags)
    assert torch.equal(got[0], want[0])
    assert (got[1] is None) == (want[1] is None) == greedy
    if not greedy:
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    for slot, s, a in zip(slots, starts, accepted):  # the accepted feed, then the drafts fed back
        table = pools[0].block_table(slot)
        assert table == pools[1].block_table(slot)
        rows = [table[p // 4] * 4 + p % 4 for p in range(s, s + a + steps)]
        for cache in ("k_cache", "v_cache"):
            torch.testing.assert_close(getattr(pools[0], cache)[:, rows], getattr(pools[1], cache)[:, rows],
                                       atol=1e-5, rtol=1e-5)
    # the whole feed's lengths: the proposer cuts them to the accepted ones (`on_accepted`)
    assert [pools[0].seq_len(slot) for slot in slots] == [s + K + steps for s in starts]
