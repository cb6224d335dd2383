"""Loading models and heads: `loader.py` (the one build function: `load_model`), its format
readers (`readers.py`: safetensors, GGUF in `gguf/`, dummy weights), quantized checkpoints'
formats (`quantized.py`) and layouts (`layouts.py`), writing a checkpoint (`checkpoint.py`),
and the draft heads' files (`eagle_files.py`, `medusa_files.py`, `dummy_heads.py`)."""
