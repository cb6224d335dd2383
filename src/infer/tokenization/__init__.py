"""Tokenization: text <-> token ids, chat templates and streaming detokenization (`Tokenizer`)."""

from infer.tokenization.backends import TokenLimitExceeded
from infer.tokenization.detokenizer import IncrementalDetokenizer
from infer.tokenization.tokenizer import Tokenizer

__all__ = ["Tokenizer", "IncrementalDetokenizer", "TokenLimitExceeded"]
