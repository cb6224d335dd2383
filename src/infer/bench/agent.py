"""The agent workload's prompts: repeated tool-calling requests, as an agent framework sends them.

Every request has the same preamble (the tool list and the answer format), then a task of
its own drawn from a few templates, then the start of the answer, a tool call as one JSON
object: the outputs of different requests take the same shapes (a tool's name, then its
arguments with the same keys), which is what a cache of earlier outputs (suffix decoding)
drafts from, and what the request's own prompt holds only in part.

With a tokenizer the prompt is that text, at most the workload's prompt budget (the tool
list is cut to fit). Without one (dummy shapes) it is seeded random ids with the same
structure: a shared preamble, a task of its own (16 ids), a shared answer start (4 ids).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

TOOLS = (
    ('get_weather', '{"city": string, "date": "YYYY-MM-DD"}', "the forecast for a city on a day"),
    ('search_files', '{"query": string, "path": string, "max_results": integer}', "files whose text matches"),
    ('send_email', '{"to": string, "subject": string, "body": string}', "sends an email"),
    ('create_ticket', '{"project": string, "title": string, "priority": "low" | "high", "labels": [string]}',
     "opens a ticket in the tracker"),
    ('run_sql', '{"database": string, "query": string}', "runs a read-only SQL query"),
    ('book_meeting', '{"attendees": [string], "start": "YYYY-MM-DDTHH:MM", "minutes": integer}',
     "books a meeting room"),
)
CITIES = ("Oslo", "Lisbon", "Osaka", "Lima", "Nairobi", "Denver", "Hanoi", "Tallinn")
NAMES = ("ana", "bo", "chen", "dara", "eli", "femi", "gus", "hana")
TOPICS = ("login timeout", "slow search", "broken export", "missing logs", "disk usage", "cache misses")
TASKS = (
    "What will the weather be in {city} on 2025-0{m}-1{d}?",
    "Find the files under src/ that mention {topic}; at most {n} results.",
    "Email {name}@example.com that the {topic} fix ships on 2025-0{m}-1{d}.",
    "Open a high priority ticket in project core about {topic}.",
    "How many orders did {city} place in 2025-0{m}? The database is sales.",
    "Book 30 minutes with {name} and {name2} on 2025-0{m}-1{d} at 1{d}:00.",
)
ANSWER_START = '{"name": "'
TASK_IDS, ANSWER_IDS = 16, 4  # tokenizer-less prompts: a task's and the answer start's ids


def preamble(tools: Sequence[tuple[str, str, str]]) -> str:
    lines = ["You are an agent with tools. Answer each task with one tool call: a JSON object on one line,",
             '{"name": <tool>, "arguments": {<argument>: <value>, ...}}, and nothing else.', "", "Tools:"]
    lines += [f"- {name}: {about}. Arguments: {args}" for name, args, about in tools]
    return "\n".join(lines) + "\n\n"


def task(rng: random.Random) -> str:
    names = rng.sample(NAMES, 2)
    return rng.choice(TASKS).format(city=rng.choice(CITIES), topic=rng.choice(TOPICS), name=names[0],
                                    name2=names[1], m=rng.randint(1, 9), d=rng.randint(0, 9), n=rng.randint(3, 20))


def agent_prompts(count: int, budget: int, seed: int, encode: Callable[[str], list[int]] | None,
                  vocab_size: int) -> tuple[list[list[int]], str]:
    """(prompts, their source) of `count` requests of at most `budget` tokens (module
    docstring); `encode`: the tokenizer's (None: random ids)."""
    rng = random.Random(seed)
    if encode is None:
        shared = [rng.randrange(vocab_size) for _ in range(budget - TASK_IDS - ANSWER_IDS)]
        answer = [rng.randrange(vocab_size) for _ in range(ANSWER_IDS)]
        prompts = [shared + [rng.randrange(vocab_size) for _ in range(TASK_IDS)] + answer for _ in range(count)]
        return prompts, f"random ids: a shared preamble, a task of {TASK_IDS} ids each, seed {seed}"
    tasks = [task(rng) for _ in range(count)]
    for tools in range(len(TOOLS), 0, -1):  # as many tools as fit in the budget
        head = preamble(TOOLS[:tools])
        prompts = [encode(f"{head}Task: {t}\nCall: {ANSWER_START}") for t in tasks]
        if max(len(p) for p in prompts) <= budget:
            return prompts, f"agent tool calls: {tools} tools, tasks from {len(TASKS)} templates, seed {seed}"
    raise ValueError(f"the agent workload's prompts need more than {budget} tokens: raise its prompt_len")
