"""GGUF files (llama.cpp's single-file checkpoints) as a source of Llama models.

`reader.py` opens and validates a file (magic, truncation, architecture) and reads its
metadata (`header.py`: straight from the memory map); `config.py` turns that metadata into
a `ModelConfig`; `weights.py` yields the tensors under Hugging Face names for
`LlamaForCausalLM.load_hf_weights`, quantized blocks as integer codes (`repack.py`) or
dequantized with the `gguf` library. The tokenizer a file describes is built in
`infer.tokenization.gguf`. `path.py` tells a GGUF file by its name or magic without
importing the `gguf` library.
"""
