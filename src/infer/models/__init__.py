"""Llama-family models (`llama.py`), EAGLE and Medusa heads, their layers, kernels and loading."""
