"""INT4 quality on text the calibration never saw: perplexity change per held-out domain.

    python bench/quant_domains.py [--calib shipped|shakespeare ...] [--methods rtn awq gptq] [--group-size 64]
                                  [--lm-heads int8 int4 none]
                                  [--eval-chunks 4] [--domains legal ...] [--variants '{"damp": 0.1}' ...] [--out bench/results/quant-domains.json]
    python bench/quant_domains.py --three-tier --methods gptq awq [--memory-fraction 0.5] [--eval-chunks 2]
                                  [--out bench/results/quant-three-tier.json]

SmolLM2-135M-Instruct (real weights, fp32). Calibration: 16 x 512 tokens of the set shipped
in the package (``shipped``, the default) or, for comparison, of tinyshakespeare's start
(``shakespeare``: what the project calibrated on before, with GPTQ's old dampening 0.01). Evaluation: ``--eval-chunks`` x 512
tokens from the end of each domain's text, all of it kept out of the shipped calibration set:

- ``shakespeare``: the end of ../shared/data/tinyshakespeare.txt (in-domain for ``shakespeare``
  calibration; the shipped set holds only the file's first 40 KB);
- ``legal``: /usr/share/common-licenses GPL-3, Apache-2.0, MPL-2.0;
- ``changelog``: Debian changelogs of a dozen packages (/usr/share/doc/*/changelog.Debian.gz);
- ``build-docs``: CMake's reference manual (/usr/share/cmake-*/Help/manual/*.rst).

For each calibration, method and output-head precision (``--lm-heads``: the default INT8 head, an INT4
one, or ``none``, kept in fp32) at ``--group-size``: perplexity increase against the
unquantized model, KL(ref ‖ quant) over the vocabulary and top-1 agreement per domain, and
their mean over legal, changelog and build-docs (genres neither calibration holds; those ``--domains`` keeps). Then mixed precision at
``int4_fraction=0.8`` on the GPTQ result: the linears ``assign_precision`` keeps by estimated
loss increase, against a sensitivity-blind choice of the same fp32 share (evenly spaced).
Models are the eager simulation of the compiled model (``quant.simulate``: the same
dequantized weights; tests/test_quant.py and tests/test_fp8.py check the two agree).

``--three-tier``: each of ``--methods`` (shipped calibration) with the FP8 tier too, and at a byte budget of
``--memory-fraction`` (default 0.5) of the decoder linears' bf16 bytes (0.5: one byte a weight, what
all-INT8 would take) the least-estimated-loss mix of INT4 + FP8 + bf16 against the least-loss mix
of INT4 + bf16 in the same bytes (both ``quant.choose_tiers``, the knapsack ``assign_precision``
runs), with all-INT4, all-FP8 (just over the budget: its row scales) and the knapsack's choice at
all-FP8's bytes for reference; bytes are counted as a bf16 model stores them, the simulation runs in fp32.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from glob import glob
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from devin_compile import quant  # noqa: E402
from devin_compile.models import load_model  # noqa: E402
from devin_compile.backends.fp8.format import fp8_bytes  # noqa: E402
from devin_compile.backends.int4.format import int4_bytes  # noqa: E402
from devin_compile.quant.precision import Candidate, choose_int4, choose_tiers  # noqa: E402
from devin_compile.quant.calibration import collect_stats  # noqa: E402
from devin_compile.quant.corpus import load_token_stream, token_chunks  # noqa: E402
from devin_compile.quant.evaluate import compare, hf_logits_fn, reference_logits  # noqa: E402
from devin_compile.quant.result import sensitivity  # noqa: E402

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
CHANGELOG_PACKAGES = ("bash", "coreutils", "apt", "dpkg", "tar", "gzip", "grep", "sed", "findutils", "openssl",
                      "git", "curl", "make", "perl", "python3.11", "util-linux")


def log(msg: str) -> None:
    print(msg, flush=True)


def domain_sources(work: Path) -> dict[str, list[str]]:
    """Held-out domain → its files (changelogs decompressed into ``work``); domains missing here are skipped."""
    out = {"shakespeare": [str(SHAKESPEARE)] if SHAKESPEARE.exists() else []}
    out["legal"] = [p for p in (f"/usr/share/common-licenses/{n}" for n in ("GPL-3", "Apache-2.0", "MPL-2.0"))
                    if os.path.exists(p)]
    logs = []
    for pkg in CHANGELOG_PACKAGES:
        src = Path(f"/usr/share/doc/{pkg}/changelog.Debian.gz")
        if src.exists():
            dst = work / f"changelog-{pkg}.txt"
            dst.write_bytes(gzip.decompress(src.read_bytes()))
            logs.append(str(dst))
    out["changelog"] = logs
    out["build-docs"] = sorted(glob("/usr/share/cmake-*/Help/manual/cmake-language.7.rst")
                               + glob("/usr/share/cmake-*/Help/manual/cmake-buildsystem.7.rst"))
    return {k: v for k, v in out.items() if v}


def mixed_sets(result, frac: float) -> tuple[set[str], set[str]]:
    """(INT4 linears chosen by assign_precision's ranking, INT4 linears of a blind choice of the same fp share)."""
    groups = result.groups or [[n] for n in result.linears]
    sens, _ = sensitivity(result, groups)
    cands = []
    for g, s in zip(groups, sens):
        n = sum(result.linears[x].shape[0] for x in g)
        k = result.linears[g[0]].shape[1]
        cands.append(Candidate(None, g, n, k, 64, s, 0, 0))
    chosen = choose_int4(cands, {"kind": "int4_fraction", "value": frac})
    ranked = {x for i in chosen for x in cands[i].names}
    fp_params = sum(cands[i].params for i in range(len(cands)) if i not in chosen)
    blind_fp, acc = set(), 0
    order = list(range(0, len(cands), 5)) + [i for i in range(len(cands)) if i % 5]
    for i in order:
        if acc + cands[i].params <= fp_params:
            blind_fp.add(i)
            acc += cands[i].params
    blind = {x for i in range(len(cands)) if i not in blind_fp for x in cands[i].names}
    return ranked, blind


def tier_sets(result, choice: list[str], groups: list[list[str]]) -> tuple[set[str], set[str]]:
    """(INT4 linears, FP8 linears) of a per-group choice."""
    return ({n for g, t in zip(groups, choice) if t == "int4" for n in g},
            {n for g, t in zip(groups, choice) if t == "fp8" for n in g})


def three_tier(args, model, stats, evaluate, out: dict, method: str) -> None:
    """The three-tier mix against the best two-tier mix at the same bytes (see the module docstring)."""
    t0 = time.perf_counter()
    res = quant.quantize(model, stats, progress=False, method=method, group_size=args.group_size, tiers="int4,fp8")
    secs = time.perf_counter() - t0
    groups = res.groups or [[n] for n in res.linears]
    s4, kind = sensitivity(res, groups)
    s8, _ = sensitivity(res, groups, "fp8")
    cands = []
    for g, a, b in zip(groups, s4, s8):
        n, k = sum(res.linears[x].shape[0] for x in g), res.linears[g[0]].shape[1]
        gs = res.linears[g[0]].group_size
        cands.append(Candidate(None, g, n, k, gs, a, n * k * 2, int4_bytes(n, k, gs, 2), b, fp8_bytes(n, k)))
    bf16 = sum(c.fp_bytes for c in cands)
    all_fp8 = sum(c.fp8_bytes for c in cands)
    target = {"kind": "memory_fraction", "value": args.memory_fraction}
    mixes = {"three-tier INT4+FP8+bf16": choose_tiers(cands, target, ("int4", "fp8")),
             "two-tier INT4+bf16": choose_tiers(cands, target, ("int4",)),
             "all INT4": ["int4"] * len(cands), "all FP8": ["fp8"] * len(cands),
             "three-tier at all-FP8's bytes": choose_tiers(cands, {"kind": "memory_bytes", "value": all_fp8},
                                                            ("int4", "fp8"))}
    info = {"method": f"{method} g{args.group_size}", "quantize_seconds": secs, "sensitivity_kind": kind,
            "bf16_decoder_linear_bytes": bf16, "budget_bytes": int(args.memory_fraction * bf16),
            "memory_fraction": args.memory_fraction, "rows": []}
    out.setdefault("three_tier", {})[method] = info
    rows = []
    for label, choice in mixes.items():
        nbytes = sum({"int4": c.int4_bytes, "fp8": c.fp8_bytes, "fp": c.fp_bytes}[t] for c, t in zip(cands, choice))
        est = sum({"int4": c.sensitivity, "fp8": c.fp8_sensitivity, "fp": 0.0}[t] for c, t in zip(cands, choice))
        counts = {t: choice.count(t) for t in ("int4", "fp8", "fp")}
        int4, fp8 = tier_sets(res, choice, groups)
        row = evaluate(f"{method} {label} ({nbytes / bf16:.3f} of bf16)", "shipped", res, int4=int4, fp8=fp8,
                       extra={"bytes": nbytes, "fraction_of_bf16": nbytes / bf16, "estimated_loss_increase": est,
                              "linears_per_tier": counts, "choice": {"+".join(c.names): t
                                                                      for c, t in zip(cands, choice)}})
        rows.append(row)
        info["rows"].append(row["config"])
        log(f"  {label}: {counts}, bytes {nbytes / bf16:.3f} of bf16, estimated loss +{est:.4f} nats")
    a, b = rows[:2]
    info["three_vs_two_tier_ppl_increase"] = {
        d: {"three": a["domains"][d]["ppl_increase"], "two": b["domains"][d]["ppl_increase"]} for d in a["domains"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calib", nargs="+", default=["shipped"], choices=["shipped", "shakespeare"],
                    help="shipped: every --methods (+ mixed precision); shakespeare: the old setup for comparison "
                         "(GPTQ with the old dampening 0.01; no output gradients)")
    ap.add_argument("--methods", nargs="+", default=["rtn", "awq", "gptq"])
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--eval-chunks", type=int, default=4)
    ap.add_argument("--domains", nargs="+", default=None,
                    help="evaluate only these held-out domains (default: every one found on this machine)")
    ap.add_argument("--calib-chunks", type=int, default=16)
    ap.add_argument("--variants", nargs="*", default=[], help="extra GPTQ option dicts (JSON) to try")
    ap.add_argument("--lm-heads", nargs="+", default=["int8"], choices=["int8", "int4", "none"],
                    help="the output head's precision per row (quantization lm_head: int8 the default, int4, none = "
                         "kept in fp32); each method is quantized once per head")
    ap.add_argument("--no-mixed", action="store_true")
    ap.add_argument("--three-tier", action="store_true",
                    help="only the three-tier (INT4+FP8+bf16) vs two-tier (INT4+bf16) comparison at --memory-fraction")
    ap.add_argument("--memory-fraction", type=float, default=0.5,
                    help="--three-tier byte budget, a fraction of the decoder linears' bf16 bytes (default 0.5)")
    ap.add_argument("--out", default="bench/results/quant-domains.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="devin_quant_domains_"))
    sources = domain_sources(work)
    if args.domains:
        unknown = sorted(set(args.domains) - set(sources))
        if unknown:
            ap.error(f"--domains: unknown {unknown}; choose from {sorted(sources)}")
        sources = {k: v for k, v in sources.items() if k in args.domains}
    model, tok = load_model(None, torch.float32)
    evals, refs = {}, {}
    for name, files in sources.items():
        evals[name] = token_chunks(load_token_stream(tok, files), args.eval_chunks, 512, from_end=True,
                                   what=f"evaluation ({name})")
        refs[name] = reference_logits(hf_logits_fn(model), evals[name])
    log(f"domains: {', '.join(f'{k} ({len(v)} files)' for k, v in sources.items())}; "
        f"{args.eval_chunks} x 512 tokens each")
    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
    out = {"cpu": cpu, "torch": torch.__version__, "platform": platform.platform(), "group_size": args.group_size,
           "eval_tokens_per_domain": args.eval_chunks * 511, "domains": {k: v for k, v in sources.items()},
           "rows": []}

    def evaluate(label: str, calib: str, result, int4=None, extra=None, fp8=None) -> dict:
        sim = quant.simulate(model, result, int4=int4, fp8=fp8)
        row = {"config": label, "calibration": calib, **(extra or {}), "domains": {}}
        for name in evals:
            row["domains"][name] = compare(hf_logits_fn(sim), evals[name], refs[name]).as_dict()
        held = [d for d in row["domains"] if d != "shakespeare"]  # genres neither calibration has
        row["held_out_mean_ppl_increase"] = (sum(row["domains"][d]["ppl_increase"] for d in held) / len(held)
                                             if held else None)
        out["rows"].append(row)
        cells = "  ".join(f"{d} {row['domains'][d]['ppl_increase']:+6.1%}/{row['domains'][d]['top1']:.0%}"
                          for d in row["domains"])
        mean = row["held_out_mean_ppl_increase"]
        log(f"{calib:11} {label:34} {cells}" + (f"  held-out mean {mean:+.1%}" if mean is not None else ""))
        return row

    if args.three_tier:
        t0 = time.perf_counter()
        stats = collect_stats(model, token_chunks(load_token_stream(tok, None), args.calib_chunks, 512),
                              progress=False, data="shipped", fisher=True)
        log(f"shipped: calibration {stats.tokens} tokens in {time.perf_counter() - t0:.1f} s")
        out["command"] = " ".join(sys.argv)
        for method in args.methods:
            three_tier(args, model, stats, evaluate, out, method)
        args.calib = []
    for calib in args.calib:
        data = None if calib == "shipped" else str(SHAKESPEARE)
        t0 = time.perf_counter()
        stats = collect_stats(model, token_chunks(load_token_stream(tok, data), args.calib_chunks, 512),
                              progress=False, data=calib, fisher=calib == "shipped")
        calib_s = time.perf_counter() - t0
        log(f"{calib}: calibration {stats.tokens} tokens in {calib_s:.1f} s")
        if calib == "shipped":
            configs = [(m, {"method": m}) for m in args.methods]
            configs += [(f"gptq {v}", {"method": "gptq", **json.loads(v)}) for v in args.variants]
        else:
            configs = [("gptq damp=0.01 (old)", {"method": "gptq", "damp": 0.01})]
        for (label, opts), head in ((c, h) for c in configs for h in args.lm_heads):
            t0 = time.perf_counter()
            opts = {**opts, "lm_head": False if head == "none" else head}
            res = quant.quantize(model, stats, progress=False, group_size=args.group_size, **opts)
            secs = time.perf_counter() - t0
            row = evaluate(f"{label} g{args.group_size} all INT4, head {head}", calib, res,
                           extra={"options": opts, "quantize_seconds": secs, "calibration_seconds": calib_s})
            if label == "gptq" and calib == "shipped" and not args.no_mixed:
                ranked, blind = mixed_sets(res, 0.8)
                evaluate("gptq mixed int4_fraction=0.8 ranked", calib, res, int4=ranked,
                         extra={"kept_fp": sorted(set(res.linears) - ranked)})
                evaluate("gptq mixed int4_fraction=0.8 blind", calib, res, int4=blind,
                         extra={"kept_fp": sorted(set(res.linears) - blind)})
            del row
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
