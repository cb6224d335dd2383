"""Medusa heads in FasterDecoding's public layout: loading (safetensors, sizes from the header;
the .pt fallback), the forward against a plain-torch reference of the format, the fused
bundle equal to EAGER, refusals (wrong target, too few heads, bad files) before weights are
read where the files allow it, tree drafts from ranked tokens, dummy heads, and their cost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.eagle_heads import counting_fused_kernels
from helpers.medusa_heads import reference_medusa, write_medusa_head
from infer.engine.step_costs import measure_model_costs
from infer.models.loading.dummy_heads import dummy_medusa_config, dummy_medusa_head
from infer.models.loading.loader import load_model
from infer.models.loading.medusa_files import load_medusa_head, read_medusa_config
from infer.models.medusa import MedusaConfig
from infer.speculative.medusa import medusa_draft
from infer.speculative.tree import TreeShape, chain_shape


@pytest.fixture(scope="module")
def target(ckpt_b: Path):
    return load_model(str(ckpt_b), dtype="float32")[0]


def _load(directory: Path, target, quantization: str | None = None):
    return load_medusa_head(str(directory), target.config, torch.float32, torch.device("cpu"), quantization)


@pytest.mark.parametrize("layers, options", [(1, {}), (2, dict(sizes=True)), (0, {}), (1, dict(pt=True))])
def test_heads_match_the_reference(tmp_path: Path, ckpt_b: Path, target, layers: int, options: dict) -> None:
    directory = write_medusa_head(tmp_path / "m", ckpt_b, 3, layers, **options)
    spec = read_medusa_config(str(directory))
    # sizes from config.json or the safetensors header, before any weight is read; a .pt file's later
    known = None if options.get("pt") else (target.config.hidden_size, target.config.vocab_size)
    assert (spec.num_heads, spec.num_layers) == (3, layers)
    assert (spec.hidden_size, spec.vocab_size) == (known or (None, None))
    head = _load(directory, target)
    torch.manual_seed(0)
    hidden = torch.randn(5, target.config.hidden_size)
    reference = reference_medusa(directory, hidden)  # [K, A, V]
    with torch.no_grad():
        for k in range(3):
            torch.testing.assert_close(head.logits(k, hidden), reference[k], rtol=1e-4, atol=1e-4)
        top = head.top_tokens(hidden, [2, 1, 3])
    assert top.shape == (5, 6)
    assert torch.equal(top[:, :2], reference[0].topk(2, dim=-1).indices)
    assert torch.equal(top[:, 2], reference[1].argmax(dim=-1))
    assert torch.equal(top[:, 3:], reference[2].topk(3, dim=-1).indices)


def test_heads_through_the_fused_bundle_are_eager(tmp_path: Path, ckpt_b: Path, target) -> None:
    head = _load(write_medusa_head(tmp_path / "m", ckpt_b, 2, 2), target)
    fused, calls = counting_fused_kernels()
    hidden = torch.randn(3, target.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(head.top_tokens(hidden, [3, 2], fused), head.top_tokens(hidden, [3, 2]))
        assert torch.equal(head.logits(1, hidden, fused), head.logits(1, hidden))
    assert calls == []  # (no elementwise entry: the bundle's projections only)


def test_quantized_heads_load(tmp_path: Path, ckpt_b: Path, target) -> None:
    """draft_quantization stores the heads' matrices quantized, as they load; logits stay close."""
    directory = write_medusa_head(tmp_path / "m", ckpt_b, 2, 1, std=0.05)
    dense, fp8 = _load(directory, target), _load(directory, target, "fp8")
    assert fp8.lm_heads[0].quantization == "fp8" and fp8.blocks[1][0].quantization == "fp8"
    hidden = torch.randn(4, target.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(fp8.logits(1, hidden), dense.logits(1, hidden), rtol=0.1, atol=0.05)


@pytest.mark.parametrize("field, value, words", [("hidden_size", 32, "hidden size 32"),
                                                 ("vocab_size", 100, "vocabulary 100")])
def test_heads_of_another_target_refused_before_weights(tmp_path: Path, ckpt_b: Path, target, monkeypatch,
                                                        field: str, value: int, words: str) -> None:
    import infer.models.loading.medusa_files as files
    directory = write_medusa_head(tmp_path / "m", ckpt_b, 2, 1, **{field: value})
    monkeypatch.setattr(files, "read_tensors", lambda file: pytest.fail("weights read before the check"))
    with pytest.raises(ValueError, match=f"do not fit the target: {words}"):
        _load(directory, target)


def test_pt_heads_of_another_target_refused(tmp_path: Path, ckpt_b: Path, target) -> None:
    with pytest.raises(ValueError, match="do not fit the target: hidden size 32"):
        _load(write_medusa_head(tmp_path / "m", ckpt_b, 2, 1, pt=True, hidden_size=32), target)


def _rewrite(directory: Path, edit) -> None:  # noqa: ANN001
    from safetensors.torch import load_file, save_file
    path = directory / "medusa_lm_head.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


@pytest.mark.parametrize("edit, words", [
    (lambda t: t.pop("1.0.linear.bias"), r"missing tensor\(s\) \['1.0.linear.bias'\]"),
    (lambda t: t.update({"2.1.weight": t["0.1.weight"].clone()}), "unexpected tensor '2.1.weight'"),
    (lambda t: t.update({"0.0.linear.weight": torch.zeros(3, 3)}), r"'0.0.linear.weight' has shape \(3, 3\)"),
    (lambda t: t.update({"0.1.bias": torch.zeros(3)}), "unexpected tensor '0.1.bias'"),
])
def test_bad_weight_files_refused(tmp_path: Path, ckpt_b: Path, target, edit, words: str) -> None:
    directory = write_medusa_head(tmp_path / "m", ckpt_b, 2, 1)
    _rewrite(directory, edit)
    with pytest.raises(ValueError, match=words):
        _load(directory, target)


def test_prefixed_names_load(tmp_path: Path, ckpt_b: Path, target) -> None:
    """The whole model's state dict names them `medusa_head.{k}...`: the same heads."""
    directory = write_medusa_head(tmp_path / "m", ckpt_b, 2, 1)
    plain = _load(directory, target)
    _rewrite(directory, lambda t: t.update({f"medusa_head.{k}": t.pop(k) for k in list(t)}))
    hidden = torch.randn(2, target.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(_load(directory, target).logits(1, hidden), plain.logits(1, hidden))


def test_bad_directories_refused(tmp_path: Path, ckpt_b: Path) -> None:
    directory = write_medusa_head(tmp_path / "m", ckpt_b, 2, 1)
    (directory / "medusa_lm_head.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="holds neither medusa_lm_head.safetensors nor medusa_lm_head.pt"):
        read_medusa_config(str(directory))
    (directory / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    with pytest.raises(ValueError, match=r"lacks \['medusa_num_layers'\]"):
        read_medusa_config(str(directory))
    (directory / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        read_medusa_config(str(directory))
    with pytest.raises(ValueError, match="medusa_num_heads must be an integer >= 1"):
        MedusaConfig(0, 1, 8, 8)


def test_depth_beyond_the_heads_refused() -> None:
    spec = MedusaConfig(3, 1, 8, 16, "heads 'x'")
    spec.check_depth(3)
    with pytest.raises(ValueError, match="heads 'x' have 3 heads, one per draft depth, but spec_length is 4: set "
                                         r"spec_length \(or the depth of spec_tree\) to at most 3"):
        spec.check_depth(4)


def test_tree_draft_is_the_cartesian_product() -> None:
    """Node i at depth d, child c of its parent, holds head d-1's c-th token; a chain takes
    each head's first; nodes below the row's depth are absent."""
    shape = TreeShape((3, 2, 1))  # 3 + 6 + 6 nodes
    ranked = [10, 11, 12, 20, 21, 30]  # head 0's top 3, head 1's top 2, head 2's top 1
    draft = medusa_draft(shape, 3, ranked)
    assert draft.token_ids == (10, 11, 12, 20, 21, 20, 21, 20, 21, *[30] * 6)
    assert all(draft.valid) and draft.probs is None
    cut = medusa_draft(shape, 2, ranked[:5])
    assert cut.token_ids == (10, 11, 12, 20, 21, 20, 21, 20, 21, *[0] * 6)
    assert cut.valid == (True,) * 9 + (False,) * 6
    chain = medusa_draft(chain_shape(4), 2, [7, 8, 9, 5])
    assert chain.token_ids == (7, 8, 0, 0) and chain.depth == 2


def test_dummy_heads(target) -> None:
    spec = dummy_medusa_config("dummy-medusa:llama-3.2-3b")
    assert (spec.num_heads, spec.num_layers, spec.hidden_size, spec.vocab_size) == (5, 1, 3072, 128256)
    assert dummy_medusa_config("dummy-medusa:dummy:llama-3.2-1b").hidden_size == 2048
    with pytest.raises(ValueError, match="must be a shape"):
        dummy_medusa_config("dummy-medusa:no-such-shape")
    small = MedusaConfig(2, 1, target.config.hidden_size, target.config.vocab_size)
    head = dummy_medusa_head(small, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        assert head.top_tokens(torch.randn(2, small.hidden_size), [2, 2]).shape == (2, 4)
    assert all(float(b.bias.abs().sum()) == 0 for blocks in head.blocks for b in blocks)


def test_proposer_drafts_from_the_last_committed_state(tmp_path: Path, ckpt_b: Path, target) -> None:
    """`observed` keeps each request's state of its last committed row (position n - 1);
    `propose` drafts from it (the heads' top tokens over the round's shape), nothing for a
    request whose state is stale; `release` drops it."""
    from types import SimpleNamespace

    from infer.models.capture import HiddenCapture
    from infer.speculative.medusa import MedusaProposer

    head = _load(write_medusa_head(tmp_path / "m", ckpt_b, 3, 1), target)
    capture = HiddenCapture((target.config.num_hidden_layers,))
    capture.last = torch.randn(1, 5, target.config.hidden_size)  # a forward of 5 tokens
    proposer = MedusaProposer(head, capture)
    a, b = (SimpleNamespace(request_id=i, num_computed_tokens=0, fault=None) for i in "ab")
    proposer.observed([a, b], [0, 9], [[0, 1, 2], [4]])  # a's prompt at 0..2, b's plain row at 9
    a.num_computed_tokens, b.num_computed_tokens = 3, 10
    shape = TreeShape((2, 1))
    drafts = proposer.propose([a, b], shape, [2, 1])
    with torch.no_grad():
        ranked = head.top_tokens(capture.last[0, [2, 4]], [2, 1]).tolist()
    assert drafts[0] == medusa_draft(shape, 2, ranked[0]) and drafts[1] == medusa_draft(shape, 1, ranked[1])
    b.num_computed_tokens = 11  # (a step it was not observed in: its state is of position 9, not 10)
    assert proposer.propose([a, b], shape, [2, 2])[1].num_proposed == 0
    assert proposer.propose([a, b], shape, [0, 2])[0].num_proposed == 0
    proposer.release(a)
    assert proposer.leak_report() == ["Medusa heads still hold the hidden states of ['b']"]
    proposer.release(b)
    assert proposer.leak_report() == []


@pytest.mark.parametrize("heads, timed_steps", [(3, [1, 3]), (1, [1])])
def test_cost_is_the_slope_of_head_rounds(tmp_path: Path, ckpt_b: Path, target, monkeypatch, heads: int,
                                          timed_steps: list[int]) -> None:
    """c of Medusa heads: rounds of 1 and S heads (S = max(2, k_max) capped at the number of
    heads) timed through the heads' own call, the step their slope; one head: its round."""
    from infer.engine import step_costs
    from infer.timing import summarize

    head = _load(write_medusa_head(tmp_path / "m", ckpt_b, heads, 1), target)
    seen: list[int] = []

    def timed(fn, device, repeats, warmup):  # a round of s heads (tokens [1, s]): 1 ms + 0.25 ms a head;
        out = fn()                           # a target forward (logits) 4 ms
        if out.dtype != torch.long:
            return summarize([4e-3])
        seen.append(out.shape[1])
        return summarize([1e-3 + 0.25e-3 * out.shape[1]])

    monkeypatch.setattr(step_costs, "time_calls", timed)
    cfg = step_costs.StepCostConfig(context_len=8, max_seq_len=32, k_max=4, repeats=1, warmup=0)
    costs = measure_model_costs(target, None, False, cfg, head)
    assert seen == timed_steps
    step = 0.25e-3 if heads > 1 else 1.25e-3
    assert costs.draft_step_s == pytest.approx(step) and costs.c == pytest.approx(step / 4e-3)
    assert costs.draft_fixed_s == pytest.approx(1e-3 if heads > 1 else 0.0)


def test_costs_row_of_dummy_heads(ckpt_a: Path) -> None:
    """The costs suite's Medusa row: dummy heads of a target's shape load through the
    engine's loader and are timed (a CPU here: a measured c, no failure)."""
    from infer_bench import measures
    from infer_bench.harness import Harness, HarnessOptions
    from infer_bench.results import BenchRun

    row = measures.costs_row("costs", "c", str(ckpt_a), f"dummy-medusa:{ckpt_a}", False, method="medusa")
    run = BenchRun("t")
    Harness(run, HarnessOptions(device="cpu", quiet=True, cost_repeats=1)).run_rows(["costs"], {"costs": row})
    m = run.get("costs")
    assert m.ok, m.error
    assert m.params["method"] == "medusa" and m.metrics["c"] is not None and m.metrics["draft_round_fixed_ms"] >= 0
