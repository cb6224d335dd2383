"""The decoder's layers: linear (with quantization and tensor-parallel settings), attention views,
rotary embedding, RMSNorm and the SwiGLU MLP."""
