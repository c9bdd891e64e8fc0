"""``devin-compile quantize calibrate | run | validate`` (see :mod:`devin_compile.quant`)."""
from __future__ import annotations

import json
import time
from pathlib import Path


def _progress(console, label: str):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                    transient=False)


def cmd_calibrate(args, load, console) -> int:
    from . import calibration

    model, tok = load(args, console)
    stream = calibration.load_token_stream(tok, args.data)
    chunks = calibration.token_chunks(stream, args.chunks, args.chunk_len)
    with _progress(console, f"calibrating on {args.chunks} x {args.chunk_len} tokens") as prog:
        task = prog.add_task("calib", total=len(chunks))
        stats = calibration.collect_stats(model, chunks, data=str(args.data or "tinyshakespeare (default)"),
                                          progress=lambda i, n: prog.update(task, completed=i),
                                          fisher=not args.no_output_gradients)
    stats.save(args.out)
    grads = ", output gradients" if stats.fisher else ", no output gradients"
    console.print(f"calibration statistics of {len(stats.linear_input)} linears ({len(stats.hessian)} distinct inputs"
                  f"{grads}, {stats.tokens} tokens) in {stats.seconds:.1f} s → {args.out}")
    return 0


def cmd_run(args, load, console) -> int:
    from . import artifact
    from .calibration import CalibrationStats, quantizable_linears
    from .quantize import QuantConfig, quantize_model

    cfg = QuantConfig(method=args.method, bits=args.bits, group_size=args.group_size, target=args.target,
                      act_order=not args.no_act_order, clip=not args.no_clip, damp=args.damp, lm_head=args.lm_head)
    model, _tok = load(args, console)
    stats = CalibrationStats.load(args.calib, model)
    with _progress(console, f"{cfg.method} INT4 g{cfg.group_size}") as prog:
        task = prog.add_task("quant", total=len(quantizable_linears(model, cfg.lm_head)))
        result = quantize_model(model, stats, cfg, progress=lambda i, n, name: prog.update(task, completed=i))
    if cfg.target["kind"] == "max_kl":
        from . import resolve_target
        from .calibration import load_token_stream, token_chunks

        with console.status(f"resolving target max_kl={cfg.target['value']} on calibration text ..."):
            chunks = token_chunks(load_token_stream(_tok, stats.data if Path(stats.data).exists() else None),
                                  min(2, stats.num_chunks), stats.chunk_len)
            resolve_target(model, result, cfg, chunks)
    artifact.save(result, args.out)
    console.print(f"quantized {len(result.linears)} linears with {cfg.method} in {result.seconds:.1f} s → {args.out}")
    for note in result.notes:
        console.print(f"  note: {note}")
    return 0


def validation_markdown(rep: dict) -> str:
    from ..passes.assign_precision import precision_table_markdown

    q = rep["quality"]
    lines = [f"# Validation of {rep['quantized']}", "",
             f"{rep['chunks']} chunks of {rep['chunk_len']} tokens ({q['tokens']} predicted tokens)", "",
             "| metric | value |", "|---|---:|",
             f"| perplexity, unquantized | {q['ppl_ref']:.3f} |",
             f"| perplexity, quantized | {q['ppl']:.3f} |",
             f"| perplexity increase | {q['ppl_increase']:+.2%} |",
             f"| KL(ref ‖ quant), mean per token | {q['kl']:.4f} |",
             f"| top-1 agreement | {q['top1']:.2%} |",
             f"| decoder-linear weight bytes | {rep['int4_bytes_total']} (vs {rep['fp_bytes_total']} unquantized) |",
             "", rep["pass_note"], "", precision_table_markdown(rep["layers"])]
    return "\n".join(lines)


def cmd_validate(args, load, console) -> int:
    from rich.markdown import Markdown

    from . import validate

    model, tok = load(args, console)
    t0 = time.perf_counter()
    with console.status(f"evaluating {args.chunks} x {args.chunk_len} tokens, quantized vs unquantized ..."):
        rep = validate(model, tok, args.quantized, data=args.data, num_chunks=args.chunks, chunk_len=args.chunk_len)
    rep["seconds"] = time.perf_counter() - t0
    md = validation_markdown(rep)
    console.print(Markdown(md))
    out = Path(args.report_dir or args.quantized)
    out.mkdir(parents=True, exist_ok=True)
    (out / "validate.json").write_text(json.dumps(rep, indent=1))
    (out / "validate.md").write_text(md + "\n")
    console.print(f"wrote {out / 'validate.json'} and {out / 'validate.md'}")
    return 0


def add_parser(sub, common, load) -> None:
    """Register ``quantize`` and its three stages on the top-level subparsers."""
    from ..backends.int4.format import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES
    from .quantize import METHODS

    qp = sub.add_parser("quantize", help="weight-only INT4: calibrate → run → validate")
    qs = qp.add_subparsers(dest="stage", required=True)

    def data_args(p, chunks: int):
        p.add_argument("--data", default=None, help="text file (default: ../shared/data/tinyshakespeare.txt)")
        p.add_argument("--chunks", type=int, default=chunks, help=f"number of token chunks (default {chunks})")
        p.add_argument("--chunk-len", type=int, default=512, help="tokens per chunk (default 512)")

    c = qs.add_parser("calibrate", help="collect activation statistics / Hessians on real text (start of --data)")
    common(c)
    data_args(c, 16)
    c.add_argument("--out", required=True, help="directory for stats.safetensors + calib.json")
    c.add_argument("--no-output-gradients", action="store_true",
                   help="skip the backward pass that gathers output-gradient statistics (mixed precision then ranks "
                        "linears by relative output error instead of estimated loss increase)")
    c.set_defaults(fn=lambda a: _run(cmd_calibrate, a, load))

    r = qs.add_parser("run", help="quantize from calibration statistics; writes safetensors + JSON")
    common(r)
    r.add_argument("--calib", required=True, help="directory written by `quantize calibrate`")
    r.add_argument("--method", default="awq", help=f"one of {list(METHODS)} (default awq)")
    r.add_argument("--bits", type=int, default=4, help=f"one of {list(SUPPORTED_BITS)}")
    r.add_argument("--group-size", type=int, default=64, help=f"one of {list(SUPPORTED_GROUP_SIZES)} (default 64)")
    r.add_argument("--target", default="all", help="all | keep_fp=N | int4_fraction=F | memory_bytes=B | "
                   "memory_fraction=F | max_kl=X | keep=NAME,NAME (default all)")
    r.add_argument("--no-act-order", action="store_true",
                   help="GPTQ: columns in their natural order (default: by decreasing Hessian diagonal)")
    r.add_argument("--no-clip", action="store_true", help="skip the clipping search (AWQ) / static clipped grid (GPTQ)")
    r.add_argument("--damp", type=float, default=0.01, help="GPTQ dampening, fraction of mean(diag H)")
    r.add_argument("--lm-head", action="store_true",
                   help="also quantize the output head (a tied embedding keeps its model-dtype weight)")
    r.add_argument("--out", required=True, help="directory for quantized.safetensors + quant_config.json")
    r.set_defaults(fn=lambda a: _run(cmd_run, a, load))

    v = qs.add_parser("validate", help="perplexity, KL, top-1, bytes, per-layer table (end of --data)")
    common(v)
    data_args(v, 16)
    v.add_argument("--quantized", required=True, help="directory written by `quantize run`")
    v.add_argument("--report-dir", default=None, help="where validate.json/.md go (default: --quantized)")
    v.set_defaults(fn=lambda a: _run(cmd_validate, a, load))


def _run(fn, args, load) -> int:
    from .. import cli

    return fn(args, load, cli._console())
