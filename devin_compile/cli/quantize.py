"""``devin-compile quantize calibrate | run | validate``: weight-only INT4 and FP8 (see devin_compile.quant)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from . import common
from .progress import Bars

HELP = "weight-only INT4 / FP8: calibrate, then run (quantize), then validate"
DESCRIPTION = ("Weight-only INT4 in three stages: calibrate (activation statistics on real text), run (quantize "
               "with RTN, AWQ or GPTQ; writes an artifact that optimize(quantized=DIR) loads), validate "
               "(perplexity, KL and top-1 against the unquantized model). Run \"devin-compile quantize STAGE "
               "--help\" for the options of a stage.")
TARGET_HELP = ("which linears become INT4: all | keep_fp=N | int4_fraction=F | memory_bytes=B | memory_fraction=F | "
               "max_kl=X | keep=NAME,NAME (default all)")


def add_arguments(p) -> None:
    """Register the three stages under ``quantize``."""
    stages = p.add_subparsers(dest="stage", required=True, metavar="STAGE", help="the stage to run")

    def stage(name: str, text: str):
        return stages.add_parser(name, help=text, description=text)

    _add_calibrate_arguments(stage("calibrate", "collect activation statistics and Hessians on real text (start of "
                                                "--data)"))
    _add_run_arguments(stage("run", "quantize from calibration statistics (--calib, or collected now); writes "
                                    "safetensors + JSON"))
    _add_validate_arguments(stage("validate", "perplexity, KL, top-1, bytes and per-layer table (end of --data)"))


def _add_data_arguments(s, chunks: int) -> None:
    """``--quiet`` and the text options (``--data``, ``--chunks``, ``--chunk-len``) of calibrate and validate."""
    s.add_argument("--quiet", action="store_true", help="no progress (bars on a terminal, else log lines)")
    s.add_argument("--data", default=None, nargs="+", metavar="PATH",
                   help="text files and/or folders of text files (default: the calibration set shipped in "
                        "the package: prose, dialogue, technical docs, code, markup, five languages)")
    s.add_argument("--chunks", type=common.int_at_least(1), default=chunks, metavar="N",
                   help=f"number of token chunks (default {chunks})")
    s.add_argument("--chunk-len", type=common.int_at_least(2), default=512, metavar="N",
                   help="tokens per chunk (default 512)")


def _add_calibrate_arguments(c) -> None:
    common.add_model_arguments(c, uses_attention=False)
    _add_data_arguments(c, 16)
    c.add_argument("--out", required=True, metavar="DIR",
                   help="directory for stats.safetensors + calib.json; an interrupted run leaves a checkpoint there "
                        "that the same command resumes from")
    c.add_argument("--no-output-gradients", action="store_true",
                   help="skip the backward pass that gathers output-gradient statistics (mixed precision then ranks "
                        "linears by relative output error instead of estimated loss increase)")
    c.set_defaults(fn=calibrate)


def _add_run_arguments(r) -> None:
    common.add_model_arguments(r, uses_attention=False)
    r.add_argument("--calib", default=None, metavar="DIR",
                   help="directory written by \"devin-compile quantize calibrate\" (default: calibrate now as that "
                        "does by default, on 16 x 512 tokens of the shipped set, without saving the statistics)")
    r.add_argument("--method", default="awq", help="rtn, awq or gptq (default awq)")
    r.add_argument("--bits", type=int, default=4, help="bits per weight (4)")
    r.add_argument("--group-size", type=int, default=64, metavar="G",
                   help="weights sharing one scale and minimum: 32, 64 or 128 (default 64)")
    r.add_argument("--target", default="all", help=TARGET_HELP)
    r.add_argument("--tiers", default="int4", metavar="T[,T]",
                   help="precisions below the model dtype a linear may take: int4, fp8 or int4,fp8 (FP8: e4m3 with "
                        "per-row scales, stored alongside INT4; byte-budget targets pick a tier per linear)")
    r.add_argument("--memory-fraction", type=float, default=None, metavar="F",
                   help="shorthand for --target memory_fraction=F: decoder-linear bytes at most F times the model "
                        "dtype's, the least-loss mix of --tiers and the model dtype")
    r.add_argument("--no-act-order", action="store_true",
                   help="GPTQ: columns in their natural order (default: by decreasing Hessian diagonal)")
    r.add_argument("--no-clip", action="store_true", help="skip the clipping search (AWQ) / static clipped grid (GPTQ)")
    r.add_argument("--damp", type=float, default=None,
                   help="GPTQ dampening, a fraction of mean(diag H) (default 0.1)")
    r.add_argument("--loss-weight", type=float, default=None,
                   help="weight of the gradient-weighted Hessian in GPTQ's/AWQ's objective (default 2; 0: "
                        "the activation Hessian alone)")
    r.add_argument("--anchors", type=int, default=None,
                   help="input channels per linear whose weights the INT4 grid keeps exact (default 0: off)")
    r.add_argument("--refits", type=int, default=None,
                   help="GPTQ/AWQ: rounds of least-squares refits of every group's scale and min to its codes "
                        "(GPTQ re-runs on each refitted grid but the last, AWQ re-rounds on it; default 2; 0: off)")
    r.add_argument("--per-linear", default=None, metavar="JSON",
                   help="per-linear overrides of --damp/--loss-weight/--anchors/--refits/act_order/clip as a JSON "
                        "object {regex on linear names: {option: value}}, first match wins (default: GPTQ rounds "
                        "the MLP input projections with loss_weight 0 and damp 0.5; '{}': none)")
    r.add_argument("--lm-head", nargs="?", const="int4", default="int8", choices=("int8", "int4", "none"),
                   help="the output head's precision: int8 (default: one scale a row, near lossless), int4 (like "
                        "the decoder linears; the bare flag), none (kept in the model dtype); a tied embedding "
                        "reads a quantized head's rows")
    r.add_argument("--out", required=True, metavar="DIR",
                   help="directory for quantized.safetensors + quant_config.json")
    r.add_argument("--quiet", action="store_true", help="no progress (bars on a terminal, else log lines)")
    r.set_defaults(fn=quantize)


def _add_validate_arguments(v) -> None:
    common.add_model_arguments(v)
    _add_data_arguments(v, 16)
    v.add_argument("--quantized", required=True, metavar="DIR",
                   help="directory written by \"devin-compile quantize run\"")
    v.add_argument("--report-dir", default=None, metavar="DIR",
                   help="where validate.json/.md go (default: the --quantized directory)")
    v.set_defaults(fn=validate)


def _check_data(args) -> None:
    for d in args.data or []:
        if not os.path.exists(d):
            raise FileNotFoundError(f"--data {d} does not exist (give text files or folders of text files)")


def calibrate(args) -> int:
    _check_data(args)
    common.check_options(args)
    from ..quant import calibration, corpus

    con = common.console()
    model, tok = common.load(args, con)
    stream = calibration.load_token_stream(tok, args.data)
    chunks = calibration.token_chunks(stream, args.chunks, args.chunk_len)
    with Bars(con, args.quiet) as bars:
        stats = calibration.collect_stats(model, chunks, data=corpus.data_label(args.data), progress=bars.progress,
                                          fisher=not args.no_output_gradients, checkpoint_dir=args.out)
    size = stats.save(args.out)
    grads = ", output gradients" if stats.fisher else ", no output gradients"
    con.print(f"calibration statistics of {len(stats.linear_input)} linears ({len(stats.hessian)} distinct inputs"
              f"{grads}, {stats.tokens} tokens) in {stats.seconds:.1f} s → {args.out} ({calibration.STATS_FILE}: "
              f"{size} bytes, {size / 1e6:.1f} MB)")
    return 0


def quantize(args) -> int:
    from ..quant import QuantConfig, artifact, quantize_model, resolve_target
    from ..quant.calibration_stats import META_FILE, STATS_FILE, CalibrationStats
    from ..quant.corpus import data_from_label, load_token_stream, token_chunks

    target = args.target
    if args.memory_fraction is not None:
        if target != "all":
            raise ValueError(f"--memory-fraction {args.memory_fraction} and --target {target} both set the target: "
                             "give one")
        target = {"memory_fraction": args.memory_fraction}
    cfg = QuantConfig(method=args.method, bits=args.bits, group_size=args.group_size, target=target,
                      tiers=args.tiers, act_order=not args.no_act_order, clip=not args.no_clip, lm_head=False if args.lm_head == "none" else args.lm_head,
                      **{k: v for k, v in (("damp", args.damp), ("loss_weight", args.loss_weight),
                                           ("anchors", args.anchors), ("refits", args.refits),
                                           ("per_linear", _json_option(args.per_linear, "--per-linear")))
                         if v is not None})
    calib = None if args.calib is None else Path(args.calib)
    if calib is not None and not ((calib / META_FILE).is_file() and (calib / STATS_FILE).is_file()):
        raise FileNotFoundError(f"--calib {calib} is not a calibration directory (needs {META_FILE} and {STATS_FILE}; "
                                "make one with `devin-compile quantize calibrate`)")
    common.check_options(args)
    con = common.console()
    model, tok = common.load(args, con)
    with Bars(con, args.quiet) as bars:
        stats = CalibrationStats.load(calib, model) if calib is not None else _calibrate_now(model, tok, bars.progress)
        result = quantize_model(model, stats, cfg, progress=bars.progress)
    if cfg.target["kind"] == "max_kl":
        with common.stage(con, f"resolving target max_kl={cfg.target['value']} on calibration text ..."):
            chunks = token_chunks(load_token_stream(tok, data_from_label(stats.data)),
                                  min(2, stats.num_chunks), stats.chunk_len)
            resolve_target(model, result, cfg, chunks)
    artifact.save(result, args.out)
    tiers = "+".join(t.upper() for t in cfg.tiers)
    con.print(f"quantized {len(result.linears)} linears with {cfg.method} ({tiers}) in {result.seconds:.1f} s → {args.out}")
    for note in result.notes:
        con.print(f"  note: {note}")
    return 0


def _calibrate_now(model, tok, progress):
    """What `quantize calibrate` collects by default (the shipped set, output gradients), kept in memory."""
    from ..quant import QuantConfig
    from ..quant.calibration import collect_stats
    from ..quant.corpus import data_label, load_token_stream, token_chunks

    defaults = QuantConfig()
    chunks = token_chunks(load_token_stream(tok, None), defaults.calib_chunks, defaults.calib_len)
    return collect_stats(model, chunks, data=data_label(None), progress=progress)


def validation_markdown(rep: dict) -> str:
    """The report of :func:`devin_compile.quant.validate` as markdown (the metrics, then the per-layer table)."""
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
             f"| top-1, standard error over chunks | {q['top1_chunk_se']:.2%} |",
             f"| weight bytes of the table's linears (decoder linears, output head) | {rep['int4_bytes_total']} (vs "
             f"{rep['fp_bytes_total']} unquantized) |",
             "| linears per precision | " + ", ".join(f"{p} {n}" for p, n in rep.get("precision_counts", {}).items())
             + " |",
             "", rep["pass_note"], "", precision_table_markdown(rep["layers"])]
    return "\n".join(lines)


def validate(args) -> int:
    _check_data(args)
    if not os.path.isdir(args.quantized):
        raise FileNotFoundError(f"--quantized {args.quantized} is not a directory (write one with "
                                "`devin-compile quantize run --out DIR`)")
    options = common.check_options(args)
    from ..api import optimize
    from ..quant import validate as validate_artifact

    con = common.console()
    model, tok = common.load(args, con)
    t0 = time.perf_counter()
    with Bars(con, args.quiet) as bars:
        rep = validate_artifact(model, tok, args.quantized, optimize=optimize, data=args.data, num_chunks=args.chunks,
                                chunk_len=args.chunk_len, progress=bars.progress, **options)
    rep["seconds"] = time.perf_counter() - t0
    md = validation_markdown(rep)
    common.print_markdown(con, md)
    out = Path(args.report_dir or args.quantized)
    out.mkdir(parents=True, exist_ok=True)
    (out / "validate.json").write_text(json.dumps(rep, indent=1))
    (out / "validate.md").write_text(md + "\n")
    con.print(f"wrote {out / 'validate.json'} and {out / 'validate.md'}")
    return 0


def _json_option(text: str | None, flag: str):
    """A JSON command-line value (None when the flag is absent); malformed JSON is a ``ValueError`` naming it."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} {text!r} is not valid JSON ({e}); e.g. {flag} '{{\"up_proj$\": {{\"damp\": 0.5}}}}'") from None
