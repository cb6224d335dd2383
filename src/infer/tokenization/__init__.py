"""Tokenization: text <-> token ids, chat templates and streaming detokenization.

`Tokenizer` (tokenizer.py) is the entry point; file discovery (files.py), the `tokenizers`
and tiktoken backends (backends.py), chat templates (chat.py) and the streaming decoder
(detokenizer.py) sit beside it.
"""

from infer.tokenization.backends import TokenLimitExceeded
from infer.tokenization.detokenizer import IncrementalDetokenizer
from infer.tokenization.tokenizer import Tokenizer

__all__ = ["Tokenizer", "IncrementalDetokenizer", "TokenLimitExceeded"]
