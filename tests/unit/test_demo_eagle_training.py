"""Training the demo EAGLE-3 head: the training-time-test attention mask, the draft
vocabulary, the target's greedy and sampled continuations as training windows and their
feature cache, one training step, and the saved head loading through the engine's loader
with the same forward (the public layout round trip)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from demo_pair.eagle_data import HeadData, draft_vocabulary, extract_features, generated_windows, vocab_maps
from demo_pair.eagle_head import HEAD_PRESETS, _head_override, build_head, continue_from, head_data, save_head
from demo_pair.eagle_train import HeadSettings, unrolled_losses
from demo_pair.train import Corpus
from demo_pair.unrolled_view import UnrolledView, unrolled_mask
from infer.models.layers.attention import NoCacheView
from infer.models.loading.eagle_files import load_eagle_head
from infer.models.loading.loader import load_model


def test_unrolled_mask_is_causal_then_diagonal() -> None:
    assert torch.equal(unrolled_mask(4, 1), torch.ones(4, 4).tril().bool())
    mask = unrolled_mask(4, 3).int()  # pass 2: pass-0 keys <= i - 2, pass 1 at i - 1, pass 2 at i
    expected = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
                             [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0],
                             [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0],
                             [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]])
    assert torch.equal(mask, expected)


def test_first_pass_of_unrolled_view_is_causal_attention() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, h, 8, generator=gen) for h in (4, 2, 2))
    torch.testing.assert_close(UnrolledView().attend(0, q, k, v), NoCacheView().attend(0, q, k, v))


def test_draft_vocabulary_and_maps() -> None:
    stream = torch.tensor([5, 5, 5, 1, 1, 7, 7, 9])
    ids = draft_vocabulary(stream, 10, 3)
    assert ids.tolist() == [1, 5, 7]  # 7 and 1 tie at 2: the lower id would win a further tie
    d2t, t2d = vocab_maps(ids, 10)
    assert (torch.arange(3) + d2t).tolist() == [1, 5, 7] and t2d.nonzero().flatten().tolist() == [1, 5, 7]
    with pytest.raises(ValueError, match="draft vocabulary size"):
        draft_vocabulary(stream, 10, 11)


def test_greedy_windows_are_the_targets_own_continuations(ckpt_b: Path) -> None:
    target = load_model(str(ckpt_b), dtype="float32")[0]
    prompts = torch.randint(2, target.config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(2))
    windows = generated_windows(str(ckpt_b), prompts, 3)
    assert windows.shape == (2, 7) and torch.equal(windows[:, :4], prompts)
    with torch.no_grad():
        assert torch.equal(target(windows[:, :-1]).argmax(-1)[:, 3:], windows[:, 4:])  # each token the argmax
    with pytest.raises(ValueError, match="greedy_prompt"):
        HeadSettings(train=HEAD_PRESETS["tiny"].train, seq_len=32, greedy_prompt=32)
    with pytest.raises(ValueError, match="aux_layers"):
        HeadSettings(train=HEAD_PRESETS["tiny"].train, aux_layers=(1, 2))
    assert _head_override("aux_layers=1,3,5") == ("aux_layers", (1, 3, 5))


def test_head_data_holds_every_window_kind_and_is_read_back_from_its_cache(ckpt_b: Path, tmp_path: Path) -> None:
    target = load_model(str(ckpt_b), dtype="float32")[0]
    stream = torch.randint(2, target.config.vocab_size, (200,), generator=torch.Generator().manual_seed(3))
    corpus = Corpus(stream, stream[:40], {"train_tokens": 200})
    settings = HeadSettings(train=HEAD_PRESETS["tiny"].train, seq_len=8, num_sequences=2, greedy_sequences=1,
                            sampled_sequences=1, greedy_prompt=4, valid_sequences=1)
    data, valid, _ = head_data(str(ckpt_b), target, corpus, settings, (0, 1, 1), 0, tmp_path)
    assert data.ids.shape == (4, 8) and set(valid) == {"", "greedy_", "sampled_"}
    assert data.aux.shape == (4, 8, 3 * target.config.hidden_size)
    again, valid_again, seconds = head_data(str(ckpt_b), target, corpus, settings, (0, 1, 1), 0, tmp_path)
    assert seconds == {"generate": 0.0, "features": 0.0}  # read from the cache
    assert torch.equal(again.aux, data.aux) and torch.equal(valid_again["sampled_"].ids, valid["sampled_"].ids)


def test_trained_step_saves_and_loads_in_the_public_layout(ckpt_b: Path, tmp_path: Path) -> None:
    target = load_model(str(ckpt_b), dtype="float32")[0].requires_grad_(False)
    vocab = target.config.vocab_size
    settings = HEAD_PRESETS["tiny"]
    draft_ids = torch.arange(0, vocab, vocab // 40)[:40]
    head = build_head(target, draft_ids, seed=0)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[draft_ids])  # starts as the target's
    windows = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    data: HeadData = extract_features(target, windows, head.spec.capture_points(target.config.num_hidden_layers))
    ids, aux, final = data.batch(torch.arange(2))
    loss, parts = unrolled_losses(head, target, ids, aux, final, draft_ids, settings, passes=2)
    loss.backward()
    assert len(parts) == 2 and torch.isfinite(loss) and head.fc.weight.grad is not None
    assert target.lm_head.weight.grad is None  # the teacher stays frozen
    head.index_vocab()
    loaded = load_eagle_head(str(save_head(head, tmp_path / "head", {})), "eagle3", target)
    resumed = build_head(target, draft_ids, seed=1)
    continue_from(resumed, str(tmp_path / "head"), target)  # --init: train the saved head further
    assert torch.equal(resumed.fc.weight, loaded.fc.weight)
    with pytest.raises(ValueError, match="another draft vocabulary"):
        continue_from(build_head(target, draft_ids + 1, seed=1), str(tmp_path / "head"), target)
    with torch.no_grad():
        features = head.combine(aux)
        ours = head.logits(head(ids, features, torch.arange(12).expand(2, 12), NoCacheView())[0])
        theirs = loaded.logits(loaded(ids, loaded.combine(aux), torch.arange(12).expand(2, 12), NoCacheView())[0])
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))  # the same 40 draft ids
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9  # (bf16 on disk)
