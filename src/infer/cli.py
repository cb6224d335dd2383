"""`infer` command line: generate (stream a completion), chat (an interactive conversation),
serve (OpenAI-compatible server), bench (benchmark workloads, from `infer_bench`), draft-vocab (a reduced draft
vocabulary's table, `infer.draft_table`).

Only the chosen command's flags are built, so `infer --help` imports neither torch nor the
server; every flag (sampling, engine, server) is validated before a model is loaded. Every
flag also takes its underscore spelling (`--max_tokens`, as vLLM and the OpenAI API spell
it); a wrong flag or value is one line on stderr (exit 2), the command's `--help` the rest.

Under `torchrun` (tensor parallelism over several processes or nodes) every rank runs the
same command line: rank 0 runs the command, the others serve as its worker ranks.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from infer import DISTRIBUTION, __version__
from infer.engine.args import add_engine_args, dash_flags, engine_config_from_args

CLI_TEMPERATURE, CLI_MAX_TOKENS = 0.0, 128  # the library's SamplingParams defaults are 1.0 and 16
CHAT_MAX_TOKENS = 512  # an answer's tokens at most (and at most what the context has room for)


class _Parser(argparse.ArgumentParser):
    """A parser whose errors are one line naming the problem, not the usage (40 lines with
    the engine flags)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the flags)\n")


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens,
                   help="tokens to generate at most (default: %(default)s; SamplingParams' default is 16)")
    p.add_argument("--temperature", type=float, default=CLI_TEMPERATURE,
                   help="0 = greedy (default: %(default)s; SamplingParams' default is 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, 1 = off (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=-1, help="-1 or 0 = off (default: %(default)s)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off (default: %(default)s)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2], 0 = off (default: %(default)s)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2], 0 = off (default: %(default)s)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end the output where this text appears (not printed); repeat for several")
    p.add_argument("--system", default=None, help="a system prompt (generate: implies --chat)")
    add_engine_args(p)


def _sampling_params(args: argparse.Namespace) -> Any:
    from infer.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, max_tokens=args.max_tokens, stop=args.stop)


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default="def fibonacci(n):",
                   help="prompt text, '-' to read it from stdin (default: %(default)r)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    _sampling_args(p, CLI_MAX_TOKENS)
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    from infer.engine.batch_size import engine_sizes
    from infer.engine.engine import Engine
    from infer.engine.loading import load_tokenizer, model_sources, resolve_device
    from infer.streaming import rate_summary, stream_request

    # everything the flags can get wrong fails here, before the weights load
    params = _sampling_params(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    config = engine_config_from_args(args)
    tok = load_tokenizer(config.tokenizer or model_sources(config)[0])
    if tok is None:
        raise ValueError("this model has no tokenizer; use `infer bench` for tokenizer-less dummy shapes")
    chat = args.chat or args.system is not None
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    ids = tok.encode_chat([*system, {"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
    # the context length (default: the model's), from config files
    max_seq_len = engine_sizes(config, resolve_device(config.device)).max_seq_len
    if len(ids) + params.max_tokens > max_seq_len:
        raise ValueError(f"the prompt ({len(ids)} tokens) + --max-tokens ({params.max_tokens}) exceeds "
                         f"--max-seq-len {max_seq_len}: shorten the prompt, lower --max-tokens or raise "
                         "--max-seq-len (up to the model's context)")
    engine = Engine(config)
    # sampling is seeded by the engine's --seed (default 0): the same command gives the same text
    request = engine.add_request(ids, params)  # (the model's own context limit is checked here)
    if not chat:
        sys.stdout.write(prompt)
    out = stream_request(engine, request, sys.stdout)
    print("\n\n" + rate_summary(out.num_tokens, out.start, out.first, out.end)
          + f", finish: {request.finish_reason.value}" + _extra(request, engine.threads) + "]")
    engine.close()
    return 0


def _extra(request: Any, threads: int | None) -> str:
    summary = ""
    if request.mean_acceptance_rate() is not None:
        summary += (f", acceptance {request.mean_acceptance_rate():.2f}, "
                    f"{request.mean_accepted_length():.2f} tokens/round")
    return summary + (f", {threads} CPU thread(s)" if threads else "")


def _chat_args(p: argparse.ArgumentParser) -> None:
    _sampling_args(p, CHAT_MAX_TOKENS)
    p.set_defaults(func=_cmd_chat)


def _cmd_chat(args: argparse.Namespace) -> int:
    from infer.chat import Chat, run_chat
    from infer.engine.engine import Engine

    params = _sampling_params(args)
    config = engine_config_from_args(args)
    engine = Engine(config)
    try:
        if engine.tokenizer is None:
            raise ValueError("this model has no tokenizer to chat with; use `infer bench` for dummy shapes")
        return run_chat(Chat(engine, engine.tokenizer, params, args.system), sys.stdin, sys.stdout)
    finally:
        engine.close()


def _serve_args(p: argparse.ArgumentParser) -> None:
    from infer.server.__main__ import add_server_args

    add_server_args(p)
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from infer.server.__main__ import serve

    return serve(args)


def _draft_vocab_args(p: argparse.ArgumentParser) -> None:
    from infer.draft_table import add_args

    add_args(p)


Command = tuple[str, Callable[[argparse.ArgumentParser], None]]  # (help text, adds the command's flags)
COMMAND_GROUP = "infer.commands"  # entry points of installed packages adding a Command (`infer bench`)

COMMANDS: dict[str, Command] = {  # and all_commands()
    "generate": ("complete one prompt, streaming text to the terminal", _generate_args),
    "chat": ("an interactive chat in the terminal (/clear, /exit), streaming each answer", _chat_args),
    "serve": ("OpenAI-compatible HTTP server (needs the server extra)", _serve_args),
    "draft-vocab": ("build a reduced draft vocabulary: the target's N most frequent tokens over a corpus",
                    _draft_vocab_args),
}


def all_commands() -> dict[str, Command]:
    """COMMANDS and the commands installed packages add under COMMAND_GROUP."""
    from importlib.metadata import entry_points

    return {**COMMANDS, **{ep.name: ep.load() for ep in entry_points(group=COMMAND_GROUP)}}


def build_parser(argv: list[str], commands: dict[str, Command] | None = None) -> argparse.ArgumentParser:
    """The parser, with flags only for the command named in `argv` (if any)."""
    parser = _Parser(prog="infer", description=__doc__,
                     epilog="`infer COMMAND --help` lists a command's flags and their defaults")
    parser.add_argument("--version", action="version", version=f"infer {__version__} ({DISTRIBUTION})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (help_text, add_args) in (all_commands() if commands is None else commands).items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            add_args(p)
    return parser


TORCHRUN_COMMANDS = ("generate", "serve")  # the commands a torchrun launch can split over ranks


def main(argv: list[str] | None = None, commands: dict[str, Command] | None = None) -> int:
    argv = dash_flags(sys.argv[1:] if argv is None else list(argv))
    args, unknown = build_parser(argv, commands).parse_known_args(argv)
    if unknown:
        prog = f"infer {args.command}"
        print(f"{prog}: error: unrecognized arguments: {' '.join(unknown)} (`{prog} --help` lists the flags)",
              file=sys.stderr)
        return 2
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
