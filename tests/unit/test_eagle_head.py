"""EAGLE / EAGLE-3 heads in the public layout: loading, forward against a plain-torch
reference of the format, the head over flat rows through its KV pool (catch-up chunks beside
another row, a draft step, a tree level) equal to the head over whole sequences, the
forward through the fused kernel bundle equal to EAGER's,
refusal of heads that do not fit the target, the target's hidden-state capture against
transformers' own hidden states, and a round-drafting draft's cost (head or draft model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.eagle_heads import counting_fused_kernels, reference_head, write_head
from infer.models.capture import HiddenCapture
from infer.models.kernels.bundle import EAGER
from infer.models.layers.attention import NoCacheView
from infer.models.loading.eagle_files import load_eagle_head, read_head_config
from infer.models.loading.loader import load_model


@pytest.fixture(scope="module")
def target(ckpt_b: Path):
    return load_model(str(ckpt_b), dtype="float32")[0]


@pytest.mark.parametrize("method, options", [
    ("eagle", dict(fc_bias=True)),
    ("eagle3", dict(draft_vocab=50, aux_layers=[0, 1, 1])),
    ("eagle3", dict(own_embeddings=True, aux_layers=[1, 0, 1])),
])
def test_head_forward_matches_reference(tmp_path: Path, ckpt_b: Path, target, method: str, options: dict) -> None:
    head_dir = write_head(tmp_path / "head", ckpt_b, method, **options)
    head = load_eagle_head(str(head_dir), method, target)
    torch.manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (7,))
    width = target.config.hidden_size * (1 if method == "eagle" else 3)
    captured = torch.randn(7, width)
    with torch.no_grad():
        features = head.combine(captured)[None]  # [1, 7, H]
        x = head(ids[None], features, torch.arange(7)[None], NoCacheView())[0]
        logits = head.logits(x)
    embed = head.embed_tokens.weight if head.embed_tokens is not None else target.model.embed_tokens.weight
    ref_x, ref_logits = reference_head(head_dir, method, embed, target.lm_head.weight, ids, captured)
    torch.testing.assert_close(x, ref_x, rtol=1e-4, atol=1e-4)
    finite = torch.isfinite(ref_logits)
    assert torch.equal(finite, torch.isfinite(logits))
    torch.testing.assert_close(logits[finite], ref_logits[finite], rtol=1e-4, atol=1e-3)
    if options.get("draft_vocab"):  # the draft vocabulary's tokens, and only those, can be drafted
        assert int(finite[0].sum()) == options["draft_vocab"]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_head_over_flat_rows_is_the_head_over_whole_sequences(tmp_path: Path, ckpt_b: Path, target,
                                                               method: str) -> None:
    """Two sequences through a paged pool of 4-position blocks: catch-up chunks of 5 and 3
    positions in one pass, then 2 and 1 more beside each other, then a one-token draft step of
    each, and a tree level (two siblings under g's feed) of the first: every output is the
    head's over the sequence up to it at once (a node's: over g and itself, rotated at its
    depth, the sibling before it unseen)."""
    from infer.cache.factory import make_cache_pool
    from infer.cache.forward_batch import Row, RowTree, plan_batch
    from infer.speculative.eagle_round import head_pass
    head = load_eagle_head(str(write_head(tmp_path / "head", ckpt_b, method, aux_layers=[0, 1, 1]
                                          if method == "eagle3" else None)), method, target)
    gen = torch.Generator().manual_seed(3)
    h, vocab = head.spec.hidden_size, target.config.vocab_size
    seqs = [torch.randint(0, vocab, (9,), generator=gen) for _ in range(2)]  # tokens
    feats = [torch.randn(9, h, generator=gen) for _ in range(2)]  # features
    pool = make_cache_pool("paged", head.config, max_batch_size=2, max_seq_len=32, dtype=torch.float32,
                           device="cpu", block_size=4, num_blocks=16)
    slots = [pool.allocate_slot(12) for _ in range(2)]

    def whole(b: int, n: int) -> torch.Tensor:  # [n, H]
        return head(seqs[b][:n][None], feats[b][:n][None], torch.arange(n)[None], NoCacheView())[0]

    with torch.no_grad():
        passes = [((0, 5), (0, 3)), ((5, 7), (3, 4)), ((7, 8), (4, 5))]
        for cuts in passes:
            rows = [Row(slots[b], lo, seqs[b][lo:hi].tolist(), logits=hi - lo) for b, (lo, hi) in enumerate(cuts)]
            got = head_pass(head, pool, plan_batch(rows), torch.cat([feats[b][lo:hi] for b, (lo, hi) in
                                                                     enumerate(cuts)]))
            want = torch.cat([whole(b, hi)[lo:hi] for b, (lo, hi) in enumerate(cuts)])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert [pool.seq_len(s) for s in slots] == [8, 5]
        # g's feed at position 8 (block row 0), then a tree level: siblings at 9 and 10, rotary 9,
        # each fed the output at g
        x_g = head_pass(head, pool, plan_batch([Row(slots[0], 8, [int(seqs[0][8])])]), feats[0][8:9])
        torch.testing.assert_close(x_g[0], whole(0, 9)[8], rtol=1e-4, atol=1e-4)
        kids = torch.randint(0, vocab, (2,), generator=gen)
        rule = RowTree([0b011, 0b101], [1, 1], -1, 3)
        got = head_pass(head, pool, plan_batch([Row(slots[0], 9, [0, 0], logits=2, tree=rule)]),
                        x_g.expand(2, h), kids)
        for i in range(2):
            ids = torch.cat([seqs[0][:9], kids[i:i + 1]])
            feats_i = torch.cat([feats[0][:9], x_g])
            want = head(ids[None], feats_i[None], torch.arange(10)[None], NoCacheView())[0, -1]
            torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method, options", [
    ("eagle", dict(fc_bias=True)),
    ("eagle3", dict(draft_vocab=50, aux_layers=[0, 1, 1])),
])
def test_head_through_the_fused_bundle_is_eager(tmp_path: Path, ckpt_b: Path, target, method: str,
                                                 options: dict) -> None:
    """The fused bundle with EAGER's functions as its fallbacks (the CPU's routes) gives the
    head's features, outputs and logits exactly: the bundle changes how, never what."""
    head = load_eagle_head(str(write_head(tmp_path / "head", ckpt_b, method, **options)), method, target)
    fused, calls = counting_fused_kernels()
    torch.manual_seed(1)
    ids = torch.randint(0, target.config.vocab_size, (2, 5))
    captured = torch.randn(10, target.config.hidden_size * (1 if method == "eagle" else 3))
    positions = torch.arange(3, 8).expand(2, 5)
    got, want = [], []
    with torch.no_grad():
        for kernels, out in ((fused, got), (EAGER, want)):
            features = head.combine(captured, kernels).view(2, 5, -1)  # [2, 5, H]
            x = head(ids, features, positions, NoCacheView(torch.tensor([5, 3])), kernels)
            out += [features, x, head.logits(x[:, -1], kernels)]
    assert calls  # the bundle's own entries ran
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_head_gets_its_own_compiled_bundle(tmp_path: Path, ckpt_b: Path, target) -> None:
    """`step_kernels` gives a head its own compiled bundle (`head.compiled`), apart from its
    target's of the same widths, the same at every call (made, never run: nothing compiles)."""
    from infer.engine.executor.kernels import step_kernels
    from infer.engine.parts import ExecutionConfig
    head = load_eagle_head(str(write_head(tmp_path / "head", ckpt_b, "eagle3", aux_layers=[0, 1, 1])), "eagle3",
                           target)
    assert head.config.hidden_size == target.config.hidden_size
    cpu = torch.device("cpu")
    compiled = ExecutionConfig(compile_kernels=True)
    kernels = step_kernels(compiled, cpu, head)
    assert kernels.name == "fused" and kernels is head.compiled.get() is step_kernels(compiled, cpu, head)
    assert kernels is not step_kernels(compiled, cpu, target)
    assert step_kernels(ExecutionConfig(), cpu, head) is EAGER  # not asked for: eager


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size=32), "hidden size 32"),
    (dict(vocab_size=500), "vocabulary 500"),
    (dict(aux_layers=[0, 1, 7]), "do not exist"),
])
def test_mismatched_head_refused_before_weights(tmp_path: Path, ckpt_b: Path, target, change: dict,
                                                message: str) -> None:
    head_dir = write_head(tmp_path / "head", ckpt_b, "eagle3", **change)
    (head_dir / "model.safetensors").unlink()  # the config alone decides
    with pytest.raises(ValueError, match=message):
        read_head_config(str(head_dir), "eagle3").check_target(target.config)
    with pytest.raises(ValueError, match=message):
        load_eagle_head(str(head_dir), "eagle3", target)


