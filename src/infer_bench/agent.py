"""The agent workload's prompts: repeated tool-calling requests, as an agent framework sends them.

Every request has the same preamble (the tool list and the answer format), then a task of
its own drawn from a few templates (agent.toml), then the start of the answer, a tool call as
one JSON object: the outputs of different requests take the same shapes, which is what a
cache of earlier outputs (suffix decoding) drafts from. Without a tokenizer (dummy shapes) a
prompt is seeded random ids of the same structure: a shared preamble, a task of its own (16
ids), a shared answer start (4 ids).
"""

from __future__ import annotations

import random
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path

TEXTS = tomllib.loads((Path(__file__).parent / "agent.toml").read_text(encoding="utf-8"))
TOOLS: list[list[str]] = TEXTS["tools"]  # [name, arguments, what it does]
TASK_IDS, ANSWER_IDS = 16, 4  # tokenizer-less prompts: a task's and the answer start's ids


def preamble(tools: Sequence[Sequence[str]]) -> str:
    lines = [f"- {name}: {about}. Arguments: {args}" for name, args, about in tools]
    return TEXTS["preamble"] + "\n".join(lines) + "\n\n"


def task(rng: random.Random) -> str:
    names = rng.sample(TEXTS["names"], 2)
    return rng.choice(TEXTS["tasks"]).format(city=rng.choice(TEXTS["cities"]), topic=rng.choice(TEXTS["topics"]),
                                             name=names[0], name2=names[1], m=rng.randint(1, 9), d=rng.randint(0, 9),
                                             n=rng.randint(3, 20))


def agent_prompts(count: int, budget: int, seed: int, encode: Callable[[str], list[int]] | None,
                  vocab_size: int) -> tuple[list[list[int]], str]:
    """(prompts, their source) of `count` requests of at most `budget` tokens, the tool list cut
    to fit; `encode`: the tokenizer's (None: random ids)."""
    rng = random.Random(seed)
    if encode is None:
        shared = [rng.randrange(vocab_size) for _ in range(budget - TASK_IDS - ANSWER_IDS)]
        answer = [rng.randrange(vocab_size) for _ in range(ANSWER_IDS)]
        prompts = [shared + [rng.randrange(vocab_size) for _ in range(TASK_IDS)] + answer for _ in range(count)]
        return prompts, f"random ids: a shared preamble, a task of {TASK_IDS} ids each, seed {seed}"
    tasks = [task(rng) for _ in range(count)]
    for tools in range(len(TOOLS), 0, -1):  # as many tools as fit in the budget
        head = preamble(TOOLS[:tools])
        prompts = [encode(f"{head}Task: {t}\nCall: {TEXTS['answer_start']}") for t in tasks]
        if max(len(p) for p in prompts) <= budget:
            return prompts, f"agent tool calls: {tools} tools, tasks from {len(TEXTS['tasks'])} templates, seed {seed}"
    raise ValueError(f"the agent workload's prompts need more than {budget} tokens: raise its prompt_len")
