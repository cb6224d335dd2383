"""Tokenizer: text <-> token ids, chat templates and streaming detokenization.

`Tokenizer.from_pretrained(path)` loads a Hugging Face model directory (`tokenizer.json`, or a
Llama 3 tiktoken `tokenizer.model`, with Llama 3 defaults when it comes alone) or a GGUF file
(`gguf.py`); special, BOS and stop ids and the chat template come from the config files.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, overload

from infer.models.loading.gguf.path import is_gguf_path
from infer.models.special_tokens import LLAMA3_STOP_TOKENS
from infer.tokenization.backends import (
    HFTokenizersBackend,
    TiktokenBackend,
    TokenizerBackend,
    TokenLimitExceeded,
    byte_level_bytes,
)
from infer.tokenization.chat import LLAMA3_CHAT_TEMPLATE, LLAMA3_HEADER_TOKENS, render_chat_template
from infer.tokenization.detokenizer import IncrementalDetokenizer
from infer.tokenization.files import TokenizerFiles, id_list, locate_tokenizer_files, token_content
from infer.tokenization.special import encode_rendered, escape_messages, special_pattern
from infer.tokenization.token_keys import TokenKey, vocabulary_keys

__all__ = ["Tokenizer", "IncrementalDetokenizer", "TokenLimitExceeded"]

# Special-token strings of tokenizer_config.json that templates may refer to.
TEMPLATE_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token",
                       "sep_token", "cls_token", "mask_token")


class Tokenizer:
    """A model's tokenizer plus the config around it (special ids, stop ids, chat template)."""

    def __init__(self, backend: TokenizerBackend, *, name_or_path: str,
                 token_strings: Mapping[str, str | None], extra_eos_ids: Sequence[int] = (),
                 bos_token_id: int | None = None, pad_token_id: int | None = None,
                 chat_template: str | None = None, add_bos_token: bool | None = None,
                 add_eos_token: bool | None = None) -> None:
        self._backend = backend
        self.name_or_path = name_or_path
        self.backend_name = backend.name
        self.vocab_size: int = backend.vocab_size
        self._token_strings = {k: v for k, v in token_strings.items() if v is not None}
        self.bos_token_id = self._id_of("bos_token", bos_token_id)
        self.pad_token_id = self._id_of("pad_token", pad_token_id)
        self.eos_token_id = self._id_of("eos_token", None)  # the one `add_eos_token` appends
        eos = {*extra_eos_ids, *([] if self.eos_token_id is None else [self.eos_token_id])}
        for token_id in eos:
            self._check_id(token_id, "eos_token_id")
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))
        self.chat_template = chat_template
        self._add_bos_token = add_bos_token
        self._add_eos_token = add_eos_token

    # ---------------------------------------------------------------- loading

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of a local Hugging Face model directory or a GGUF file."""
        if is_gguf_path(path):
            from infer.tokenization.gguf import read_gguf_tokenizer  # (the gguf library: GGUF files only)

            parts = read_gguf_tokenizer(path)
            return cls(parts.backend, name_or_path=str(path), token_strings=parts.token_strings,
                       extra_eos_ids=parts.eos_token_ids, chat_template=parts.chat_template,
                       add_bos_token=parts.add_bos_token, add_eos_token=parts.add_eos_token)
        files = locate_tokenizer_files(path)
        if files.tokenizer_json is not None:
            backend: TokenizerBackend = HFTokenizersBackend.from_file(files.tokenizer_json)
        else:
            assert files.tiktoken_model is not None
            backend = TiktokenBackend.from_file(files.tiktoken_model)
        return cls._from_files(files, backend, name_or_path=str(path))

    @classmethod
    def _from_files(cls, files: TokenizerFiles, backend: TokenizerBackend,
                    name_or_path: str) -> Tokenizer:
        config, generation = files.tokenizer_config, files.generation_config
        strings = {key: token_content(config.get(key, files.special_tokens_map.get(key)))
                   for key in TEMPLATE_TOKEN_KEYS}
        eos_ids = id_list(generation.get("eos_token_id"), "eos_token_id")
        bos_ids = id_list(generation.get("bos_token_id"), "bos_token_id")
        pad_ids = id_list(generation.get("pad_token_id"), "pad_token_id")
        template = files.chat_template
        if isinstance(backend, TiktokenBackend):  # Llama 3 defaults for what configs omit
            if strings["bos_token"] is None and not bos_ids:
                strings["bos_token"] = "<|begin_of_text|>"
            if strings["eos_token"] is None and not eos_ids:
                strings["eos_token"] = LLAMA3_STOP_TOKENS[0]
                eos_ids = [backend.special_tokens[name] for name in LLAMA3_STOP_TOKENS]
            if strings["pad_token"] is None and not pad_ids:
                strings["pad_token"] = "<|finetune_right_pad_id|>"
        if template is None and all(backend.token_to_id(t) is not None
                                    for t in LLAMA3_HEADER_TOKENS):
            template = LLAMA3_CHAT_TEMPLATE
        return cls(backend, name_or_path=name_or_path, token_strings=strings,
                   extra_eos_ids=eos_ids, bos_token_id=bos_ids[0] if bos_ids else None,
                   pad_token_id=pad_ids[0] if pad_ids else None, chat_template=template,
                   add_bos_token=_optional_bool(config, "add_bos_token"),
                   add_eos_token=_optional_bool(config, "add_eos_token"))

    # --------------------------------------------------------------- encoding

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True,
               limit: int | None = None) -> list[int]:
        """Token ids of `text`; special-token strings become their ids (plain text with
        `parse_special=False`, for untrusted text). `add_special_tokens` adds BOS/EOS as configured.
        Over `limit` tokens raises `TokenLimitExceeded` (its `count`). Releases the GIL."""
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        explicit = self._add_bos_token is not None or self._add_eos_token is not None
        if not add_special_tokens or not explicit:
            return self._backend.encode(text, add_special_tokens=add_special_tokens, parse_special=parse_special,
                                        limit=limit)
        ids = self._backend.encode(text, add_special_tokens=False, parse_special=parse_special, limit=limit)
        if self._add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        if self._add_eos_token and self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; bytes that do not form whole UTF-8 characters become U+FFFD."""
        ids = [int(token_id) for token_id in ids]
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            for token_id in ids:
                self._check_id(token_id, "token id")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @overload
    def convert_ids_to_tokens(self, ids: int) -> str: ...
    @overload
    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]: ...

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        """Vocabulary strings of `ids` (byte-level form, e.g. "Ġhello" for " hello")."""
        if isinstance(ids, int):
            return self._token_of(ids)
        return [self._token_of(token_id) for token_id in ids]

    def token_to_id(self, token: str) -> int | None:
        """Id of the vocabulary string `token` (e.g. "<|eot_id|>"), None if absent."""
        return self._backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The raw bytes of a byte-level token (maybe part of a character); None if special or not byte-level."""
        token = self._backend.id_to_token(token_id)
        if token is None or self.is_special(token_id):
            return None
        return byte_level_bytes(token)

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a special token (skipped by skip_special_tokens)."""
        return token_id in self._backend.special_ids()

    @property
    def bos_token(self) -> str | None:
        return self._token_strings.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._token_strings.get("eos_token")

    # ----------------------------------------------------------- chat template

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            **template_kwargs: Any) -> str | list[int]:
        """Render `messages` with the chat template; ids (no added special tokens) when `tokenize`."""
        if self.chat_template is None:
            raise ValueError(f"tokenizer {self.name_or_path!r} has no chat template; add "
                             "chat_template to tokenizer_config.json or send plain prompts")
        text = render_chat_template(self.chat_template, messages,
                                    add_generation_prompt=add_generation_prompt,
                                    special_tokens=self._token_strings, tools=tools,
                                    **template_kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    parse_special: bool = False, tools: Sequence[Mapping[str, Any]] | None = None,
                    **template_kwargs: Any) -> list[int]:
        """Token ids of `messages` rendered with the chat template; special-token strings inside the
        messages' and tools' own text stay plain text unless `parse_special` (`tokenization.special`)."""
        specials, pattern = self._special_strings
        if parse_special or pattern is None:
            ids = self.apply_chat_template(messages, add_generation_prompt, tokenize=True, tools=tools,
                                           **template_kwargs)
            assert isinstance(ids, list)
            return ids
        # the tools' strings are the template's input too: escaped with the messages, one marker
        escaped, restore = escape_messages([*messages, *(tools or ())], pattern, specials)
        escaped_tools = escaped[len(messages):] if tools is not None else None
        text = self.apply_chat_template(escaped[:len(messages)], add_generation_prompt, tools=escaped_tools,
                                        **template_kwargs)
        assert isinstance(text, str)
        return encode_rendered(text, pattern, self._backend.token_to_id,
                               lambda piece: self._backend.encode(piece, add_special_tokens=False,
                                                                  parse_special=False), restore)

    @cached_property
    def _special_strings(self) -> tuple[list[str], re.Pattern[str] | None]:
        """The vocabulary's special-token strings and a regex matching any of them (None: none)."""
        specials = sorted({t for i in self._backend.special_ids() if (t := self._backend.id_to_token(i))})
        return specials, special_pattern(specials)

    # ------------------------------------------------------------- vocabulary

    def vocabulary(self) -> list[str | None]:
        """The vocabulary string of every id in [0, vocab_size), None for an id without one."""
        return [self._backend.id_to_token(token_id) for token_id in range(self.vocab_size)]

    def token_keys(self) -> list[TokenKey | None]:
        """What every id in [0, vocab_size) stands for across tokenizers (`token_keys.py`), None if unknown."""
        backend = self._backend
        return vocabulary_keys([backend.id_to_token(i) for i in range(self.vocab_size)], backend.special_ids(),
                               backend.added_contents(), backend.token_form())

    # ---------------------------------------------------------------- helpers

    def _id_of(self, key: str, fallback: int | None) -> int | None:
        token = self._token_strings.get(key)
        if token is None:
            return fallback
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer_config.json: {key} {token!r} is not in the vocabulary "
                             f"of {self.name_or_path!r}; fix the config")
        return token_id

    def _check_id(self, token_id: int, what: str) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"{what} {token_id} is outside the vocabulary "
                             f"[0, {self.vocab_size}) of {self.name_or_path!r}")

    def _token_of(self, token_id: int) -> str:
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary "
                             f"[0, {self.vocab_size}) of {self.name_or_path!r}")
        return token

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name_or_path!r}, backend={self.backend_name}, "
                f"vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids})")


def _optional_bool(config: Mapping[str, Any], key: str) -> bool | None:
    value = config.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise ValueError(f"tokenizer_config.json: {key} must be true or false, found {value!r}")