def test_wrong_method_named(tmp_path: Path, ckpt_b: Path, target) -> None:
    head_dir = write_head(tmp_path / "head", ckpt_b, "eagle3", draft_vocab=50, aux_layers=[0, 1, 1])
    with pytest.raises(ValueError, match="eagle3"):
        load_eagle_head(str(head_dir), "eagle", target)


def test_capture_matches_transformers_hidden_states(ckpt_b: Path, target) -> None:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt_b), torch_dtype=torch.float32)
    ids = torch.tensor([[3, 17, 42, 5, 9]])
    layers = target.config.num_hidden_layers
    target.capture = HiddenCapture((1, 0, layers))
    try:
        with torch.no_grad():
            target(ids)
            states = hf(ids, output_hidden_states=True).hidden_states  # [0]: embedding .. [L]: final normed
        assert target.capture.last is not None
        expected = torch.cat([states[1], states[0], states[layers]], dim=-1)
        torch.testing.assert_close(target.capture.last, expected, rtol=1e-4, atol=1e-4)
    finally:
        target.capture = None


def test_dummy_head_configs_follow_the_target_shape() -> None:
    from infer.models.loading.dummy_heads import DUMMY_DRAFT_VOCAB, dummy_head_config
    spec = dummy_head_config("dummy-eagle3:llama-3.2-3b", "eagle3")
    assert (spec.hidden_size, spec.draft_vocab_size, spec.layer.num_hidden_layers) == (3072, DUMMY_DRAFT_VOCAB, 1)
    assert spec.capture_points(28) == (2, 14, 25)
    with pytest.raises(ValueError, match="speculative_method='eagle3'"):
        dummy_head_config("dummy-eagle3:llama-3.2-3b", "eagle")
    with pytest.raises(ValueError, match="must be a shape"):
        dummy_head_config("dummy-eagle3:no-such-shape", "eagle3")




