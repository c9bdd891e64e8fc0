"""Memory of an optimized model, and what long steps cost without dense copies (issue 41).

    python bench/memory.py [--dtypes float32 bfloat16] [--modes dense int4 fp8 mix] [--repeats 5]

Memory: each row is a fresh process that loads SmolLM2, runs ``optimize()`` (a 64-block KV pool), then
``del model``, ``gc.collect()`` and ``malloc_trim(0)``, and reads its resident memory (VmRSS). The
row's figure is that minus the same for a process that only loaded and deleted the model (the
issue's measure: "what loading alone leaves"), and its ratio to the model's parameter bytes. A
second baseline loads the model and optimizes a tiny 2-layer model instead (imports, kernel builds
and the compiler's own caches paid, no SmolLM2 weights): RSS over it is what SmolLM2's weights
cost. Each row also gives the bytes of the tensors reachable from the ``OptimizedModel``
(:func:`devin_compile.weights.held_tensors`, KV pool left out), the weights as the program holds them.

Modes: ``dense`` (no quantization), ``int4`` (RTN g64, every decoder linear, and the default INT8 output
head, which a tied embedding then reads: ``devin::int8_embedding``), ``int4_fphead`` (the same with the head
kept in the model dtype, ``lm_head=False``), ``int4_head`` (the head in INT4 too, read by the tied embedding
through ``devin::int4_embedding``), ``fp8`` (every
decoder linear), ``mix`` (the three-tier knapsack at half the decoder linears' bf16 bytes: a
``memory_fraction`` of 0.5 in bf16, 0.25 in float32),
all from one RTN artifact with both tiers, made once (calibrated on 2 x 128 tokens of the shipped
set: the mix needs sensitivities) and cached under ``$DEVIN_COMPILE_CACHE/bench-memory``.

Prefill: per quantized mode and dtype one process optimizes the model three times, with the default
long steps (dequantized tiles, no dense copy), with ``dense_prefill=True`` (dense copies) and
unquantized, and times a 512-token prompt (one prefill step and the first token) on each,
alternating, ``--repeats`` times after a warm-up; tok/s from the medians. Writes ``bench/results/memory.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROMPT_TOKENS = 512
MODES = ("dense", "int4", "int4_fphead", "int4_head", "fp8", "mix")
HEADS = {"int4_fphead": ("-fphead", False), "int4_head": ("-head", "int4")}  # mode → (artifact suffix, lm_head)


def quant_options(mode: str, art: str, dtype: str, **extra) -> dict:
    """``optimize()`` options of a mode (``art``: the artifact folder)."""
    if mode == "dense":
        return {}
    fraction = 0.25 if dtype == "float32" else 0.5  # half the bf16 bytes either way
    q = {"int4": {"tiers": "int4"}, "int4_fphead": {"tiers": "int4"}, "int4_head": {"tiers": "int4"},
         "fp8": {"tiers": "fp8"},
         "mix": {"tiers": "int4,fp8", "target": {"memory_fraction": fraction}}}[mode]
    if mode in HEADS:
        art = art + HEADS[mode][0]
    return {"quantized": art, "quantization": {**q, **extra}}


# ------------------------------------------------------------------ children (fresh processes)
def _rss_mib() -> float:
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child_memory(task: dict) -> dict:
    """Load, then optimize (``task['what']``: a mode, ``"load"`` or ``"tiny"``), delete the model, read RSS."""
    import torch

    import devin_compile
    from devin_compile.models import load_model
    from devin_compile.weights import held_bytes, held_tensors

    dtype = getattr(torch, task["dtype"])
    model, tok = load_model(None, dtype)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = None
    if task["what"] == "tiny":
        from transformers import LlamaConfig, LlamaForCausalLM

        del model
        model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        opt = devin_compile.optimize(model.eval().to(dtype), num_kv_blocks=64)
    elif task["what"] != "load":
        opt = devin_compile.optimize(model, tokenizer=tok, num_kv_blocks=64,
                                     **quant_options(task["what"], task["artifact"], task["dtype"]))
    del model
    out = {"rss_mib": _rss_mib(), "param_bytes": params}
    if opt is not None and task["what"] != "tiny":
        found = held_tensors(opt)
        pool = opt.engine.runner.kv_cache.data.data_ptr()
        weights = {k: v for k, v in found.items() if k[1] != pool}
        out["held_weight_bytes"] = held_bytes(weights)
        out["precision_note"] = opt.quant_note
    return out


def _prefill_time(opt, prompt: list[int]) -> float:
    from devin_compile.runtime.sampling import SamplingParams

    eng = opt.engine
    eng.reset_prefix_cache()
    t0 = time.perf_counter()
    eng.generate([prompt], SamplingParams(max_new_tokens=1, ignore_eos=True))
    return time.perf_counter() - t0


def child_prefill(task: dict) -> dict:
    """Tiles against dense copies on a 512-token prompt, alternating, in one process."""
    import torch

    import devin_compile
    from devin_compile.models import load_model
    from devin_compile.runtime import arena_reuse

    arena_reuse.install()
    model, tok = load_model(None, getattr(torch, task["dtype"]))
    text = (ROOT.parent / "shared" / "data" / "tinyshakespeare.txt").read_text()
    prompt = tok(text[:8000], add_special_tokens=False)["input_ids"][:PROMPT_TOKENS]
    assert len(prompt) == PROMPT_TOKENS, len(prompt)
    mode, art, dtype = task["mode"], task["artifact"], task["dtype"]
    opts = {"tiles": quant_options(mode, art, dtype),
            "dense_copies": quant_options(mode, art, dtype, dense_prefill=True), "unquantized": {}}
    engines = {name: devin_compile.optimize(model, tokenizer=tok, num_kv_blocks=64, **o) for name, o in opts.items()}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for name, opt in engines.items():
        _prefill_time(opt, prompt)  # warm-up
    for _ in range(task["repeats"]):
        for name, opt in engines.items():
            times[name].append(_prefill_time(opt, prompt))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {name: {"median_s": med[name], "tok_s": PROMPT_TOKENS / med[name], "times_s": times[name]}
            for name in engines} | {"tiles_vs_dense_copies": med["dense_copies"] / med["tiles"]}


# ------------------------------------------------------------------ the parent
def run_child(kind: str, task: dict) -> dict:
    # the compile cache off: every row compiles (a hit would map the program's tensors from its file)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "DEVIN_COMPILE_CACHE_OFF": "1"}
    p = subprocess.run([sys.executable, "-W", "ignore", __file__, "--child", kind, json.dumps(task)],
                       capture_output=True, text=True, env=env, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"{kind} child {task} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def make_artifact() -> str:
    """The RTN g64 artifacts with INT4 and FP8 weights, one per output head (the default INT8 head, and the
    :data:`HEADS` variants), made once and cached; returns the default one's folder."""
    import torch

    from devin_compile import quant
    from devin_compile.models import load_model

    cache = Path(os.environ.get("DEVIN_COMPILE_CACHE", Path.home() / ".cache" / "devin_compile"))
    out = cache / "bench-memory" / "smollm2-rtn-g64-int4-fp8-int8head"
    folders = {out: "int8", **{out.with_name(out.name + suffix): head for suffix, head in HEADS.values()}}
    if all((f / "quant_config.json").exists() for f in folders):
        return str(out)
    model, tok = load_model(None, torch.float32)
    stats = quant.calibrate(model, tok, num_chunks=2, chunk_len=128, progress=False)
    for folder, head in folders.items():
        quant.save(quant.quantize(model, stats, method="rtn", group_size=64, tiers="int4,fp8", lm_head=head,
                                  progress=False), folder)
    return str(out)


