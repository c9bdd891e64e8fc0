"""Cold vs warm starts through the compile cache: ``optimize()`` of SmolLM2, and ``devin-compile serve``.

    python bench/startup.py [--repeats 3] [--out bench/results/startup.json]

Kernels are built already (the shared kernel cache); "cold" is an empty compile cache (a fresh
folder per run, ``compile_cache=DIR``), "warm" the same folder after a first start wrote it.

- ``optimize``: one process loads SmolLM2 once (not timed), then times ``optimize()`` ``repeats``
  times cold and ``repeats`` times warm, and checks greedy outputs are identical cold vs warm;
  the log's per-step lines (capture, passes, engine) are kept for the last warm run.
- ``serve``: process start of ``devin-compile serve`` on the embedded model to ``/health``
  answering 200, ``repeats`` times cold and warm (weights loading included).

Medians are reported; the load average is recorded (timings on a shared machine are noisy).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

OPTIMIZE = """
import json, logging, sys, tempfile, time
records = []
class Keep(logging.Handler):
    def emit(self, r): records.append(f"{r.relativeCreated / 1e3:7.1f} s  {r.getMessage()}")
logging.getLogger("devin_compile").addHandler(Keep()); logging.getLogger("devin_compile").setLevel(logging.INFO)
import torch, devin_compile
from devin_compile.models import load_model
model, tok = load_model(None, torch.float32)
prompts = ["The quick brown fox", "Once upon a time, in a kingdom by the sea, there lived"]
out = {"cold_s": [], "warm_s": [], "outputs_equal": True}
ref = None
for phase in ("cold", "warm"):
    for i in range({repeats}):
        folder = tempfile.mkdtemp() if phase == "cold" else out.setdefault("warm_dir", tempfile.mkdtemp())
        if phase == "warm" and i == 0:
            devin_compile.optimize(model, tokenizer=tok, compile_cache=folder)  # writes the entry (not timed)
        del records[:]
        t = time.perf_counter()
        opt = devin_compile.optimize(model, tokenizer=tok, compile_cache=folder, warmup=True)
        out[phase + "_s"].append(round(time.perf_counter() - t, 2))
        gen = opt.generate(prompts, max_new_tokens=24)
        ref = ref or gen
        out["outputs_equal"] &= gen == ref
        out[phase + "_log"] = list(records)
print("RESULT " + json.dumps(out))
"""


def _optimize(repeats: int) -> dict:
    p = subprocess.run([sys.executable, "-c", OPTIMIZE.replace("{repeats}", str(repeats))], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=3600)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"optimize bench failed: {p.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_once(folder: str) -> float:
    port = _free_port()
    argv = [sys.executable, "-m", "devin_compile.cli", "-q", "serve", "--port", str(port),
            "--option", f"compile_cache={json.dumps(folder)}"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode}: {proc.stderr.read()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return round(time.perf_counter() - t0, 2)
            except OSError:
                time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _serve(repeats: int) -> dict:
    warm = tempfile.mkdtemp()
    out = {"cold_s": [], "warm_s": []}
    for _ in range(repeats):
        cold = tempfile.mkdtemp()
        out["cold_s"].append(_serve_once(cold))
        shutil.rmtree(cold, ignore_errors=True)
    _serve_once(warm)  # writes the entry
    for _ in range(repeats):
        out["warm_s"].append(_serve_once(warm))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "startup.json"))
    ap.add_argument("--only", choices=["optimize", "serve"], default=None)
    args = ap.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor() or platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    result = {"machine": f"{cpu} ({', '.join(isa)}), {os.cpu_count()} CPUs",
              "load_before": os.getloadavg()}
    for name, fn in (("optimize", _optimize), ("serve", _serve)):
        if args.only in (None, name):
            r = fn(args.repeats)
            r["cold_median_s"], r["warm_median_s"] = statistics.median(r["cold_s"]), statistics.median(r["warm_s"])
            result[name] = r
            print(f"{name}: cold {r['cold_median_s']} s, warm {r['warm_median_s']} s (medians of {args.repeats})",
                  flush=True)
    result["load_after"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
