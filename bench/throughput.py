"""Offline throughput on a workload file: devin-compile vs HF padded batches vs HF continuous batching.

    python bench/throughput.py [--workload ../shared/workloads/mixed-64.jsonl] [--dtype bfloat16]
                               [--peers hf_cb hf_padded] [--prefix-caching on|off|both]
                               [--step-mode mixed|separate|both] [--breakdown]

Every engine generates exactly each request's ``max_new_tokens`` (EOS ignored), greedy,
same dtype, same process. Reported: generated tokens/s, prompt tokens/s, p50/p99 time
to first token (devin-compile: all requests submitted at t=0), and the ratios against
each peer. Writes bench/results/throughput-<workload>-<dtype>.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import devin_compile  # noqa: E402
from devin_compile import SamplingParams  # noqa: E402
from devin_compile.runtime import arena_reuse  # noqa: E402
from devin_compile.config import parse_dtype  # noqa: E402
from devin_compile.models import load_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_WORKLOAD = os.path.join(HERE, "..", "..", "shared", "workloads", "mixed-64.jsonl")


def load_workload(path: str, tok) -> list[tuple[list[int], int]]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(tok(r["prompt"], add_special_tokens=False)["input_ids"], int(r["max_new_tokens"])) for r in rows]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_devin(opt, work) -> dict:
    engine = opt.engine
    engine.reset_prefix_cache()
    engine.metrics = type(engine.metrics)()
    t0 = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in work]
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - t0
    seqs = [engine.requests[i] for i in ids]
    ttft = [s.metrics.first_token - t0 for s in seqs]
    m = engine.metrics
    return {"wall_s": wall, "generated": sum(len(s.output_ids) for s in seqs), "ttft": ttft,
            "outputs": [s.output_ids for s in seqs], "kv": engine.kv_stats(),
            "steps": {"steps": m.steps, "prefill_s": m.prefill_time, "decode_s": m.decode_time,
                      "prefill_tokens": m.prefill_tokens, "decode_tokens": m.decode_tokens,
                      "preemptions": m.preemptions}}


def step_breakdown(opt, work) -> dict:
    """Where a step's time goes, from torch.profiler over a run of ``work``: attention
    (devin::paged_attention, incl. KV writes), linear layers (oneDNN/aten GEMMs outside
    attention), the other graph ops, sampling, and the scheduler + Python bookkeeping."""
    from torch.profiler import ProfilerActivity, profile, record_function

    engine = opt.engine
    sched, runner = engine.scheduler, engine.runner
    orig = (sched.schedule, runner.execute, engine._sample)

    def wrap(fn, label):
        def inner(*a, **k):
            with record_function(label):
                return fn(*a, **k)
        return inner

    sched.schedule, runner.execute, engine._sample = (wrap(orig[0], "bd::schedule"), wrap(orig[1], "bd::execute"),
                                                      wrap(orig[2], "bd::sample"))
    try:
        engine.reset_prefix_cache()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for p, n in work:
                engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
            wall = time.perf_counter() - t0
    finally:
        sched.schedule, runner.execute, engine._sample = orig
    total = {e.key: e.cpu_time_total for e in prof.key_averages()}
    self_t = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    us = 1e-6
    attention = total.get("devin::paged_attention", 0) * us
    linear = sum(self_t.get(k, 0) for k in ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::linear",
                                            "aten::_weight_int4pack_mm_for_cpu", "devin::int4_linear")) * us
    execute = total.get("bd::execute", 0) * us
    sample = total.get("bd::sample", 0) * us
    schedule = total.get("bd::schedule", 0) * us
    parts = {"attention": attention, "linear": linear, "other_graph_ops": max(0.0, execute - attention - linear),
             "sampling": sample, "scheduler": schedule}
    parts["python_and_bookkeeping"] = max(0.0, wall - sum(parts.values()))
    return {"profiled_wall_s": wall, "requests": len(work),
            "fractions": {k: v / wall for k, v in parts.items()}, "seconds": parts}


def roofline(model, work, bytes_per_token: int, dtype: torch.dtype, steps: int) -> dict:
    """A lower bound on the run time from this CPU's limits (2.4 TFLOP/s bf16 matmul, 27 GB/s):
    GEMM FLOPs for every token, and bytes = weights once per step + every decode step's KV reads."""
    elt = torch.empty((), dtype=dtype).element_size()
    emb = model.get_input_embeddings().weight
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head = model.get_output_embeddings().weight.numel()
    decoder = linear_params - head
    prompt = sum(len(p) for p, _ in work)
    gen = sum(n for _, n in work)
    flops = 2 * decoder * (prompt + gen) + 2 * head * gen
    kv_read = sum(sum(len(p) + i for i in range(n)) for p, n in work) * bytes_per_token
    weight_bytes = (decoder + head) * elt
    bytes_ = weight_bytes * steps + kv_read
    return {"flop_bound_s": flops / 2.4e12, "bandwidth_bound_s": bytes_ / 27e9,
            "lower_bound_s": max(flops / 2.4e12, bytes_ / 27e9), "flops": flops, "bytes": bytes_,
            "embedding_params": emb.numel()}


