"""`infer` command line: generate (stream a completion), serve (OpenAI-compatible server),
bench (benchmark workloads)."""

from __future__ import annotations

import argparse
import sys
import time

from infer.engine.args import add_engine_args, engine_config_from_args


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete one prompt, streaming text to the terminal")
    p.add_argument("--prompt", default="def fibonacci(n):", help="prompt text (default: %(default)r)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    add_engine_args(p)
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    from infer.engine.engine import Engine
    from infer.sampling import SamplingParams

    config = engine_config_from_args(args)
    engine = Engine(config)
    tok = engine.tokenizer
    if tok is None:
        print("error: this model has no tokenizer; use `infer bench` for tokenizer-less dummy shapes",
              file=sys.stderr)
        return 2
    if args.chat:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=True)
    else:
        ids = tok.encode(args.prompt)
        sys.stdout.write(args.prompt)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens)
    # sampling is seeded by the engine's --seed (default 0): the same command gives the same text
    request = engine.add_request(ids, params)
    start = time.perf_counter()
    while not request.is_finished:
        for _, out in engine.step():
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
    elapsed = time.perf_counter() - start
    n = len(request.output_token_ids)
    summary = f"\n\n[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tokens/s, finish: {request.finish_reason.value}"
    if request.mean_acceptance_rate() is not None:
        summary += (f", acceptance {request.mean_acceptance_rate():.2f}, "
                    f"{request.mean_accepted_length():.2f} tokens/round")
    print(summary + "]")
    return 0


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    from infer.server.__main__ import add_server_args
    add_server_args(p)
    p.set_defaults(func=lambda a: __import__("infer.server.__main__", fromlist=["serve"]).serve(a))


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run benchmark workloads, write JSON results")
    from infer.bench.cli import add_bench_args, run_bench
    add_bench_args(p)
    p.set_defaults(func=run_bench)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="infer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    for add in (_serve_parser, _bench_parser):
        try:
            add(sub)
        except ImportError as exc:  # optional extras (server) not installed
            sub.add_parser(add.__name__.strip("_").split("_")[0], help=f"unavailable: {exc}")
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
