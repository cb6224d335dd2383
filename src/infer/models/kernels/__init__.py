"""Every Triton kernel of the decoder and what chooses them: `routes.py` (which kernel serves
which call: projections and attention), `bundle.py` (the `Kernels` bundles: EAGER, the fused
one), the kernels (`gemv.py`, `matmul.py`, `dequant.py`, `split_attention.py`,
`prefill_attention.py`, `rotary_write.py`), their launch parameters (`gemv_tiles.py` with
its measured table `gemv_tiles.json`, `matmul_tiles.py`) and the split-KV kernel's arrival
counters a KV pool owns (`arrivals.py`). The kernel modules import Triton; the rest import
without it."""
