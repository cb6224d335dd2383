"""The fused decode bundle (models/kernels/bundle.py, models/kernels/routes.py) on the CPU.

Its fallbacks are EAGER's composition: with plain (uncompiled) elementwise steps, a whole
tiny model (Llama, Qwen2 with q/k/v biases, Qwen3 with q/k norms) gives bit-identical
logits to EAGER over a paged cache (prefill with padding, decode, a verification-width
chunk). The route table chooses the GEMV for one row and nothing off the GPU. The Triton
kernels themselves run under Triton's interpreter in tests/unit/test_fused_interpreted.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.checkpoints import make_family_checkpoint
from infer.cache.factory import make_cache_pool
from infer.cache.forward_batch import Row, plan_batch
from infer.engine.executor.batch_forward import EagerBatchForward
from infer.models.kernels.bundle import EAGER, Kernels, fused_kernels
from infer.models.kernels.routes import GEMV, LIBRARY, MATMUL, ROUTES, check_routes, route, table_route
from infer.models.layers.linear import make_linear
from infer.models.loading.loader import load_model

PLAIN_FUSED = fused_kernels(lambda fn: fn)  # the fused routing, elementwise steps uncompiled


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "llama":
        return request.getfixturevalue("ckpt_a")
    return make_family_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def _steps(model: torch.nn.Module, vocab: int, bundle: Kernels) -> list[torch.Tensor]:
    """Logits of three flat passes through a paged pool (block size 4, so chunks cross
    blocks): a two-row prefill of 6 and 4 tokens, one decode token a row, a three-token
    chunk a row (every token's logits)."""
    pool = make_cache_pool("paged", model.config, max_batch_size=2, max_seq_len=32, dtype=torch.bfloat16,
                           device=torch.device("cpu"), block_size=4, enable_prefix_caching=False)
    slots = [pool.allocate_slot(12) for _ in range(2)]
    ids = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(0))  # [B, 6]
    forward, out = EagerBatchForward(model, pool, bundle), []
    with torch.no_grad():
        for starts, lens in (((0, 0), (6, 4)), ((6, 4), (1, 1)), ((7, 5), (3, 3))):
            rows = [Row(slot, start, ids[b, :n].tolist(), logits=n)
                    for b, (slot, start, n) in enumerate(zip(slots, starts, lens))]
            out.append(forward.run(plan_batch(rows)))
    for slot in slots:
        pool.free_slot(slot)
    assert pool.leak_report() == []
    return out


def test_fused_bundle_falls_back_to_eager_bit_for_bit(family_dir: Path) -> None:
    model, config = load_model(str(family_dir), dtype="bfloat16", device="cpu")
    eager = _steps(model, config.vocab_size, EAGER)
    fused = _steps(model, config.vocab_size, PLAIN_FUSED)
    for e, f in zip(eager, fused, strict=True):
        assert torch.isfinite(e).all() and torch.equal(e, f)


def test_fused_entries_compose_the_eager_ones() -> None:
    """Each fusing entry of EAGER is its composition, and the plain fused bundle's CPU
    fallback gives the same bits (a layer with a bias too: never a Triton route)."""
    torch.manual_seed(0)
    gate_up, down, qkv = make_linear(32, 48, None), make_linear(24, 32, None), make_linear(32, 40, None, bias=True)
    x = torch.randn(2, 3, 32)
    nw = 1 + 0.1 * torch.randn(32)
    with torch.no_grad():
        qkv.bias.normal_()
        h = EAGER.rmsnorm(x, nw, 1e-6)
        want_mlp = x + down(EAGER.swiglu(gate_up, h))
        for bundle in (EAGER, PLAIN_FUSED):
            assert torch.equal(bundle.norm_linear(qkv, x, nw, 1e-6), qkv(h))
            assert torch.equal(bundle.swiglu_linear(down, gate_up(h), x), want_mlp)
            assert torch.equal(bundle.mlp(gate_up, down, x, nw, 1e-6), want_mlp)


def test_route_table_and_its_check() -> None:
    check_routes(ROUTES)
    for kind in ("bf16", "fp8"):
        for part in ("linear", "gate_up"):
            # batch-1 decode: the fused GEMV (bf16 and FP8); two rows: cuBLAS (bf16), the
            # Triton matmul (FP8)
            assert table_route(kind, part, 1) == GEMV
            assert table_route(kind, part, 2) == (LIBRARY if kind == "bf16" else MATMUL)
            assert table_route(kind, part, 17) == LIBRARY  # past the Triton kernels' rows
    assert table_route("fp8", "gate_up", 6) == MATMUL and table_route("bf16", "linear", 6) == LIBRARY
    bad = dict(ROUTES)
    bad[("fp8", "linear")] = (GEMV, "cublas", MATMUL, MATMUL, MATMUL)
    with pytest.raises(ValueError, match="'gemv', 'matmul' or 'library'"):
        check_routes(bad)
    bad[("fp8", "linear")] = (GEMV,)
    with pytest.raises(ValueError, match="one route per row bucket"):
        check_routes(bad)
    # off the GPU every call takes the library route, whatever the table says
    layer = make_linear(16, 8, "fp8")
    assert route(layer, torch.randn(1, 16, dtype=torch.bfloat16), "gate_up") == LIBRARY


def test_rotary_kv_write_checks_name_the_fix() -> None:
    pytest.importorskip("triton")
    from infer.models.kernels.rotary_write import check_rotary_inputs
    q, k = torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 2, 8)
    cos, rows, cache = torch.zeros(2, 3, 1, 8), torch.zeros(6, dtype=torch.long), torch.zeros(10, 2, 8)
    check_rotary_inputs(q, k, k, cos, cos, cache, cache, rows)  # valid
    cases = [((q[0], k, k, cos, cos, cache, cache, rows), "q \\[B, T, Hq, D\\]"),
             ((q[..., :7], k[..., :7], k[..., :7], cos[..., :7], cos[..., :7], cache[..., :7], cache[..., :7], rows),
              "even head_dim"),
             ((q.transpose(2, 3).contiguous().transpose(2, 3), k, k, cos, cos, cache, cache, rows), "contiguous along"),
             ((q, k, k, cos[:1], cos, cache, cache, rows), "cos must be \\[B=2, T=3, 1, D=8\\]"),
             ((q, k, k, cos, cos, cache[:, :1], cache, rows), "one layer's \\[rows, Hkv=2, D=8\\]"),
             ((q, k, k, cos, cos, cache, cache, rows.int()), "write_rows must be a long tensor \\[B \\* T = 6\\]")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            check_rotary_inputs(*args)
