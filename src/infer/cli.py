"""`infer` command line: generate (stream a completion), serve (OpenAI-compatible server),
bench (benchmark workloads).

Only the chosen command's flags are built, so `infer --help` imports neither torch nor the
server; every flag (sampling, engine, server) is validated before a model is loaded.

Under `torchrun` (tensor parallelism over several processes or nodes) every rank runs the
same command line: rank 0 runs the command, the others serve as its worker ranks.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from infer import DISTRIBUTION, __version__
from infer.engine.args import add_engine_args, engine_config_from_args

CLI_TEMPERATURE, CLI_MAX_TOKENS = 0.0, 128  # the library's SamplingParams defaults are 1.0 and 16


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default="def fibonacci(n):", help="prompt text (default: %(default)r)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--max-tokens", type=int, default=CLI_MAX_TOKENS,
                   help="tokens to generate at most (default: %(default)s; SamplingParams' default is 16)")
    p.add_argument("--temperature", type=float, default=CLI_TEMPERATURE,
                   help="0 = greedy (default: %(default)s; SamplingParams' default is 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, 1 = off (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=-1, help="-1 or 0 = off (default: %(default)s)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off (default: %(default)s)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2], 0 = off (default: %(default)s)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2], 0 = off (default: %(default)s)")
    add_engine_args(p)
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    from infer.engine.engine import Engine
    from infer.engine.loading import default_model_paths, load_tokenizer
    from infer.sampling import SamplingParams

    # everything the flags can get wrong fails here, before the weights load
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, max_tokens=args.max_tokens)
    config = engine_config_from_args(args)
    tok = load_tokenizer(config.tokenizer or default_model_paths(config)[0])
    if tok is None:
        raise ValueError("this model has no tokenizer; use `infer bench` for tokenizer-less dummy shapes")
    ids = tok.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)
    if len(ids) + params.max_tokens > config.max_seq_len:
        raise ValueError(f"the prompt ({len(ids)} tokens) + --max-tokens ({params.max_tokens}) exceeds "
                         f"--max-seq-len {config.max_seq_len}: shorten the prompt or lower --max-tokens")
    engine = Engine(config)
    # sampling is seeded by the engine's --seed (default 0): the same command gives the same text
    request = engine.add_request(ids, params)  # (the model's own context limit is checked here)
    if not args.chat:
        sys.stdout.write(args.prompt)
    start = time.perf_counter()
    first: float | None = None  # when the first token (the end of prefill) arrived
    while not request.is_finished:
        for _, out in engine.step():
            if first is None and out.token_id is not None:
                first = time.perf_counter()
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
    end = time.perf_counter()
    print("\n\n" + _summary(len(request.output_token_ids), start, first, end)
          + f", finish: {request.finish_reason.value}" + _extra(request, engine.threads) + "]")
    engine.close()
    return 0


def _summary(n: int, start: float, first: float | None, end: float) -> str:
    """"[N tokens in T s (prefill P s), D tokens/s decode": the rate counts the tokens after the
    first over the time after it, so a long prompt's prefill does not dilute it."""
    text = f"[{n} tokens in {end - start:.2f} s"
    if first is None:
        return text
    text += f" (prefill {first - start:.2f} s)"
    if n > 1 and end > first:
        text += f", {(n - 1) / (end - first):.1f} tokens/s decode"
    return text


def _extra(request: Any, threads: int | None) -> str:
    summary = ""
    if request.mean_acceptance_rate() is not None:
        summary += (f", acceptance {request.mean_acceptance_rate():.2f}, "
                    f"{request.mean_accepted_length():.2f} tokens/round")
    return summary + (f", {threads} CPU thread(s)" if threads else "")


def _serve_args(p: argparse.ArgumentParser) -> None:
    from infer.server.__main__ import add_server_args

    add_server_args(p)
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from infer.server.__main__ import serve

    return serve(args)


def _bench_args(p: argparse.ArgumentParser) -> None:
    from infer.bench.cli import add_bench_args, run_bench

    add_bench_args(p)
    p.set_defaults(func=run_bench)


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "generate": ("complete one prompt, streaming text to the terminal", _generate_args),
    "serve": ("OpenAI-compatible HTTP server (needs the server extra)", _serve_args),
    "bench": ("run benchmark workloads, write JSON results; --plot draws them", _bench_args),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser, with flags only for the command named in `argv` (if any)."""
    parser = argparse.ArgumentParser(prog="infer", description=__doc__,
                                     epilog="`infer COMMAND --help` lists a command's flags and their defaults")
    parser.add_argument("--version", action="version", version=f"infer {__version__} ({DISTRIBUTION})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (help_text, add_args) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            add_args(p)
    return parser


TORCHRUN_COMMANDS = ("generate", "serve")  # the commands a torchrun launch can split over ranks


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    from infer.distributed.group import is_torchrun_worker
    try:
        if is_torchrun_worker():
            if args.command not in TORCHRUN_COMMANDS:
                raise ValueError(f"under torchrun, `infer {args.command}` is not supported: use "
                                 f"{' or '.join(TORCHRUN_COMMANDS)}")
            from infer.distributed.worker import serve_torchrun_rank
            return serve_torchrun_rank(engine_config_from_args(args))
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
