"""Why GPTQ over-fits its calibration text: layer-wise output error on held-out text.

    python bench/gptq_generalisation.py [--layers 0 7 14 21 29] [--chunks 8] [--out bench/results/gptq-generalisation.json]

For a subset of SmolLM2's decoder layers (all 7 linears each), quantize with GPTQ / AWQ-style
clipping under several option sets from one calibration's Hessian ``H_c``, and measure each
result's output error ``tr(ΔW H ΔWᵀ)`` on the calibration text (``H_c``) and on held-out text
(``H_h``: licences, Debian changelogs, CMake docs; bench/quant_domains.py's domains), both
relative to plain RTN's error on the same text. A method that fits the calibration's
activation correlations and not the weights shows a low calibration ratio and a high held-out
one. Calibrations: tinyshakespeare's start (what the project used) and the shipped mix.
Cheap: forward passes only (no output gradients) and a handful of layers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from devin_compile.backends.int4 import format as fmt  # noqa: E402
from devin_compile.models import load_model  # noqa: E402
from devin_compile.quant import awq, gptq  # noqa: E402
from devin_compile.quant.calibration import CalibrationStats, collect_stats  # noqa: E402
from devin_compile.quant.corpus import interleave, load_token_stream, token_chunks  # noqa: E402

from quant_domains import SHAKESPEARE, domain_sources  # noqa: E402

VARIANTS = {
    "old default: damp 0.01, act-order, clip grid": dict(damp=0.01, act_order=True, clip=True),
    "damp 0.1, act-order, clip grid": dict(damp=0.1, act_order=True, clip=True),
    "damp 0.01, act-order, no clip": dict(damp=0.01, act_order=True, clip=False),
    "damp 0.1, act-order, no clip": dict(damp=0.1, act_order=True, clip=False),
    "damp 0.01, natural order, no clip": dict(damp=0.01, act_order=False, clip=False),
    "damp 0.1, natural order, no clip": dict(damp=0.1, act_order=False, clip=False),
    "clip grid only (no GPTQ)": dict(clip_only=True),
}


def quantize(w, h, g, damp=0.01, act_order=True, clip=True, clip_only=False, shrink=0.0):
    if shrink:  # shrink the Hessian towards its diagonal (keeps per-channel scales, drops correlations)
        h = (1 - shrink) * h + shrink * torch.diag(torch.diag(h))
    if clip_only:
        sc, mn = awq.clip_search(w, h, g)
        return fmt.dequantize(fmt.quantize_with(w, sc, mn, g), sc, mn, g)
    grid = awq.clip_search(w, h, g) if clip else None
    q, sc, mn, _ = gptq.gptq_quantize(w, h, g, damp=damp, act_order=act_order, grid=grid)
    return fmt.dequantize(q, sc, mn, g)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 7, 14, 21, 29])
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--calibs", nargs="+", default=["shakespeare", "shipped mix"], choices=["shakespeare", "shipped mix"])
    ap.add_argument("--variants", nargs="*", default=None, help="option dicts (JSON) instead of the built-in list")
    ap.add_argument("--cache", default=None, metavar="DIR", help="keep the statistics here and reuse them")
    ap.add_argument("--out", default="bench/results/gptq-generalisation.json")
    args = ap.parse_args()
    model, tok = load_model(None, torch.float32)
    t0 = time.perf_counter()
    held_files = {k: v for k, v in domain_sources(Path(tempfile.mkdtemp())).items() if k != "shakespeare"}
    # 2 x 512 tokens from the end of each held-out domain (the slices bench/quant_domains.py evaluates on)
    held = interleave([torch.cat(token_chunks(load_token_stream(tok, f), 2, 512, from_end=True))
                       for f in held_files.values()])
    calibs = {"shakespeare": str(SHAKESPEARE), "shipped mix": None}

    def cached(name, chunks_fn):
        path = Path(args.cache) / name.replace(" ", "-") if args.cache else None
        if path is not None and path.exists():
            return CalibrationStats.load(path)
        st = collect_stats(model, chunks_fn(), progress=False, fisher=False)
        if path is not None:
            st.save(path)
        return st

    hs = cached("held-out", lambda: token_chunks(held, held.numel() // 512, 512))
    stats = {name: cached(f"{name}-{args.chunks}", lambda d=calibs[name]: token_chunks(load_token_stream(tok, d),
                                                                                   args.chunks, 512))
             for name in args.calibs}
    variants = VARIANTS if args.variants is None else {v: json.loads(v) for v in args.variants}
    print(f"statistics in {time.perf_counter() - t0:.0f} s ({hs.tokens} held-out tokens)", flush=True)
    want = {n for n in hs.linear_input if any(f"layers.{i}." in n for i in args.layers)}
    params = dict(model.named_modules())
    out = {"layers": args.layers, "chunks": args.chunks, "held_out_tokens": hs.tokens, "rows": []}
    for cname, st in stats.items():
        for vname, opts in variants.items():
            t1 = time.perf_counter()
            tot = {"calib": 0.0, "calib_rtn": 0.0, "held": 0.0, "held_rtn": 0.0}
            for n in sorted(want):
                w = params[n].weight.detach().float()
                g = fmt.choose_group_size(w.shape[1], args.group_size)[0]
                hc, hh = st.hessian[st.linear_input[n]].float(), hs.hessian[hs.linear_input[n]].float()
                q, sc, mn = fmt.rtn_quantize(w, g)
                d_rtn = fmt.dequantize(q, sc, mn, g) - w
                d = quantize(w, hc, g, **opts) - w
                tot["calib"] += float(awq.output_error(d, hc).sum())
                tot["calib_rtn"] += float(awq.output_error(d_rtn, hc).sum())
                tot["held"] += float(awq.output_error(d, hh).sum())
                tot["held_rtn"] += float(awq.output_error(d_rtn, hh).sum())
            row = {"calibration": cname, "variant": vname, "options": opts,
                   "calib_error_vs_rtn": tot["calib"] / tot["calib_rtn"],
                   "held_out_error_vs_rtn": tot["held"] / tot["held_rtn"], "seconds": time.perf_counter() - t1}
            out["rows"].append(row)
            print(f"{cname:12} {vname:40} calib {row['calib_error_vs_rtn']:.3f}  held-out "
                  f"{row['held_out_error_vs_rtn']:.3f}  ({row['seconds']:.0f} s)", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