def test_a_draft_cost_is_the_slope_of_its_rounds(tmp_path: Path, ckpt_b: Path, target, monkeypatch) -> None:
    """An EAGLE head, drafting a chain round in one call, has its c from timed rounds of 1
    and max(2, k_max) steps: the step is their slope, the rest of the one-step round its
    fixed part."""
    from infer.engine import step_costs
    from infer.timing import summarize

    head_dir = write_head(tmp_path / "head", ckpt_b, "eagle3", draft_vocab=50, aux_layers=[0, 1, 1])
    head = load_eagle_head(str(head_dir), "eagle3", target)
    cfg = step_costs.StepCostConfig(context_len=8, max_seq_len=32, k_max=3, repeats=1, warmup=0)
    steps_timed: list[int] = []

    def timed(fn, device, repeats, warmup):  # one call; a round (its tokens [1, steps]) takes
        out = fn()                           # 1 ms + 0.25 ms a step, a target forward 4 ms
        if out.dtype != torch.long:
            return summarize([4e-3])
        steps_timed.append(out.shape[1])
        return summarize([1e-3 + 0.25e-3 * out.shape[1]])

    monkeypatch.setattr(step_costs, "time_calls", timed)
    costs = step_costs.measure_model_costs(target, None, use_cuda_graphs=False, cfg=cfg, head=head)
    assert steps_timed == [1, 3]
    assert costs.draft_step_s == pytest.approx(0.25e-3) and costs.draft_fixed_s == pytest.approx(1e-3)
    assert costs.c == pytest.approx(0.25e-3 / 4e-3)
    assert costs.to_dict()["draft_round_fixed_ms"] == pytest.approx(1.0)


def test_a_draft_model_cost_is_one_pass(target, monkeypatch) -> None:
    """A draft model steps one pass at a time: its c is one timed pass (its logits
    [1, V]) over the target's plain step, with no fixed part."""
    from infer.engine import step_costs
    from infer.timing import summarize

    shapes: list[tuple[int, ...]] = []

    def timed(fn, device, repeats, warmup):  # a pass of one logit 2 ms, of several 4 ms
        out = fn()
        shapes.append(tuple(out.shape))
        return summarize([2e-3 if out.shape[0] == 1 else 4e-3])

    monkeypatch.setattr(step_costs, "time_calls", timed)
    cfg = step_costs.StepCostConfig(context_len=8, max_seq_len=32, k_max=3, repeats=1, warmup=0)
    costs = step_costs.measure_model_costs(target, target, use_cuda_graphs=False, cfg=cfg)
    vocab = target.config.vocab_size
    assert shapes[:5] == [(1, vocab), (1, vocab), (2, vocab), (3, vocab), (4, vocab)]  # plain, v(0..3)
    assert costs.draft_fixed_s is None and costs.c == pytest.approx(1.0)
    assert costs.verify_ratio == pytest.approx([1.0, 2.0, 2.0, 2.0])