def _no_eos_config(model, n: int):
    gc = copy.deepcopy(model.generation_config)
    gc.max_new_tokens = n
    gc.do_sample = False
    gc.eos_token_id = None
    gc.pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    return gc


def run_hf_padded(model, work, batch: int = 8) -> dict:
    """HF generate over batches of 8 in arrival order, left-padded; each batch runs to its longest request."""
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    t0 = time.perf_counter()
    ttft, generated = [], 0
    with torch.inference_mode():
        for i in range(0, len(work), batch):
            chunk = work[i:i + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.full((len(chunk), width), pad)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for r, (p, _) in enumerate(chunk):
                ids[r, width - len(p):] = torch.tensor(p)
                mask[r, width - len(p):] = 1
            n = max(m for _, m in chunk)
            b0 = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=pad)
            assert out.shape[1] == width + n, "HF stopped early; the comparison would be unfair"
            ttft.extend([b0 - t0] * len(chunk))  # lower bound: tokens of a batch appear after its prefill
            generated += sum(m for _, m in chunk)  # useful tokens only (each request's own max_new_tokens)
    return {"wall_s": time.perf_counter() - t0, "generated": generated, "ttft": ttft}


def run_hf_cb(model, work) -> dict:
    """HF's own continuous batching manager, per-request max_new_tokens."""
    manager = model.init_continuous_batching(generation_config=_no_eos_config(model, max(n for _, n in work)))
    manager.start()
    t0 = time.perf_counter()
    rids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, record_timestamps=True)
            for i, (p, n) in enumerate(work)]
    done: dict[str, object] = {}
    while len(done) < len(rids):
        res = manager.get_result(timeout=1.0)
        if res is not None and res.is_finished():
            done[res.request_id] = res
    wall = time.perf_counter() - t0
    manager.stop(block=True)
    generated = sum(len(r.generated_tokens) for r in done.values())
    ttft = []
    for r in done.values():
        stamps = getattr(r, "timestamps", None)
        if stamps:
            ttft.append(stamps[0] - getattr(r, "created_time", t0) if getattr(r, "created_time", None) else stamps[0] - t0)
    return {"wall_s": wall, "generated": generated, "ttft": ttft}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default=DEFAULT_WORKLOAD)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--peers", nargs="*", default=["hf_cb", "hf_padded"])
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--prefix-caching", choices=["on", "off", "both"], default="on",
                    help="'both' also runs devin-compile with prefix caching off (row devin_nocache)")
    ap.add_argument("--step-mode", choices=["mixed", "separate", "both"], default="mixed",
                    help="'both' also runs separate prefill-only / decode-only steps (row devin_separate)")
    ap.add_argument("--breakdown", action="store_true",
                    help="profile a second devin run and report where step time goes")
    args = ap.parse_args()
    arena_reuse.install()  # before any peer runs: HF and devin-compile on the same interpreter

    dtype = parse_dtype(args.dtype)
    model, tok = load_model(None, dtype)
    work = load_workload(args.workload, tok)
    prompt_tokens = sum(len(p) for p, _ in work)
    results = {}
    variants = [("devin", True, "mixed" if args.step_mode != "separate" else "separate")]
    if args.prefix_caching == "both":
        variants.append(("devin_nocache", False, variants[0][2]))
    elif args.prefix_caching == "off":
        variants = [("devin_nocache", False, variants[0][2])]
    if args.step_mode == "both":
        variants.append(("devin_separate", args.prefix_caching != "off", "separate"))
    opt = None
    for label, caching, mode in variants:
        opt = devin_compile.optimize(model, tokenizer=tok, max_num_seqs=args.max_num_seqs,
                                     max_num_batched_tokens=args.max_num_batched_tokens,
                                     enable_prefix_caching=caching, step_mode=mode)
        opt.wait_until_ready()  # a backend compiling in the background must not share the CPU with timing
        run_devin(opt, work[:4])  # warm-up
        results[label] = run_devin(opt, work)
    breakdown = step_breakdown(opt, work) if args.breakdown else None
    for peer in args.peers:
        fn = {"hf_cb": run_hf_cb, "hf_padded": run_hf_padded}[peer]
        try:
            results[peer] = fn(model, work)
        except Exception as e:  # noqa: BLE001  (a peer that cannot run is reported, not fatal)
            results[peer] = {"error": f"{type(e).__name__}: {e}"}
    name = os.path.splitext(os.path.basename(args.workload))[0]
    print(f"\n{name}: {len(work)} requests, {prompt_tokens} prompt tokens, "
          f"{sum(n for _, n in work)} new tokens, {args.dtype}, {torch.get_num_threads()} threads")
    print(f"{'engine':12} {'gen tok/s':>10} {'prompt tok/s':>13} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'wall s':>8}")
    table = {}
    for label, r in results.items():
        if "error" in r:
            print(f"{label:12} failed: {r['error']}")
            table[label] = {"error": r["error"]}
            continue
        row = {"gen_tok_s": r["generated"] / r["wall_s"], "prompt_tok_s": prompt_tokens / r["wall_s"],
               "ttft_p50_ms": 1e3 * statistics.median(r["ttft"]) if r["ttft"] else None,
               "ttft_p99_ms": 1e3 * _pct(r["ttft"], 0.99) if r["ttft"] else None, "wall_s": r["wall_s"]}
        table[label] = row
        p50 = f"{row['ttft_p50_ms']:12.0f}" if row["ttft_p50_ms"] is not None else f"{'-':>12}"
        p99 = f"{row['ttft_p99_ms']:12.0f}" if row["ttft_p99_ms"] is not None else f"{'-':>12}"
        print(f"{label:12} {row['gen_tok_s']:10.1f} {row['prompt_tok_s']:13.1f} {p50} {p99} {row['wall_s']:8.1f}")
    ours = "devin" if "devin" in table else "devin_nocache"
    for peer in [*args.peers, "devin_nocache", "devin_separate"]:
        if peer != ours and "gen_tok_s" in table.get(peer, {}):
            print(f"{ours} / {peer}: {table[ours]['gen_tok_s'] / table[peer]['gen_tok_s']:.2f}x generated tokens/s")
    for label in ("devin", "devin_nocache", "devin_separate"):
        if label in results:
            kv = results[label]["kv"]
            table[label]["kv"] = {k: kv[k] for k in ("blocks_total", "blocks_used_peak", "bytes_per_token", "pool_bytes",
                                                     "prefix_hit_tokens", "mean_live_slot_fraction",
                                                     "attention_padding_waste")}
            table[label]["steps"] = results[label]["steps"]
            table[label]["ttft_mean_ms"] = 1e3 * statistics.mean(results[label]["ttft"])
            print(f"{label} KV: {table[label]['kv']}, mean TTFT {table[label]['ttft_mean_ms']:.0f} ms")
            print(f"{label} steps: {table[label]['steps']}")
    ours_steps = results[ours]["steps"]["steps"]
    bound = roofline(model, work, results[ours]["kv"]["bytes_per_token"], dtype, ours_steps)
    bound["measured_s"] = table[ours]["wall_s"]
    bound["gap"] = table[ours]["wall_s"] / bound["lower_bound_s"]
    table["roofline"] = bound
    print(f"machine limit for this run ({ours_steps} steps): >= {bound['lower_bound_s']:.1f} s "
          f"(FLOPs {bound['flop_bound_s']:.1f} s, bytes {bound['bandwidth_bound_s']:.1f} s); measured "
          f"{bound['measured_s']:.1f} s = {bound['gap']:.1f}x the bound")
    if breakdown is not None:
        table["breakdown"] = breakdown
        print("step time breakdown (profiled run, " + f"{breakdown['profiled_wall_s']:.1f} s): " +
              ", ".join(f"{k} {100 * v:.0f}%" for k, v in breakdown["fractions"].items()))
    out = os.path.join(HERE, "results", f"throughput-{name}-{args.dtype}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "requests": len(work), "prompt_tokens": prompt_tokens,
                   "dtype": args.dtype, "results": table}, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
