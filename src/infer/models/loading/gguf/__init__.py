"""GGUF files (llama.cpp's single-file checkpoints) as a source of Llama models.

`reader.py` opens and validates a file (`header.py` reads the memory map), `config.py` makes the
`ModelConfig`, `weights.py` yields Hugging Face-named tensors (codes via `repack.py`), `path.py`
recognises a file without the `gguf` library. Tokenizer: `infer.tokenization.gguf`.
"""
