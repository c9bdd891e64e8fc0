"""The ``devin-compile`` command line: one module per subcommand (run, serve, chat, dump, quantize, cache).

Each subcommand module has ``HELP`` (one line), ``DESCRIPTION`` (its --help text),
``add_arguments(parser)``, which also sets the function that runs it, and that function.
Only the chosen subcommand's arguments are registered, and torch/transformers are imported
inside the subcommands, so ``devin-compile --help`` answers at once. Every argument is
checked before a model is loaded; a bad one ends with ``devin-compile: error: ...`` (exit 2).
The library's log (logger ``devin_compile``, INFO and up) is shown on stderr (:mod:`.logs`).
"""
from __future__ import annotations

import argparse
import logging
import sys

from . import cache, chat, dump, quantize, run, serve
from .logs import show_library_log

DESCRIPTION = "Compile a Hugging Face causal LM into a paged-KV engine and use it."
EPILOG = 'Run "devin-compile COMMAND --help" for the options of a command.'

COMMANDS = {"run": run, "serve": serve, "chat": chat, "dump": dump, "quantize": quantize, "cache": cache}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``command`` set, only that subcommand gets its arguments (the others are
    listed by name and help alone), with ``""`` none does."""
    ap = argparse.ArgumentParser(prog="devin-compile", description=DESCRIPTION, epilog=EPILOG)
    ap.add_argument("-q", "--quiet", action="store_true",
                    help="no progress lines from the library (capture, passes, kernel builds); "
                         "warnings and errors still show")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND", help="what to do")
    for name, module in COMMANDS.items():
        p = sub.add_parser(name, help=module.HELP, description=module.DESCRIPTION)
        if command is None or command == name:
            module.add_arguments(p)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), "")  # -q/--quiet come before it
    args = build_parser(command).parse_args(argv)
    args.argv = argv  # --tensor-parallel relaunches the same command line as each rank (cli/launch.py)
    show_library_log(logging.WARNING if args.quiet else logging.INFO)  # progress: INFO and up on stderr
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"devin-compile: error: {e}", file=sys.stderr)
        return 2
