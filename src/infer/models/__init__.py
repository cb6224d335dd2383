"""Llama-family model: configuration, forward pass, weight loading."""
