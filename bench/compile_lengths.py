"""torch.compile with the devin backend over several prompt lengths: compiles, first-call and per-length times.

    python bench/compile_lengths.py [--model smollm2|tiny] [--lengths 11 7 19 5 30] [--out PATH]

Two ways, each in its own process with an empty Inductor cache (cold, as a first start is), and
``compile_model`` once more in a second process over the Inductor caches the first one left (warm):
``plain`` is ``torch.compile(model, backend="devin")``, ``compile_model`` is
``devin_compile.compile_model(model)`` (token dimension marked dynamic from the first call). For
each prompt length: the call's wall time, the backend compiles and Dynamo graphs so far, and the
largest |logits - eager logits|; then each length once more (``seconds_again``: no compile left,
the steady-state time). Writes bench/results/compile_lengths.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _model(name: str):
    import torch

    if name == "tiny":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2)).eval()
    from devin_compile.models import load_model

    return load_model(None, torch.float32)[0].eval()


def child(mode: str, name: str, lengths: list[int]) -> dict:
    """One way, in this process: the figures of each call."""
    import torch
    from torch._dynamo.utils import counters

    import devin_compile
    import devin_compile.compile_backend as cb

    model = _model(name)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    with torch.no_grad():
        refs = [model(ids).logits for ids in prompts]
    compiled = torch.compile(model, backend="devin") if mode == "plain" else devin_compile.compile_model(model)
    rows = []
    with torch.no_grad():
        for ids, ref in zip(prompts, refs):
            start = time.perf_counter()
            logits = compiled(ids).logits
            seconds = time.perf_counter() - start
            rows.append({"tokens": ids.shape[1], "seconds": round(seconds, 3), "backend_compiles": len(cb.reports),
                         "dynamo_graphs": counters["stats"]["unique_graphs"],
                         "max_abs_diff": float((logits - ref).abs().max())})
            print(mode, rows[-1], file=sys.stderr, flush=True)
        for ids, row in zip(prompts, rows):  # the same lengths again: steady-state time per call
            start = time.perf_counter()
            compiled(ids)
            row["seconds_again"] = round(time.perf_counter() - start, 3)
            row["backend_compiles_again"] = len(cb.reports)
    return {"mode": mode, "calls": rows}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())
    except OSError:
        return platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[11, 7, 19, 5, 30])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "compile_lengths.json"))
    ap.add_argument("--child", choices=["plain", "compile_model"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.lengths)))
        return
    results = []
    for mode in ("plain", "compile_model"):
        with tempfile.TemporaryDirectory() as inductor_cache:
            # compile_model twice: a cold process, then a second one over the Inductor caches the first left
            for run in (("cold",) if mode == "plain" else ("cold", "second process")):
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor_cache, "PYTHONPATH": ROOT}
                out = subprocess.run([sys.executable, __file__, "--child", mode, "--model", args.model, "--lengths",
                                      *map(str, args.lengths)], env=env, check=True, capture_output=True, text=True)
                results.append({**json.loads(out.stdout.strip().splitlines()[-1]), "run": run})
    doc = {"model": args.model, "torch": __import__("torch").__version__, "cpu": _cpu_model(),
           "threads": __import__("torch").get_num_threads(), "load_average": os.getloadavg(), "results": results}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    for r in results:
        print(r["mode"], r["run"], " ".join(f"T={c['tokens']}: {c['seconds']:.1f}s ({c['backend_compiles']} compiles), "
                                  f"again {c['seconds_again']:.2f}s" for c in r["calls"]))


if __name__ == "__main__":
    main()
