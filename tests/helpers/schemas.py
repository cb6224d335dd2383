"""Varied JSON schemas, made from a seed: nested objects, arrays, enums, bounded integers,
numbers, booleans, nulls, strings with a length limit or a pattern, and unions.

Every schema bounds what a model could repeat forever (string lengths, array sizes,
integer ranges, nesting depth), so a constrained output always ends within a few hundred
tokens, even from a random model.
"""

from __future__ import annotations

import random
from typing import Any

Schema = dict[str, Any]

PATTERNS = ("^[a-z]{1,6}$", "^[A-Z][a-z]{0,4}$", "^[0-9]{2,4}$", "^(yes|no)$", "^[a-f0-9]{3}-[a-f0-9]{3}$")
WORDS = ("red", "green", "blue", "cat", "dog", "x", "y z", "alpha", "beta")


def _leaf(rng: random.Random) -> Schema:
    kind = rng.choice(("integer", "number", "boolean", "null", "string", "pattern", "enum", "const"))
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -100, "maximum": 100}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 10)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(WORDS)}
    return {"type": kind}


def _node(rng: random.Random, depth: int) -> Schema:
    roll = rng.random()
    if depth > 0 and roll < 0.3:
        return make_object(rng, depth - 1)
    if depth > 0 and roll < 0.5:
        return {"type": "array", "items": _node(rng, depth - 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    if roll < 0.6:
        return {"anyOf": [_leaf(rng), _leaf(rng)]}
    return _leaf(rng)


def make_object(rng: random.Random, depth: int) -> Schema:
    """An object of 1-4 properties, all or some required, no others allowed."""
    names = rng.sample(("id", "name", "tags", "size", "ok", "meta", "kind", "items", "score"), rng.randint(1, 4))
    props = {name: _node(rng, depth) for name in names}
    required = names if rng.random() < 0.6 else names[: rng.randint(1, len(names))]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def make_schemas(count: int, seed: int = 0) -> list[Schema]:
    """`count` different schemas (objects nested up to 2 levels, with arrays and leaves)."""
    rng = random.Random(seed)
    return [make_object(rng, depth=rng.randint(0, 2)) for _ in range(count)]
