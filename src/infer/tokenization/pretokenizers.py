"""The byte-level pre-tokenizers a GGUF file can name (`tokenizer.ggml.pre`), as llama.cpp runs them.

`PRE_TOKENIZERS` maps each name llama.cpp records ("llama-bpe", "qwen2", ...) to a `PreTokenizer`
(the regexes cutting text before merges). Where llama.cpp rewrote a regex for C++'s engine, the
model's own regex is used; unknown names are an error (gguf.py), never an approximation.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

# GPT-2: contractions, letter, digit and other runs (one optional leading space), trailing whitespace.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Llama 3 (and Smaug, DBRX): contractions, letters with one leading non-letter, 1-3 digit groups.
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2 (and StableLM 2): Llama 3's, with every digit its own piece.
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen 3.5: Qwen2's, with combining marks kept on their letters.
QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
          r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's tekken: words cut at lower-to-upper case changes, single digits.
TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o (o200k): tekken's case-aware words with contractions attached, digits in threes.
GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
         r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
         r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek LLM (its tokenizer.json's sequence): newlines, cased-letter runs (as code points),
# ASCII/full-width punctuation, trailing whitespace, CJK and Hangul runs, digit runs.
DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?["
    "\u0041-\u005a\u0061-\u007a\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf"
    "\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386"
    "\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556"
    "\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
    "\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184"
    "\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
    "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943"
    r"]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
)
# DeepSeek Coder: newlines, letter runs, punctuation runs, CJK and Hangul runs, single digits.
DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")
# StarCoder, SmolLM and kin: every digit on its own, then GPT-2's split.
STARCODER = (r"\p{N}", GPT2)
# Falcon: punctuation and symbol runs first, GPT-2's split, digits in threes.
FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]")
# BLOOM (and Poro, GPT-3 Finnish): runs without whitespace or sentence punctuation.
BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
# llama.cpp's "default": Falcon's, with digit runs cut before the groups of three.
DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True, slots=True)
class PreTokenizer:
    """How llama.cpp cuts text for one named byte-level vocabulary, and its BOS default."""

    splits: tuple[str, ...]  # regexes applied in turn, each cutting the pieces of the one before
    ignore_merges: bool = False  # a piece found whole in the vocabulary is one token
    add_bos: bool = False  # BOS is prepended when the file does not say (tokenizer.ggml.add_bos_token)

    def __post_init__(self) -> None:
        if not self.splits:
            raise ValueError("a PreTokenizer needs at least one split regex")

    def pre_tokenizer(self) -> pre_tokenizers.PreTokenizer:
        """The `tokenizers` pre-tokenizer: the splits in turn, then GPT-2's byte alphabet."""
        cuts = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in self.splits]
        return pre_tokenizers.Sequence([*cuts, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


_LLAMA3_RULES = PreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True)
# (names, rule): the names are llama.cpp's, grouped as its vocabulary loader groups them
_GROUPS: tuple[tuple[tuple[str, ...], PreTokenizer], ...] = (
    (("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "midm-2.0", "lfm2"), _LLAMA3_RULES),
    (("smaug-bpe", "dbrx"), PreTokenizer((LLAMA3,))),
    (("tekken",), PreTokenizer((TEKKEN,), ignore_merges=True, add_bos=True)),
    (("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), PreTokenizer((QWEN2,))),
    (("qwen35",), PreTokenizer((QWEN35,))),
    (("gpt-4o", "llama4"), PreTokenizer((GPT4O,))),
    (("gpt-2", "phi-2", "mpt", "olmo", "jais", "gigachat", "exaone4", "trillion", "granite-docling"),
     PreTokenizer((GPT2,))),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
     PreTokenizer(STARCODER)),
    (("deepseek-llm",), PreTokenizer(DEEPSEEK_LLM)),
    (("deepseek-coder",), PreTokenizer(DEEPSEEK_CODER)),
    (("falcon",), PreTokenizer(FALCON)),
    (("bloom", "poro-chat", "gpt3-finnish"), PreTokenizer((BLOOM,))),
    (("viking",), PreTokenizer((BLOOM, r"\p{N}"))),
    (("default",), PreTokenizer(DEFAULT)),
)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {name: rule for names, rule in _GROUPS for name in names}
