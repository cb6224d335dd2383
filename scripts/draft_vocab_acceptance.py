"""The demo pair's acceptance rate with and without a reduced draft vocabulary, on a CPU.

Builds the table from the demo corpus's train split (`infer draft-vocab --demo-corpus`),
then drafts for prompts cut from the validation split (text the models never saw) at T=0
and T=1, with the draft's whole vocabulary and with the table's, and prints each
acceptance rate, their difference, and the table's coverage of the target's own greedy
output tokens. Run from a checkout:

    PYTHONPATH=src python scripts/draft_vocab_acceptance.py --size 2048
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from infer import LLM, SamplingParams
from demo_pair.data import read_texts
from infer.corpus import split_corpus
from infer.draft_table import demo_corpus, text_counts
from infer.engine.loading import DEMO_TARGET, load_tokenizer
from infer.speculative.draft_vocab import build_table, count_tokens, coverage


def prompts(count: int, length: int) -> list[list[int]]:
    """The first `length` tokens of `count` validation files at least twice that long."""
    tokenizer = load_tokenizer(str(DEMO_TARGET))
    assert tokenizer is not None
    out = []
    for text in read_texts(split_corpus().valid):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= 2 * length:
            out.append(ids[:length])
        if len(out) == count:
            break
    return out


def acceptance(table: str | None, batch: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """The demo pair's acceptance rate over the batch, and the outputs' token ids."""
    extra = {} if table is None else {"spec_draft_vocab": table}
    with LLM(device="cpu", use_speculative_decoding=True, spec_length=4, seed=0, **extra) as llm:
        outputs = llm.generate(prompt_token_ids=batch, sampling_params=params)
        rate = llm.engine.runner.stats.acceptance_rate
    assert rate is not None
    return rate, [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=2048, help="tokens the table keeps (of the demo's 8192)")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    tokenizer = load_tokenizer(str(DEMO_TARGET))
    assert tokenizer is not None
    table = build_table(text_counts(tokenizer, demo_corpus()), args.size, 8192,
                        "the demo corpus (stdlib .py, train split)", tokenizer.eos_token_ids)
    print(table.describe())
    batch = prompts(args.prompts, args.prompt_len)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "table.json")
        table.save(path)
        for temperature in (0.0, 1.0):
            params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, seed=1)
            full, outputs = acceptance(None, batch, params)
            reduced, reduced_outputs = acceptance(path, batch, params)
            line = (f"T={temperature:g}: acceptance {full:.4f} whole vocabulary, {reduced:.4f} reduced "
                    f"({reduced - full:+.4f})")
            if temperature == 0:
                greedy = coverage(count_tokens(outputs), table.token_ids)
                line += (f"; greedy outputs identical: {outputs == reduced_outputs}; "
                         f"coverage of greedy tokens {greedy:.2%}")
            print(line)


if __name__ == "__main__":
    main()