def machine() -> dict:
    info = {"python": platform.python_version(), "threads": os.cpu_count()}
    try:
        cpu = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("model name"))
        info["avx512"] = "avx512f" in cpu
    except (OSError, StopIteration):
        info["cpu"] = platform.processor()
    return info


def memory_rows(dtypes: list[str], modes: list[str], art: str) -> list[dict]:
    rows = []
    for dtype in dtypes:
        base = run_child("memory", {"what": "load", "dtype": dtype})
        tiny = run_child("memory", {"what": "tiny", "dtype": dtype})
        for mode in modes:
            r = run_child("memory", {"what": mode, "dtype": dtype, "artifact": art})
            params = r["param_bytes"]
            delta = (r["rss_mib"] - base["rss_mib"]) * 2**20
            row = {"dtype": dtype, "mode": mode, "param_mib": params / 2**20,
                   "rss_over_load_mib": delta / 2**20, "rss_over_load_x": delta / params,
                   "rss_over_tiny_mib": r["rss_mib"] - tiny["rss_mib"],
                   "rss_over_tiny_x": (r["rss_mib"] - tiny["rss_mib"]) * 2**20 / params,
                   "held_weight_mib": r["held_weight_bytes"] / 2**20,
                   "held_weight_x": r["held_weight_bytes"] / params,
                   "compiler_overhead_mib": tiny["rss_mib"] - base["rss_mib"], "note": r.get("precision_note", "")}
            print(f"{dtype:9s} {mode:6s} RSS-over-load {row['rss_over_load_mib']:7.1f} MiB "
                  f"({row['rss_over_load_x']:.2f}x)  over-tiny {row['rss_over_tiny_x']:.2f}x  held weights "
                  f"{row['held_weight_mib']:7.1f} MiB ({row['held_weight_x']:.2f}x)", flush=True)
            rows.append(row)
    return rows


def prefill_rows(dtypes: list[str], modes: list[str], art: str, repeats: int) -> list[dict]:
    rows = []
    for dtype in dtypes:
        for mode in (m for m in modes if m != "dense"):
            r = run_child("prefill", {"mode": mode, "dtype": dtype, "artifact": art, "repeats": repeats})
            rows.append({"dtype": dtype, "mode": mode, **r})
            print(f"{dtype:9s} {mode:6s} prefill {PROMPT_TOKENS} tokens: tiles {r['tiles']['tok_s']:7.1f} tok/s, "
                  f"dense copies {r['dense_copies']['tok_s']:7.1f} tok/s ({r['tiles_vs_dense_copies']:.2f}x), "
                  f"unquantized {r['unquantized']['tok_s']:7.1f} tok/s", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--parts", nargs="+", default=["memory", "prefill"], choices=["memory", "prefill"])
    ap.add_argument("--out", default=str(HERE / "results" / "memory.json"))
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, task = args.child[0], json.loads(args.child[1])
        print(json.dumps((child_memory if kind == "memory" else child_prefill)(task)))
        return
    art = make_artifact()
    result = {"machine": machine(), "load_before": os.getloadavg(), "command": " ".join(sys.argv)}
    if "memory" in args.parts:
        result["memory"] = memory_rows(args.dtypes, args.modes, art)
    if "prefill" in args.parts:
        result["prefill"] = prefill_rows(args.dtypes, args.modes, art, args.repeats)
    result["load_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
