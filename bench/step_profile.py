"""Where a step's time goes, against this machine's limits measured in the same run.

    python bench/step_profile.py [--dtypes bfloat16 float32] [--int4] [--scenarios b1 b64 mixed]
                                 [--steps 24] [--repeats 5] [--base fuse_add_rms_norm=false ...]
                                 [--out bench/results/profile.json]

Scenarios (SmolLM2-135M, optimize() defaults, greedy):
  b1     batch-1 decode steps (one request, 32-token prompt);
  b64    decode steps of 64 rows (64 requests, 32-token prompts, all decoding);
  mixed  steps of 63 decode rows + one 128-token prompt prefilled in the same step.

Each step is split into: GEMMs (every linear op: oneDNN, packed GEMM, INT4/FP8 kernels), attention
(``devin::paged_attention`` incl. its KV writes), norms/rotary/activation (``rms_norm``,
``rotary_heads``, ``silu_mul``, residual adds and the other elementwise ops), other graph ops
(embedding, views, splits, casts), Python/dispatch inside the graph call (the graph call's wall time
minus its ops), runner input prep (lists → step tensors and metadata), sampling, scheduler, and
output/bookkeeping (the rest of ``Engine.step``). Phase times come from runs without the profiler
(``perf_counter`` around the engine's phases, median per step over ``--repeats`` runs of ``--steps``
steps); the op categories come from one ``torch.profiler`` run of the same steps (the top-level ops of
the graph call, each op's time including its own dispatch), scaled so that the graph call's split adds
up to its unprofiled median time (the profiler slows every op); the Python/dispatch figure is a lower
bound and the op figures an upper bound.

Limits, measured here with the same threads: read bandwidth (the median time of a 256 MiB float32
reduction) and the GEMM peak per dtype (one 2048×2048×2048 ``F.linear``). Batch 1 reports bytes read
per token (every tensor the decode graph holds, + the KV cache read at the mean context) and the
share of the read roofline; the batched steps report GEMM GFLOP/s over the GEMM time and over the
whole step, as shares of the peak. ``--base OPTION=VALUE ...`` also profiles each model optimized
with those options (a "before" in the same process: each scenario runs base, then default, on the
same loaded model). Writes a markdown table to stdout and JSON to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import devin_compile  # noqa: E402
from devin_compile.benchmarking import cpu_info, gemm_peak, parse_options, read_bandwidth  # noqa: E402
from devin_compile.config import parse_dtype  # noqa: E402
from devin_compile.models import load_model  # noqa: E402
from devin_compile.runtime.sampling import SamplingParams  # noqa: E402
from devin_compile.weights import held_bytes, held_tensors  # noqa: E402

TEXT = os.path.join(HERE, "..", "..", "shared", "data", "tinyshakespeare.txt")
CATEGORIES = ("gemm", "attention", "norm_rotary_act", "other_ops", "graph_python", "runner_prep",
              "sampling", "scheduler", "bookkeeping")
LABELS = {"gemm": "GEMMs", "attention": "attention", "norm_rotary_act": "norms/rotary/act",
          "other_ops": "other ops", "graph_python": "Python/dispatch (graph)", "runner_prep": "runner prep",
          "sampling": "sampling", "scheduler": "scheduler", "bookkeeping": "bookkeeping (rest)"}


# -- the engine's phases ------------------------------------------------------------------------
class Phases:
    """``perf_counter`` (and a ``record_function`` range) around the engine's phases, per step."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.acc: dict[str, float] = defaultdict(float)
        self.profiling = False
        e, r = engine, engine.runner
        self._orig = [(e.scheduler, "schedule"), (r, "execute"), (e, "_sample"), (e.outputs, "process"),
                      (r, "graph_for")]
        self._saved = [getattr(o, a) for o, a in self._orig]
        e.scheduler.schedule = self._wrap(self._saved[0], "scheduler")
        r.execute = self._wrap(self._saved[1], "execute")
        e._sample = self._wrap(self._saved[2], "sampling")
        e.outputs.process = self._wrap(self._saved[3], "outputs")
        graph_for = self._saved[4]
        r.graph_for = lambda decode: self._wrap(graph_for(decode), "graph")
        if r.decode_graphs is not None:
            self._orig.append((r.decode_graphs, "run"))
            self._saved.append(r.decode_graphs.run)
            r.decode_graphs.run = self._wrap(self._saved[-1], "graph")

    def _wrap(self, fn, label):
        def inner(*a, **k):
            if self.profiling:
                with torch.profiler.record_function(f"phase::{label}"):
                    return self._timed(fn, label, a, k)
            return self._timed(fn, label, a, k)
        return inner

    def _timed(self, fn, label, a, k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            self.acc[label] += time.perf_counter() - t0

    def step(self) -> dict[str, float]:
        """One engine step; its phase seconds."""
        self.acc.clear()
        t0 = time.perf_counter()
        self.engine.step()
        total = time.perf_counter() - t0
        a = dict(self.acc)
        out = {"step": total, "scheduler": a.get("scheduler", 0.0), "sampling": a.get("sampling", 0.0),
               "graph": a.get("graph", 0.0), "runner_prep": a.get("execute", 0.0) - a.get("graph", 0.0)}
        out["bookkeeping"] = total - out["scheduler"] - out["sampling"] - a.get("execute", 0.0)
        return out

    def remove(self) -> None:
        for (o, a), f in zip(self._orig, self._saved):
            setattr(o, a, f)


def op_category(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("linear", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "int4pack")):
        return "gemm"
    if any(s in n for s in ("paged_attention", "mla_attention", "kv_prune", "decode_layer")):
        return "attention"
    if any(s in n for s in ("rms_norm", "layer_norm", "rotary", "silu", "gelu", "aten::add", "aten::mul",
                            "aten::cos", "aten::sin", "aten::neg", "aten::cat", "aten::sub", "aten::div",
                            "aten::rsqrt", "aten::pow", "aten::mean", "aten::tanh")):
        return "norm_rotary_act"
    return "other_ops"


def op_breakdown(prof, steps: int) -> tuple[dict[str, float], dict[str, float], float]:
    """(seconds per step by category, seconds per step by op name, top-level ops dispatched per step) of
    the graph call."""
    cats: dict[str, float] = defaultdict(float)
    ops: dict[str, float] = defaultdict(float)
    count = 0
    for ev in prof.events():
        if ev.name != "phase::graph":
            continue
        for ch in ev.cpu_children:
            d = (ch.time_range.end - ch.time_range.start) * 1e-6 / steps
            cats[op_category(ch.name)] += d
            ops[ch.name] += d
            count += 1
    return dict(cats), dict(sorted(ops.items(), key=lambda kv: -kv[1])), count / steps


# -- scenarios ------------------------------------------------------------------------------------
def prompts(tok, n: int, length: int, offset: int = 0) -> list[list[int]]:
    ids = tok(open(TEXT).read()[offset:offset + 400 * (n + 1) * length // 8], add_special_tokens=False)["input_ids"]
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def setup(engine, tok, scenario: str, new_tokens: int):
    """Bring the engine to the scenario's steady state; returns ``before_step()`` (None or a function
    called before each timed step) and the rows decoded per step."""
    engine.reset_prefix_cache()
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    n = 1 if scenario == "b1" else 64 if scenario == "b64" else 63
    for p in prompts(tok, n, 32):
        engine.add_request(p, params)
    while any(s.num_computed < len(s.prompt_ids) for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    if scenario != "mixed":
        return None, n
    extra = iter(prompts(tok, 200, 128, offset=50_000))

    def before_step():
        engine.add_request(next(extra), SamplingParams(max_new_tokens=1, ignore_eos=True))
    return before_step, n


def finish(engine) -> None:
    for rid, seq in list(engine.requests.items()):
        if not seq.status.done:
            engine.abort(rid)
    engine.requests.clear()


def run_scenario(opt, tok, scenario: str, steps: int, repeats: int) -> dict:
    engine = opt.engine
    ph = Phases(engine)
    try:
        before, rows = setup(engine, tok, scenario, new_tokens=steps * (repeats + 3) + 8)
        samples = []
        for i in range(repeats + 1):
            run = []
            for _ in range(steps):
                if before:
                    before()
                run.append(ph.step())
            if i:  # the first run warms up
                samples.extend(run)
        med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
        ctx = statistics.mean(s.num_computed for s in engine.scheduler.running)
        ph.profiling = True
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            prof_steps = []
            for _ in range(steps):
                if before:
                    before()
                prof_steps.append(ph.step())
        ph.profiling = False
        cats, ops, n_ops = op_breakdown(prof, steps)
    finally:
        ph.remove()
        finish(engine)
    # the profiler slows every op (and a loaded machine moves any run): the profiled run gives the graph's
    # split, applied to the unprofiled median graph time, so the parts add up to the step they divide
    scale = med["graph"] / max(statistics.mean(s["graph"] for s in prof_steps), 1e-12)
    cats = {c: v * scale for c, v in cats.items()}
    ops = {o: v * scale for o, v in ops.items()}
    out = {k: med[k] for k in ("scheduler", "sampling", "runner_prep", "bookkeeping")}
    out.update({c: cats.get(c, 0.0) for c in ("gemm", "attention", "norm_rotary_act", "other_ops")})
    out["graph_python"] = max(0.0, med["graph"] - sum(cats.values()))
    return {"scenario": scenario, "rows": rows, "step_s": med["step"], "graph_s": med["graph"],
            "profiled_step_s": statistics.median(s["step"] for s in prof_steps), "mean_context": ctx,
            "parts_s": out, "ops_per_step": n_ops, "top_ops_s": dict(list(ops.items())[:12])}


# -- roofline figures -----------------------------------------------------------------------------
def model_shapes(model) -> dict:
    head = model.get_output_embeddings().weight.numel()
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return {"decoder_linear_params": linears - head, "head_params": head}


def roofline(res: dict, shapes: dict, weight_bytes: int, kv_bytes_per_token: int, bw: float, peak: float) -> dict:
    t = res["step_s"]
    rows = res["rows"]
    tokens = rows + (128 if res["scenario"] == "mixed" else 0)
    flops = 2 * shapes["decoder_linear_params"] * tokens + 2 * shapes["head_params"] * (rows + (res["scenario"] == "mixed"))
    read = weight_bytes + kv_bytes_per_token * res["mean_context"] * rows
    gemm_t = res["parts_s"]["gemm"]
    return {"bytes_read_per_step": read, "bytes_per_token": read / rows, "read_GBps": read / t / 1e9,
            "read_roofline_share": read / t / bw, "step_GFLOPs": flops / t / 1e9,
            "gemm_GFLOPs": flops / gemm_t / 1e9 if gemm_t else None,
            "gemm_peak_share": flops / gemm_t / peak if gemm_t else None, "step_peak_share": flops / t / peak,
            "tok_s": rows / t}


def markdown(results: list[dict]) -> str:
    head = ("| model | scenario | step ms | tok/s | ops/step | " + " | ".join(LABELS[c] for c in CATEGORIES) +
            " | bytes/token | read roofline | GEMM GFLOP/s (share of peak) | step share of GEMM peak |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        rf, t = r["roofline"], r["step_s"]
        parts = " | ".join(f"{r['parts_s'][c] * 1e3:.2f} ({r['parts_s'][c] / t:.0%})" for c in CATEGORIES)
        g = f"{rf['gemm_GFLOPs']:.0f} ({rf['gemm_peak_share']:.0%})" if rf["gemm_GFLOPs"] else "-"
        lines.append(f"| {r['model']} | {r['scenario']} | {t * 1e3:.2f} | {rf['tok_s']:.1f} | {r['ops_per_step']:.0f} | {parts} | "
                     f"{rf['bytes_per_token'] / 1e6:.1f} MB | {rf['read_roofline_share']:.0%} "
                     f"({rf['read_GBps']:.1f} GB/s) | {g} | {rf['step_peak_share']:.1%} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--int4", action="store_true", help="also bf16 with INT4 weights (RTN, group 64)")
    ap.add_argument("--scenarios", nargs="+", default=["b1", "b64", "mixed"])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--base", nargs="*", default=[], metavar="OPTION=VALUE",
                    help="also profile with these optimize() options (a before/after in one run)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "profile.json"))
    args = ap.parse_args()
    base = parse_options(args.base)
    mach = cpu_info()
    bw = read_bandwidth()
    peaks = {d: gemm_peak(parse_dtype(d)) for d in sorted(set(args.dtypes) | ({"bfloat16"} if args.int4 else set()))}
    print(f"{mach['cpu']} ({', '.join(mach['isa'])}), {mach['threads']} threads, load {mach['loadavg']}, "
          f"OMP_WAIT_POLICY={mach['omp_wait_policy']}")
    print(f"read bandwidth {bw / 1e9:.1f} GB/s; GEMM peak " +
          ", ".join(f"{d} {p / 1e9:.0f} GFLOP/s" for d, p in peaks.items()), flush=True)
    models = [(d, d, {}) for d in args.dtypes]
    if args.int4:
        models.append(("bf16+int4", "bfloat16", {"quantization": {"method": "rtn", "group_size": 64,
                                                                  "progress": False}}))
    results = []
    for label, dtype, kw in models:
        model, tok = load_model(None, parse_dtype(dtype))
        shapes = model_shapes(model)
        variants = [(f"{label} (base)", {**kw, **base})] if base else []
        variants.append((label, kw))
        opts = []
        for name, vkw in variants:
            opt = devin_compile.optimize(model, tokenizer=tok, max_num_seqs=80, **vkw)
            opt.wait_until_ready()
            runner = opt.engine.runner
            graph = runner.program.graphs.get("decode") or runner.program.graphs["main"]
            opts.append((name, opt, held_bytes(held_tensors(graph)), runner.kv_cache.spec.bytes_per_token))
        for sc in args.scenarios:
            for name, opt, wbytes, kvb in opts:
                res = run_scenario(opt, tok, sc, args.steps, args.repeats)
                res["model"] = name
                res["roofline"] = roofline(res, shapes, wbytes, kvb, bw, peaks[dtype])
                results.append(res)
                print(markdown([res]).splitlines()[-1], flush=True)
        del opts, model
    table = markdown(results)
    print("\n" + table)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "base_options": base, "machine": mach,
                   "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "loadavg_end": os.getloadavg(),
                   "read_bandwidth_Bps": bw, "gemm_peak_flops": peaks, "results": results, "table": table},
                  f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
