"""Structured outputs, piece by piece: the spec's validation, the bitmask unpacking and
masking, and a request grammar's masks after a draft path with the rollback that follows."""

from __future__ import annotations

import json

from types import SimpleNamespace

import pytest
import torch

from infer.speculative.grammar_mask import allocate_bitmask, allowed_tokens, grammar_masked, mask_logits
from infer.sampling import SamplingParams, StructuredOutput

# -- the spec --------------------------------------------------------------------------------


def test_a_schema_dict_becomes_compact_json_in_its_own_key_order():
    spec = StructuredOutput(json={"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}})
    assert json.loads(spec.json) == {"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}}
    assert list(json.loads(spec.json)["properties"]) == ["b", "a"]
    assert spec.kind == "json"
    assert spec == StructuredOutput(json=json.dumps({"type": "object", "properties": {"b": {"type": "integer"},
                                                                                          "a": {}}}, indent=2))
    assert hash(spec) == hash(StructuredOutput(json=spec.json))


@pytest.mark.parametrize("kwargs, words", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": "[1, 2]"}, "schema object"),
    ({"json": 3}, "JSON schema"),
    ({"regex": ""}, "non-empty string"),
    ({"choice": "abc"}, "list of strings"),
    ({"choice": []}, "list of strings"),
    ({"choice": ["a", ""]}, "non-empty strings"),
    ({"json_object": 1}, "True or False"),
])
def test_bad_specs_are_refused_naming_the_problem(kwargs, words):
    with pytest.raises(ValueError, match=words):
        StructuredOutput(**kwargs)


def test_sampling_params_take_a_spec_but_not_with_ignore_eos():
    spec = StructuredOutput(choice=["a", "b"])
    assert SamplingParams(structured=spec).structured.choice == ("a", "b")
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(structured=spec, ignore_eos=True)
    with pytest.raises(ValueError, match="StructuredOutput"):
        SamplingParams(structured={"regex": "a"})


# -- masks -----------------------------------------------------------------------------------


def test_allowed_tokens_unpacks_bits_in_xgrammar_layout():
    vocab = 70  # three words, the last one partial
    bitmask = allocate_bitmask(2, vocab)
    assert bitmask.shape == (2, 3)
    bitmask[0] = 0
    bitmask[0, 0] = (1 << 5) - 2**31  # tokens 5 and 31 (bit 31: the sign bit)
    bitmask[0, 2] = 1 << 1  # token 65
    allowed = allowed_tokens(bitmask, vocab)
    assert allowed[0].nonzero().flatten().tolist() == [5, 31, 65]
    assert allowed[1].all()
    # a model vocabulary wider than the bitmask: the tokens past it are never allowed
    assert not allowed_tokens(bitmask, 100)[1, 96:].any() and allowed_tokens(bitmask, 100)[1, :96].all()


def test_mask_logits_touches_only_the_listed_rows():
    logits = torch.randn(3, 40)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 1] = 1 << 3  # token 35 only
    out = mask_logits(logits, bitmask, [1])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert out[1].argmax().item() == 35 and torch.isinf(out[1]).sum().item() == 39
    assert not torch.isinf(logits).any()  # the input is left as it was


class _OnlyToken:
    """A stand-in grammar that allows one token."""

    vocab_size = 64

    def __init__(self, token: int) -> None:
        self.token = token
        self.paths: list[list[int]] = []

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        bitmask[row, self.token // 32] = 1 << (self.token % 32)

    def fill_after(self, bitmask: torch.Tensor, row: int, path) -> None:
        self.paths.append(list(path))
        self.fill(bitmask, row)


def _owner(grammar):
    """A request as the masks see it (`grammar_mask.Constrained`)."""
    return SimpleNamespace(request_id="r", fault=None, grammar=grammar)


def test_grammar_masked_masks_rows_with_a_grammar():
    logits = torch.randn(2, 64)
    out = grammar_masked(logits, [_owner(None), _owner(_OnlyToken(40))])
    assert torch.equal(out[0], logits[0]) and out[1].argmax().item() == 40
    assert grammar_masked(logits, [_owner(None), _owner(None)]) is logits
    grammar = _OnlyToken(7)
    out = grammar_masked(logits, [_owner(grammar), _owner(None)], [[3, 4], []])  # a draft's tokens so far
    assert grammar.paths == [[3, 4]] and out[0].argmax().item() == 7 and torch.equal(out[1], logits[1])


def test_a_grammar_that_fails_to_fill_leaves_its_row_unmasked_and_its_request_faulted():
    class Broken(_OnlyToken):
        def fill(self, bitmask, row):
            bitmask[row] = 0  # a partial write, then the failure
            raise RuntimeError("matcher state lost")

    logits = torch.randn(2, 64)
    owners = [_owner(Broken(3)), _owner(_OnlyToken(9))]
    out = grammar_masked(logits, owners)
    assert torch.equal(out[0], logits[0]) and out[1].argmax().item() == 9
    assert "matcher state lost" in owners[0].fault and owners[1].fault is None


# -- a request grammar (xgrammar) ------------------------------------------------------------


@pytest.fixture(scope="module")
def grammars(ckpt_a):
    pytest.importorskip("xgrammar")
    from infer.engine.structured import Grammars
    from infer.tokenization import Tokenizer

    tok = Tokenizer.from_pretrained(ckpt_a)
    return tok, Grammars(tok, tok.vocab_size, [tok.token_to_id("</s>")])


def _allowed_after(grammar, path, vocab):
    bitmask = allocate_bitmask(1, vocab)
    grammar.fill_after(bitmask, 0, path)
    return set(allowed_tokens(bitmask, vocab)[0].nonzero().flatten().tolist())


def test_masks_after_a_path_then_roll_back(grammars):
    tok, g = grammars
    vocab = tok.vocab_size
    grammar = g.matcher(StructuredOutput(choice=["ab", "ac", "b"]))
    a, b, c = (tok.token_to_id(x) for x in "abc")
    eos = tok.token_to_id("</s>")
    root = _allowed_after(grammar, [], vocab)
    assert {a, b} <= root and c not in root and eos not in root
    after_a = _allowed_after(grammar, [a], vocab)
    assert {b, c} <= after_a and a not in after_a
    assert _allowed_after(grammar, [b], vocab) == {eos}  # "b" is complete: only EOS follows
    # a refused path (a then a) leaves its row all-allowed: the verifier rejects the node first
    assert len(_allowed_after(grammar, [a, a], vocab)) == vocab
    assert _allowed_after(grammar, [], vocab) == root  # every fill_after rolled back
    grammar.accept(a)
    assert _allowed_after(grammar, [], vocab) == after_a
    with pytest.raises(RuntimeError, match="does not allow"):
        grammar.accept(a)
    grammar.accept(c)
    grammar.accept(eos)
    assert grammar.is_terminated


def test_a_bad_spec_names_the_problem(grammars):
    _, g = grammars
    with pytest.raises(ValueError, match=r"invalid structured output \(json\): .*wat"):
        g.compile(StructuredOutput(json={"type": "wat"}))
    with pytest.raises(ValueError, match=r"invalid structured output \(grammar\): .*missing"):
        g.compile(StructuredOutput(grammar="root ::= missing"))


def test_the_grammar_cache_is_bounded_in_bytes():
    pytest.importorskip("xgrammar")
    from types import SimpleNamespace

    from infer.engine.structured import GrammarCache

    def grammar(size):
        return SimpleNamespace(memory_size_bytes=size)

    specs = [StructuredOutput(regex=f"a{i}") for i in range(4)]
    cache = GrammarCache(100)
    cache.put(specs[0], grammar(40))
    cache.put(specs[1], grammar(40))
    assert cache.get(specs[0]) is not None  # specs[0] is now the most recently used
    cache.put(specs[2], grammar(40))  # 120 bytes: the least recently used (specs[1]) goes
    assert (cache.get(specs[1]), cache.bytes, len(cache)) == (None, 80, 2)
    cache.put(specs[3], grammar(101))  # larger than the whole cache: not kept
    assert (cache.get(specs[3]), cache.bytes) == (None, 80)
    assert cache.get(specs[0]) is not None and cache.get(specs[2]) is not None
