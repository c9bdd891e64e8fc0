"""First start vs later starts: what building the C/C++ kernels costs, and that concurrent first starts build once.

    python bench/kernel_builds.py [--out PATH]

Each run is a fresh process doing ``optimize()`` + a short ``generate`` on a tiny Llama (it loads every
CPU kernel SmolLM2 does) with an empty kernel cache of its own (``DEVIN_COMPILE_CACHE`` in a temp
dir; the shared ``~/.cache/devin_compile/kernels`` is not touched): ``cold`` (empty cache), ``warm``
(the same cache again), then ``concurrent``: two processes started together on another empty
cache. From each process's log (logger ``devin_compile``, INFO): the kernels it built and their
times, and how often it waited on another's build. Writes bench/results/kernel_builds.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

START = """
import logging, time
logging.basicConfig(level=logging.INFO, format="%(message)s")
logging.getLogger("torch").setLevel(logging.WARNING)
t0 = time.perf_counter()
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import devin_compile
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
devin_compile.optimize(model).generate([[5, 6, 7]], max_new_tokens=4)
print(f"ready after {time.perf_counter() - t0:.2f} s")
"""


def _start(cache: str) -> subprocess.Popen:
    env = {**os.environ, "DEVIN_COMPILE_CACHE": cache, "PYTHONPATH": ROOT}
    return subprocess.Popen([sys.executable, "-c", START], env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def _summary(log: str, wall_s: float) -> dict:
    built = [{"kernel": m[1], "seconds": float(m[2])} for m in re.finditer(r"built the (.+?) in ([0-9.]+) s", log)]
    ready = re.search(r"ready after ([0-9.]+) s", log)
    return {"wall_s": round(wall_s, 2), "ready_s": float(ready[1]) if ready else None, "built": built,
            "build_s": round(sum(b["seconds"] for b in built), 1), "waited": log.count("waiting for another process")}


def _run(caches: list[str]) -> list[dict]:
    start = time.perf_counter()
    procs = [_start(cache) for cache in caches]
    logs = [p.communicate()[0] for p in procs]
    wall = time.perf_counter() - start
    for p, log in zip(procs, logs):
        if p.returncode != 0:
            raise SystemExit(log)
    return [_summary(log, wall) for log in logs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "kernel_builds.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as one, tempfile.TemporaryDirectory() as two:
        doc = {"cold": _run([one])[0], "warm": _run([one])[0], "concurrent": _run([two, two]),
               "load_average": os.getloadavg(),
               "cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                           "?")}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    for name in ("cold", "warm"):
        r = doc[name]
        print(f"{name}: ready after {r['ready_s']} s, {len(r['built'])} kernels built in {r['build_s']} s")
    for i, r in enumerate(doc["concurrent"]):
        print(f"concurrent #{i}: ready after {r['ready_s']} s, built {len(r['built'])}, waited {r['waited']} times")


if __name__ == "__main__":
    main()
