"""KV-cache pruning quality, memory and speed on SmolLM2 (real weights), pruned vs full.

    python bench/kv_prune.py [--samples 4] [--copy-samples 4] [--new-tokens 256]
                             [--budgets 0.75 0.5 0.25] [--thresholds 0.05 0.3] [--dtype float32]

Two tasks, every configuration on the same requests through the same engine:

- **long-8** (``../shared/workloads/long-8.jsonl``, ~3000-token tinyshakespeare prompts): the
  true next ``--new-tokens`` tokens of the text (the tinyshakespeare text right after the
  prompt) are teacher-forced through the engine (a logits processor records
  ``-log p(true token)`` and forces it); reported: mean NLL, perplexity, its change vs full.
- **copy**: a 40-token passage (from a distant part of tinyshakespeare) planted at a random
  depth (10-90%) in ~2000 tokens of text; the prompt ends with the passage's first 10 tokens;
  score = fraction of the next 30 greedy tokens equal to the passage's tokens 10..39.

Configurations: ``full`` (no pruning); for each budget ``b`` in ``--budgets`` (kept live
tokens / positions, i.e. KV memory cut by ``1 - b``), the same ``max_ratio=b`` cap with the
attention-score policy in every layer (``attention``, ``recency_layers=0``), StreamingLLM
(``streaming``: sinks + recent window), ``random`` eviction, and the hybrid (``hybrid{r}``:
attention scores, except that the first fraction ``r`` of the layers, ``--recency-layers``,
evict their oldest tokens; 0.5 is the default policy), all with ``sink_tokens=4``,
``recent_tokens=64``, ``step_interval=2`` and ``threshold=0``, so memory is the same across
them and only the choice of tokens differs; plus threshold-only runs (``--thresholds``, no cap,
the default ``recency_layers``) with the memory they reach. Memory: mean live KV tokens over
the decode steps (relative to full), peak KV blocks of the request (includes the unpruned
prefill, which decode pruning does not touch) and the decode-phase peak. Decode tok/s: decode time of each run (a single request, so
every decode step is one token). The prompt's blocks are prefix-cached after the first run,
so later runs skip most of the prefill; pruning copies those shared blocks before it
compacts them, so cached entries stay valid. Writes bench/results/kv_prune.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import devin_compile  # noqa: E402
from devin_compile.config import parse_dtype  # noqa: E402
from devin_compile.models import load_model  # noqa: E402
from devin_compile.runtime.sampling import SamplingParams  # noqa: E402

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared")
WORKLOAD = os.path.join(SHARED, "workloads", "long-8.jsonl")
TEXT = os.path.join(SHARED, "data", "tinyshakespeare.txt")


def configs(budgets, thresholds, window, pool=1, threshold_pool=1, ablation=False, recency=()):
    out = [("full", None)]
    common = dict(sink_tokens=4, recent_tokens=64, step_interval=2, threshold=0.0, prefill_window=window)
    for b in budgets:
        for policy in ("attention", "streaming", "random"):
            extra = {"pool_kernel": pool, "recency_layers": 0.0} if policy == "attention" else {}
            out.append((f"{policy}@{b:g}", dict(common, policy=policy, max_ratio=b, **extra)))
        for r in recency:  # attention scores in the later layers, recency in the first fraction r
            out.append((f"hybrid{r:g}@{b:g}", dict(common, policy="attention", max_ratio=b, pool_kernel=pool,
                                                   recency_layers=r)))
    if 0.5 in budgets and window and ablation:
        out.append(("attention-decode-only@0.5", dict(common, max_ratio=0.5, prefill_window=0)))
    for t in thresholds:
        out.append((f"threshold={t:g}", dict(common, threshold=t, pool_kernel=threshold_pool)))
    return out


def run_one(engine, ids, params, forced=None, observe=None):
    """One request alone; returns (output ids, per-step NLLs, live-slot samples, metrics, decode s, decode tokens)."""
    nll, live = [], []
    rid_box = {}

    def proc(tokens, row):
        seq = engine.requests[rid_box["rid"]]
        live.append(seq.num_slots)
        if observe is not None:
            observe(tokens, row)
        if forced is None:
            return row
        k = len(nll)
        lp = torch.log_softmax(row.float(), dim=-1)
        nll.append(-float(lp[forced[k]]))
        out = torch.full_like(row, float("-inf"))
        out[forced[k]] = 0.0
        return out

    params.logits_processors = [proc]
    engine.kv.allocator.peak_used = engine.kv.allocator.num_used
    m0 = (engine.metrics.decode_time, engine.metrics.decode_tokens)
    rid = engine.add_request(ids, params)
    rid_box["rid"] = rid
    while not engine.requests[rid].status.done:
        engine.step()
    seq = engine.requests[rid]
    if seq.error:
        raise RuntimeError(seq.error)
    dt = engine.metrics.decode_time - m0[0]
    dn = engine.metrics.decode_tokens - m0[1]
    return seq.output_ids, nll, live, seq.metrics, dt, dn, engine.kv.allocator.peak_used


def copy_task(tok, text, n, seed):
    rng = random.Random(seed)
    ids_all = tok(text[:600_000], add_special_tokens=False)["input_ids"]
    tasks = []
    for _ in range(n):
        h0 = rng.randrange(0, len(ids_all) // 2 - 2100)
        hay = ids_all[h0:h0 + 2000]
        p0 = rng.randrange(len(ids_all) // 2, len(ids_all) - 50)  # far from the haystack
        passage = ids_all[p0:p0 + 40]
        depth = rng.randrange(200, 1800)
        prompt = hay[:depth] + passage + hay[depth:] + passage[:10]
        tasks.append((prompt, passage[10:40], depth))
    return tasks


def summarize(cfgs, results) -> list[dict]:
    """Per configuration: means over samples (memory ratios paired with the full run of the same sample)."""
    full_long = {x["sample"]: x for x in results.get("full", {}).get("long", [])}
    full_copy = {x["sample"]: x for x in results.get("full", {}).get("copy", [])}
    summary = []
    for name, cfg in cfgs:
        L, C = results[name]["long"], results[name]["copy"]
        row = {"config": name, "kv_prune": cfg, "long_samples": len(L), "copy_samples": len(C)}
        if L and full_long:
            nll = statistics.fmean(x["nll"] for x in L)
            full_nll = statistics.fmean(full_long[x["sample"]]["nll"] for x in L)
            row.update({
                "nll": nll, "ppl": math.exp(nll), "ppl_change": math.exp(nll - full_nll) - 1,
                "kv_memory_vs_full": statistics.fmean(x["mean_live_tokens"] / full_long[x["sample"]]["mean_live_tokens"]
                                                      for x in L),
                "peak_blocks": statistics.median(x["peak_blocks"] for x in L),
                "decode_peak_blocks": statistics.median(x["decode_peak_blocks"] for x in L),
                "decode_tok_s": statistics.median(x["decode_tok_s"] for x in L),
            })
        if C and full_copy:
            row["copy_score"] = statistics.fmean(x["score"] for x in C)
            g = [x["greedy_score"] for x in C if x["greedy_score"] is not None]
            row["copy_greedy_score"] = statistics.fmean(g) if g else float("nan")
            row["copy_kv_memory_vs_full"] = statistics.fmean(
                x["mean_live_tokens"] / full_copy[x["sample"]]["mean_live_tokens"] for x in C)
        summary.append(row)
    return summary


def print_summary(summary, speed_rows) -> None:
    nan = float("nan")
    print("\n| config | KV mem vs full (long) | NLL | ppl | ppl change | copy (teacher-forced) | copy (greedy) | "
          "KV mem (copy) | peak blocks | decode peak blocks | decode tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in summary:
        print(f"| {s['config']} | {s.get('kv_memory_vs_full', nan):.2f} | {s.get('nll', nan):.4f} | "
              f"{s.get('ppl', nan):.3f} | {100 * s.get('ppl_change', nan):+.2f}% | "
              f"{s.get('copy_score', nan):.3f} | {s.get('copy_greedy_score', nan):.3f} | "
              f"{s.get('copy_kv_memory_vs_full', nan):.2f} | "
              f"{s.get('peak_blocks', nan):.0f} | {s.get('decode_peak_blocks', nan):.0f} | "
              f"{s.get('decode_tok_s', nan):.1f} |")
    for name, v in speed_rows.items():
        print(f"speed {name}: median {v['decode_tok_s_median']:.1f} decode tok/s over {len(v['runs'])} alternated runs")


def merge(paths: list[str], out: str) -> None:
    """Combine shard outputs (different samples / tasks of the same configurations) into one result."""
    parts = [json.load(open(p)) for p in paths]
    cfgs, results, speed = [], {}, {}
    for part in parts:
        for row in part["summary"]:
            if row["config"] not in results:
                cfgs.append((row["config"], row["kv_prune"]))
                results[row["config"]] = {"long": [], "copy": []}
        for name, r in part["runs"].items():
            results[name]["long"] += r["long"]
            results[name]["copy"] += r["copy"]
        for name, v in part.get("speed", {}).items():
            speed.setdefault(name, []).extend(v["runs"])
    speed_rows = {name: {"decode_tok_s_median": statistics.median(v), "runs": v} for name, v in speed.items()}
    summary = summarize(cfgs, results)
    print_summary(summary, speed_rows)
    with open(out, "w") as f:
        json.dump({"commands": [p["command"] for p in parts], "machine": parts[0]["machine"],
                   "threads": parts[0]["threads"], "dtype": parts[0]["dtype"],
                   "attention_backend": parts[0]["attention_backend"],
                   "note": "2-core CPU shared with other agents' jobs (load average 5-7) and run as parallel shards: "
                           "timings measured under heavy contention",
                   "speed_setup": next((p["speed_setup"] for p in parts if p.get("speed")), None),
                   "summary": summary, "speed": speed_rows, "runs": results}, f, indent=2)
    print(f"\nwrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--copy-samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.75, 0.5, 0.25])
    ap.add_argument("--thresholds", type=float, nargs="*", default=[0.05, 0.3])
    ap.add_argument("--window", type=int, default=32, help="prefill_window (SnapKV observation window) of the pruned runs")
    ap.add_argument("--pool", type=int, default=32, help="pool_kernel of the attention runs")
    ap.add_argument("--recency-layers", type=float, nargs="*", default=[0.5],
                    help="hybrid runs: attention policy with this fraction of the first layers evicting by recency")
    ap.add_argument("--threshold-pool", type=int, default=1,
                    help="pool_kernel of the threshold-only runs (pooling raises scores, so it cuts less per threshold)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: OpenMP barriers on a busy 2-core box cost ms)")
    ap.add_argument("--configs", nargs="*", default=None, help="run only these configuration names")
    ap.add_argument("--speed-repeats", type=int, default=4,
                    help="decode tok/s phase: full / attention@0.5 / streaming@0.5 / the first hybrid@0.5 "
                         "alternated this many times")
    ap.add_argument("--speed-tokens", type=int, default=64)
    ap.add_argument("--long-offset", type=int, default=0, help="first long-8 sample (to shard runs)")
    ap.add_argument("--copy-offset", type=int, default=0, help="first copy-task sample (to shard runs)")
    ap.add_argument("--merge", nargs="+", default=None, help="merge these shard outputs into --out and exit")
    ap.add_argument("--kv-blocks", type=int, default=320, help="KV pool blocks (16 tokens each)")
    ap.add_argument("--ablation", action="store_true", help="also run attention scores from decode steps only")
    ap.add_argument("--greedy-configs", nargs="*", default=["full", "attention@0.5", "streaming@0.5", "random@0.5",
                                                            "hybrid0.5@0.5"],
                    help="configurations whose copy task also runs free-running greedy (each costs a prefill)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "kv_prune.json"))
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge, args.out)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model, tok = load_model(None, parse_dtype(args.dtype))
    # No prefix caching: every run prefills cold, so decode tok/s compares like with like
    # (copied shared blocks would also break the single-view fast path of CPU decode).
    opt = devin_compile.optimize(model, tokenizer=tok, num_kv_blocks=args.kv_blocks, max_model_len=4096,
                                 kv_prune={"enabled": False}, enable_prefix_caching=False)
    opt.wait_until_ready()
    engine = opt.engine
    bs = engine.runner.block_size
    text = open(TEXT).read()
    rows = [json.loads(line) for line in open(WORKLOAD)][args.long_offset:args.long_offset + args.samples]
    cfgs = configs(args.budgets, args.thresholds, args.window, args.pool, args.threshold_pool, args.ablation,
                   args.recency_layers)
    if args.configs:
        cfgs = [c for c in cfgs if c[0] in args.configs]
    results: dict[str, dict] = {name: {"long": [], "copy": []} for name, _ in cfgs}

    for i, r in enumerate(rows):
        start = text.find(r["prompt"])
        if start < 0:
            raise SystemExit(f"{r['id']}: prompt not found in tinyshakespeare")
        ids = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        cont = tok(text[start + len(r["prompt"]):start + len(r["prompt"]) + 4000],
                   add_special_tokens=False)["input_ids"][:args.new_tokens]
        for name, cfg in cfgs:
            t0 = time.perf_counter()
            out, nll, live, m, dt, dn, peak = run_one(
                engine, ids, SamplingParams(max_new_tokens=len(cont), kv_prune=cfg or False), forced=cont)
            dec_live = live[1:]  # samples taken after each decode step
            rec = {"sample": r["id"], "prompt_tokens": len(ids), "nll": statistics.fmean(nll),
                   "mean_live_tokens": statistics.fmean(dec_live), "final_live_tokens": live[-1],
                   "peak_blocks": peak, "decode_peak_blocks": max(math.ceil(x / bs) for x in dec_live),
                   "evicted_tokens": m.kv_evicted_tokens, "freed_blocks": m.kv_freed_blocks,
                   "decode_tok_s": dn / dt if dt > 0 else float("nan")}
            results[name]["long"].append(rec)
            print(f"long {r['id']} {name:16s} nll {rec['nll']:.4f} live {rec['mean_live_tokens']:.0f} "
                  f"peak {peak} blocks, decode {rec['decode_tok_s']:.1f} tok/s ({time.perf_counter() - t0:.1f} s)",
                  flush=True)
    tasks = copy_task(tok, text, args.copy_offset + args.copy_samples, args.seed)[args.copy_offset:]
    for j, (prompt, target, depth) in enumerate(tasks, start=args.copy_offset):
        for name, cfg in cfgs:
            # teacher-forced: each of the 30 tokens predicted (argmax) given the true preceding ones
            hits = []

            def argmax_hit(tokens, row, hits=hits):
                hits.append(int(row.argmax()) == target[len(hits)])
                return row

            _, _, live, m, dt, dn, peak = run_one(
                engine, prompt, SamplingParams(max_new_tokens=len(target), kv_prune=cfg or False),
                forced=target, observe=argmax_hit)
            forced_score = sum(hits) / len(target)
            # free running: greedy tokens compared position by position (one miss derails the rest)
            greedy = None
            if name in args.greedy_configs:
                out, _, _, _, _, _, _ = run_one(engine, prompt, SamplingParams(max_new_tokens=len(target),
                                                                               kv_prune=cfg or False))
                greedy = sum(a == b for a, b in zip(out, target)) / len(target)
            results[name]["copy"].append({"sample": j, "depth": depth, "prompt_tokens": len(prompt),
                                          "score": forced_score, "greedy_score": greedy,
                                          "mean_live_tokens": statistics.fmean(live[1:])})
            print(f"copy {j} {name:16s} teacher-forced {forced_score:.2f} greedy {greedy} "
                  f"live {statistics.fmean(live[1:]):.0f}", flush=True)

    # Decode speed at ~3000 context: configurations alternated, so load drift hits them alike.
    speed: dict[str, list] = {}
    speed_names = ["full", "attention@0.5", "streaming@0.5"] + [f"hybrid{r:g}@0.5" for r in args.recency_layers[:1]]
    speed_cfgs = [c for c in configs([0.5], [], args.window, args.pool, recency=args.recency_layers)
                  if c[0] in speed_names]
    first = json.loads(open(WORKLOAD).readline())
    ids0 = tok(first["prompt"], add_special_tokens=False)["input_ids"] if args.speed_repeats else None
    for rep in range(args.speed_repeats if ids0 else 0):
        for name, cfg in speed_cfgs:
            _, _, live, _, dt, dn, _ = run_one(engine, ids0, SamplingParams(max_new_tokens=args.speed_tokens,
                                                                            kv_prune=cfg or False, ignore_eos=True))
            speed.setdefault(name, []).append(dn / dt)
            print(f"speed rep {rep} {name:16s} {dn / dt:.1f} decode tok/s (live {live[-1]})", flush=True)
    speed_rows = {name: {"decode_tok_s_median": statistics.median(v), "runs": v} for name, v in speed.items()}

    summary = summarize(cfgs, results)
    print_summary(summary, speed_rows)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python"] + sys.argv), "machine": platform.processor() or platform.machine(),
                   "threads": torch.get_num_threads(), "dtype": args.dtype,
                   "attention_backend": engine.runner.backend.name,
                   "note": "2-core CPU shared with other agents' jobs: timings measured under contention",
                   "summary": summary, "speed": speed_rows, "runs": results, "kv_stats": engine.kv_stats(),
                   "speed_setup": {"prompt_tokens": len(ids0) if ids0 else None, "new_tokens": args.speed_tokens}},
                  f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
