"""Llama-family models: the families at this level (`llama.py`, the EAGLE and Medusa heads,
their `config.py`, the flat batch they run, `batch.py`), their layers (`layers/`), kernels
(`kernels/`) and loading (`loading/`)."""
