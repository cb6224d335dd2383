"""Shared test helpers: checkpoints with random weights in the exact Hugging Face layout."""
