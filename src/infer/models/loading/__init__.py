"""Loading models (`loader.load_model`; safetensors, GGUF, dummy weights) and draft heads, and
writing checkpoints (`checkpoint.py`)."""
