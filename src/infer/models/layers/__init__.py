"""The decoder's layers: `linear.py` (one `LinearBase`, its quantization methods: dense,
FP8 (`fp8.py`), integer codes (`int_quant.py`, `int_embedding.py`), and its tensor-parallel
settings (`parallel.py`, `shard.py`)), attention views (`attention.py`, `paged_attention.py`),
the rotary embedding (`rotary.py`), RMSNorm (`norms.py`) and the SwiGLU MLP (`mlp.py`)."""
