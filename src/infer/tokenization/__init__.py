"""Tokenization internals: file discovery, backends, chat templates, streaming decoding.

The public entry points are `infer.tokenizer.Tokenizer` and `IncrementalDetokenizer`.
"""
