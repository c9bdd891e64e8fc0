"""Wall time of calibration plus INT4 quantization on SmolLM2, the path `quantize calibrate` then
`quantize run` takes (the target: calibration + GPTQ ≤ 120 s on a 2-core CPU).

    python bench/quant_walltime.py [--chunks 16] [--methods gptq] [--repeats 3] [--no-output-gradients]
                                   [--out bench/results/quant-walltime.json]

Real SmolLM2-135M-Instruct weights, fp32, the shipped calibration set (``--chunks`` x 512 tokens,
output-gradient statistics unless ``--no-output-gradients``), ``group_size=64`` with each method's
defaults. Each repeat calibrates and quantizes afresh; the JSON holds every run and the medians.
Measure on a quiet machine: the figures are wall seconds, meaningful only next to each other and
the CPU named in the file.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from devin_compile import quant  # noqa: E402
from devin_compile.models import load_model  # noqa: E402
from devin_compile.quant.calibration import collect_stats  # noqa: E402
from devin_compile.quant.corpus import load_token_stream, token_chunks  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--methods", nargs="+", default=["gptq"], choices=["rtn", "awq", "gptq"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-output-gradients", action="store_true")
    ap.add_argument("--out", default="bench/results/quant-walltime.json")
    args = ap.parse_args()
    model, tok = load_model(None, torch.float32)
    chunks = token_chunks(load_token_stream(tok, None), args.chunks, 512)
    runs = []
    for r in range(args.repeats):
        t0 = time.perf_counter()
        stats = collect_stats(model, chunks, progress=False, data="shipped", fisher=not args.no_output_gradients)
        run = {"calibration_seconds": time.perf_counter() - t0}
        for method in args.methods:
            t0 = time.perf_counter()
            quant.quantize(model, stats, progress=False, method=method, group_size=64)
            run[f"{method}_seconds"] = time.perf_counter() - t0
        runs.append(run)
        print(f"run {r + 1}: " + "  ".join(f"{k} {v:.1f}" for k, v in run.items()), flush=True)
    medians = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
    for method in args.methods:
        medians[f"calibration_plus_{method}_seconds"] = statistics.median(
            run["calibration_seconds"] + run[f"{method}_seconds"] for run in runs)
    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
    # the model name alone ("AMD EPYC") hides the generation and clock: keep family/model/MHz/ISA too
    info = subprocess.run("grep -m5 -E '^(cpu family|model\\s|cpu MHz|flags)' /proc/cpuinfo", shell=True,
                          capture_output=True, text=True).stdout.splitlines()
    cpu_detail = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in info) if k.strip() != "flags"}
    cpu_detail["isa"] = sorted({f for line in info if line.startswith("flags") for f in line.split()
                               if f.startswith(("avx", "amx"))})
    out = {"cpu": cpu, "cpu_detail": cpu_detail, "threads": torch.get_num_threads(), "torch": torch.__version__,
           "platform": platform.platform(), "chunks": args.chunks, "chunk_len": 512,
           "output_gradients": not args.no_output_gradients, "runs": runs, "median": medians}
    print(json.dumps(out["median"], indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
