"""Command line: `specdecode fetch|generate|chat|bench|serve|train-head ...`.

Each subcommand lives in its own module with its `add_*_parser` (which sets the `func` that runs it); this module
builds the top-level parser from them, applies `--threads`, sets up logging and turns the user's errors into
messages.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from specdecode import __version__
from specdecode.bench.cli import add_bench_parser
from specdecode.chat_cli import add_chat_parser
from specdecode.cli_args import apply_threads
from specdecode.fetch import KNOWN_MODELS, FetchError, fetch_model
from specdecode.generate_cli import add_generate_parser
from specdecode.log import cli_logging, verbosity_level
from specdecode.serve_cli import add_serve_parser
from specdecode.train_cli import add_train_head_parser


def _add_verbosity_args(p: argparse.ArgumentParser, default: Any) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("-v", "--verbose", action="count", default=default,
                       help="also log quick steps with their times (DEBUG); long steps are logged by default "
                            "(serve: --log-level)")
    group.add_argument("-q", "--quiet", action="store_true", default=default, help="log warnings and errors only")


def _add_fetch_parser(sub: argparse._SubParsersAction) -> None:
    f = sub.add_parser("fetch", help="download and verify a known model (or a Hugging Face GGUF) into the cache")
    f.add_argument("name", help=f"one of: {', '.join(KNOWN_MODELS)}; or a Hugging Face id such as ORG/NAME:Q4_K_M")
    f.set_defaults(func=_run_fetch_command)


def _run_fetch_command(args: argparse.Namespace) -> int:
    print(fetch_model(args.name))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description="Speculative decoding inference engine")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_verbosity_args(parser, default=None)
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser in (_add_fetch_parser, add_generate_parser, add_chat_parser, add_bench_parser, add_serve_parser,
                       add_train_head_parser):
        add_parser(sub)
    for name, command in sub.choices.items():  # also after the command: `specdecode generate -v ...`
        if name != "serve":  # the server has --log-level
            _add_verbosity_args(command, default=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":  # the server configures logging itself (--log-level)
        return _run(args)
    with cli_logging(verbosity_level(args.verbose or 0, bool(args.quiet))):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if hasattr(args, "threads"):  # the commands that run a model; set before any model loads
        apply_threads(args.threads)
    try:
        return args.func(args)
    except (ValueError, FetchError, MemoryError, OSError) as exc:
        # Bad input and environment problems are the user's to fix: a message, not a traceback.
        print(f"specdecode: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdecode: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
