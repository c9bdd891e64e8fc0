"""A/B of two devin-compile checkouts in one run: did a change move decode or throughput?

    python bench/ab.py BASE_DIR [NEW_DIR] [--rounds 3] [--dtype bfloat16] [--workload mixed-64]

``BASE_DIR`` / ``NEW_DIR`` are repository roots (e.g. ``git worktree add /tmp/base main~5``;
NEW_DIR defaults to this checkout). Each round runs one fresh process per checkout, alternately
(base, new, base, new, ...), so both see the same machine noise. A process loads SmolLM2,
optimizes it with defaults, then measures batch-1 decode (128 new tokens after a short prompt,
median of 5 after a warm-up) and the workload's generated tokens/s (every request to
``max_new_tokens``, EOS ignored), plus the engine's time per step outside ``runner.execute``
(scheduling, sampling, bookkeeping). Reports every round and the medians; writes
bench/results/ab.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(HERE, "..", "..", "shared", "workloads")

# Runs inside the child, with the checkout first on sys.path.
CHILD = r"""
import json, sys, time
root, dtype, workload = sys.argv[1:4]
sys.path.insert(0, root)
import torch, devin_compile
from devin_compile.config import parse_dtype
from devin_compile.models import load_model
from devin_compile.runtime.sampling import SamplingParams
assert devin_compile.__file__.startswith(root), devin_compile.__file__
try:
    from devin_compile.runtime import arena_reuse as arena
except ImportError:  # checkouts before the rename
    from devin_compile.runtime import py_arena_cache as arena
arena.install()
model, tok = load_model(None, parse_dtype(dtype))
rows = [json.loads(l) for l in open(workload) if l.strip()]
work = [(tok(r["prompt"], add_special_tokens=False)["input_ids"], int(r["max_new_tokens"])) for r in rows]
eng = devin_compile.optimize(model, tokenizer=tok).engine
execute, spent = eng.runner.execute, [0.0]
def timed(*a, **k):
    t = time.perf_counter(); out = execute(*a, **k); spent[0] += time.perf_counter() - t; return out
eng.runner.execute = timed
prompt = tok("First Citizen:\nBefore we proceed any further, hear me speak.\n", add_special_tokens=False)["input_ids"]
def decode():
    eng.reset_prefix_cache()
    eng.add_request(prompt, SamplingParams(max_new_tokens=128, ignore_eos=True))
    eng.step()
    t0, n = time.perf_counter(), 0
    while eng.has_unfinished():
        eng.step(); n += 1
    return n / (time.perf_counter() - t0)
def throughput():
    eng.reset_prefix_cache(); spent[0] = 0.0
    t0, steps = time.perf_counter(), 0
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in work]
    while eng.has_unfinished():
        eng.step(); steps += 1
    wall = time.perf_counter() - t0
    return sum(len(eng.requests[i].output_ids) for i in ids) / wall, (wall - spent[0]) / steps * 1e3
decode()
dec = sorted(decode() for _ in range(5))[2]
tput, overhead = throughput()
print(json.dumps({"decode_tok_s": dec, "throughput_tok_s": tput, "engine_ms_per_step": overhead}))
"""


def cpu() -> dict:
    """The CPU's model name and its AVX/AMX flags (the name alone can hide the ISA)."""
    info = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        return {"name": platform.processor(), "isa": []}
    isa = sorted(f for f in info.get("flags", "").split() if f.startswith(("avx", "amx")))
    return {"name": info.get("model name", "?"), "isa": isa}


def run_child(root: str, dtype: str, workload: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(root), dtype, workload],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("new", nargs="?", default=os.path.join(HERE, ".."))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workload", default="mixed-64")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "ab.json"))
    args = ap.parse_args()
    workload = os.path.join(SHARED, f"{args.workload}.jsonl")
    rows = {"base": [], "new": []}
    for r in range(args.rounds):
        for label, root in (("base", args.base), ("new", args.new)):
            rows[label].append(run_child(root, args.dtype, workload))
            print(f"round {r + 1} {label:4}: {json.dumps(rows[label][-1])}", flush=True)
    keys = ("decode_tok_s", "throughput_tok_s", "engine_ms_per_step")
    medians = {label: {k: statistics.median(x[k] for x in rs) for k in keys} for label, rs in rows.items()}
    print(f"\n{'median':24} {'base':>10} {'new':>10} {'new/base':>9}")
    for k in keys:
        b, n = medians["base"][k], medians["new"][k]
        print(f"{k:24} {b:10.2f} {n:10.2f} {n / b:9.3f}")
    result = {"command": " ".join(sys.argv), "machine": {"cpu": cpu(), "cores": os.cpu_count()},
              "dtype": args.dtype, "workload": args.workload, "rounds": rows, "medians": medians}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
