"""KV cache tiers under the paged pool: time to first token when an evicted prefix is loaded back, and
the cost when nothing is found.

    python bench/cache_tiers.py [--dtype bfloat16] [--repeats 3] [--waves 4] [--pool-blocks 160] [--quick]

Three comparisons, each configuration run side by side in one process, ``--repeats`` times interleaved
(medians reported, and the ratio of the medians), every engine greedy with EOS ignored:

1. **host tier** (``shared-prefix-32``: 32 requests sharing one 512-token preamble, in ``--waves`` waves
   submitted together): between waves a filler request of random tokens takes the whole pool
   (``--pool-blocks``, too small to keep the preamble), so each wave finds the preamble evicted.
   Mean TTFT with a host LRU tier vs without tiers, over the waves after the first (the first wave is
   cold in both) and over all waves.
2. **replicas sharing Redis**: replica 1 (host LRU + Redis) serves the first wave and the filler (the
   preamble is evicted and published); replica 2, a fresh engine with its own pool and host tier on the
   same Redis, serves the second wave: its TTFT vs a fresh replica without tiers serving that wave.
   The replicas are two engines in this process, sharing nothing but the Redis server.
3. **cost when nothing hits** (``mixed-16``, unrelated prompts, ``--cost-new-tokens`` new tokens each,
   ``max_num_seqs`` 4, a pool that evicts but never preempts): generated tokens/s with host LRU +
   Redis tiers on vs off; every registered block is written through to Redis and every evicted one
   published to the host tier, no lookup finds one. (Replicas sharing a prefix the first one still holds:
   bench/replica_share.py.)

Greedy outputs are compared with a reference run whose pool is large enough to keep the preamble
(so every wave reuses it, as loading it back does): in bf16, recomputing a prefix instead of reusing
it can flip a greedy token, so "off" need not match the reference exactly; tiers must. A redis-server is started
on a free port (no persistence) unless ``--redis-url`` is given. Writes bench/results/cache_tiers.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import devin_compile  # noqa: E402
from devin_compile import SamplingParams  # noqa: E402
from devin_compile.cache import sampled_state_dict_digest  # noqa: E402
from devin_compile.cache.config import coerce  # noqa: E402
from devin_compile.config import parse_dtype  # noqa: E402
from devin_compile.models import load_model  # noqa: E402
from devin_compile.runtime.engine import Engine  # noqa: E402
from devin_compile.runtime.kv_cache import KVCacheSpec, PagedKVCache  # noqa: E402
from devin_compile.runtime.kv_tiers import KVTiers  # noqa: E402
from devin_compile.runtime.model_runner import ModelRunner  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = os.path.join(HERE, "..", "..", "shared", "workloads")


def load_workload(name: str, tok) -> list[tuple[list[int], int]]:
    with open(os.path.join(WORKLOADS, f"{name}.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(tok(r["prompt"], add_special_tokens=False)["input_ids"], int(r["max_new_tokens"])) for r in rows]


def start_redis() -> tuple[subprocess.Popen, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed (apt-get install -y redis-server), or pass --redis-url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", tempfile.gettempdir()], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
    for _ in range(500):
        try:
            if client.ping():
                return proc, f"redis://127.0.0.1:{port}/0"
        except redis.RedisError:
            time.sleep(0.02)
    proc.kill()
    raise SystemExit("redis-server did not start")


class Replicas:
    """Fresh engines over one compiled program: each its own pool and (optionally) its own tiers."""

    def __init__(self, opt, weights_digest: str) -> None:
        self.opt, self.digest = opt, weights_digest

    def engine(self, num_blocks: int, tiers: list[dict] | None = None, **sched) -> Engine:
        info, opt = self.opt.info, self.opt
        spec = KVCacheSpec(info.num_layers, info.num_kv_heads, info.head_dim, info.dtype, opt.optimize_config.cache.block_size)
        pool = PagedKVCache(spec, num_blocks, info.device)
        runner = ModelRunner(opt.program, pool, vocab_size=info.vocab_size, backend=opt.engine.runner.backend,
                             device=info.device)
        kv_tiers = KVTiers.for_model(coerce(tiers), pool, weights_digest=self.digest) if tiers else None
        config = type(opt.optimize_config.scheduler)(**{**vars(opt.optimize_config.scheduler), **sched})
        return Engine(runner, config, max_model_len=info.max_model_len, eos_token_ids=info.eos_token_ids,
                      kv_tiers=kv_tiers)


def run_batch(engine: Engine, work: list[tuple[list[int], int]]) -> dict:
    """Submit ``work`` at once, run it to the end: TTFT per request, outputs, wall time."""
    t0 = time.perf_counter()
    rids = [engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in work]
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - t0
    seqs = [engine.requests[r] for r in rids]
    return {"ttft": [s.metrics.first_token - t0 for s in seqs], "outputs": [s.output_ids for s in seqs],
            "wall_s": wall, "generated": sum(len(s.output_ids) for s in seqs),
            "tier_hit_tokens": sum(s.metrics.tier_hit_tokens for s in seqs),
            "prefix_hit_tokens": sum(s.metrics.prefix_hit_tokens for s in seqs)}


def filler(engine: Engine, vocab: int, seed: int) -> None:
    """Other traffic: one request of random tokens as long as the pool, evicting every cached block."""
    rng = random.Random(seed)
    n = engine.kv.allocator.num_blocks * engine.runner.block_size - 1
    run_batch(engine, [([rng.randrange(1000, vocab - 1000) for _ in range(n)], 1)])


def tier_summary(engine: Engine) -> dict:
    s = engine.kv_stats()
    keep = ("kv_tier_hits", "kv_tier_rejected", "kv_tier_loaded_blocks", "kv_tier_load_ms", "kv_tier_published_blocks",
            "kv_tier_publish_ms")
    out = {k: s[k] for k in keep if k in s}
    if "kv_tiers" in s:
        out["tiers"] = [{k: t[k] for k in ("backend", "hits", "misses", "rejected", "load_ms", "bytes", "errors")}
                        for t in s["kv_tiers"]]
    return out


def shared_prefix(rep: Replicas, waves: list[list], pool: int, tiers: list[dict] | None, vocab: int) -> dict:
    engine = rep.engine(pool, tiers)
    per_wave = []
    for i, wave in enumerate(waves):
        if i:
            filler(engine, vocab, seed=i)
        per_wave.append(run_batch(engine, wave))
    later = [t for w in per_wave[1:] for t in w["ttft"]]
    every = [t for w in per_wave for t in w["ttft"]]
    return {"ttft_mean_later_waves_ms": 1e3 * statistics.mean(later), "ttft_mean_all_waves_ms": 1e3 * statistics.mean(every),
            "ttft_mean_per_wave_ms": [1e3 * statistics.mean(w["ttft"]) for w in per_wave],
            "tier_hit_tokens": sum(w["tier_hit_tokens"] for w in per_wave),
            "prefix_hit_tokens": sum(w["prefix_hit_tokens"] for w in per_wave),
            "outputs": [o for w in per_wave for o in w["outputs"]], "stats": tier_summary(engine)}


def replicas(rep: Replicas, waves: list[list], pool: int, url: str, prefix: str, vocab: int) -> dict:
    tiers = [{"backend": "host_lru", "max_bytes": 2 << 30}, {"backend": "redis", "url": url, "key_prefix": prefix}]
    first = rep.engine(pool, tiers)
    run_batch(first, waves[0])
    filler(first, vocab, seed=0)  # the preamble is evicted into the host tier (Redis got it when it was registered)
    replica = rep.engine(pool, tiers)
    second = run_batch(replica, waves[1])
    alone = run_batch(rep.engine(pool), waves[1])
    return {"second_replica_ttft_mean_ms": 1e3 * statistics.mean(second["ttft"]),
            "no_redis_replica_ttft_mean_ms": 1e3 * statistics.mean(alone["ttft"]),
            "second_replica_tier_hit_tokens": second["tier_hit_tokens"],
            "outputs_identical": second["outputs"] == alone["outputs"], "second_outputs": second["outputs"],
            "first_replica": tier_summary(first),
            "second_replica": tier_summary(replica)}


def no_hits(rep: Replicas, work: list, pool: int, tiers: list[dict] | None) -> dict:
    engine = rep.engine(pool, tiers, max_num_seqs=4)
    r = run_batch(engine, work)
    stats = tier_summary(engine)
    tier_s = (stats.get("kv_tier_publish_ms", 0.0) + stats.get("kv_tier_load_ms", 0.0)) / 1e3
    return {"gen_tok_s": r["generated"] / r["wall_s"], "wall_s": r["wall_s"], "tier_hit_tokens": r["tier_hit_tokens"],
            "tier_time_fraction": tier_s / r["wall_s"], "outputs": r["outputs"], "stats": stats}


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--pool-blocks", type=int, default=160, help="pool for comparisons 1 and 2 (blocks of 16)")
    ap.add_argument("--cost-pool-blocks", type=int, default=272, help="pool for comparison 3")
    ap.add_argument("--cost-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--quick", action="store_true", help="a small check that the bench runs (2 waves of 4, 1 repeat)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cache_tiers.json"))
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop redis-server
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.dtype)
    model, tok = load_model(None, dtype)
    shared = load_workload("shared-prefix-32", tok)
    mixed = [(p, min(n, args.cost_new_tokens)) for p, n in load_workload("mixed-16", tok)]
    if args.quick:
        args.repeats, args.waves = 1, 2
        shared, mixed = shared[:8], [(p, min(n, 4)) for p, n in mixed[:6]]
    size = len(shared) // args.waves
    waves = [shared[i * size:(i + 1) * size] for i in range(args.waves)]
    proc, url = (None, args.redis_url) if args.redis_url else start_redis()
    try:
        opt = devin_compile.optimize(model, tokenizer=tok, num_kv_blocks=args.pool_blocks)
        opt.wait_until_ready()
        rep = Replicas(opt, sampled_state_dict_digest(model.state_dict()))
        vocab = opt.info.vocab_size
        run_batch(rep.engine(args.pool_blocks), shared[:2])  # warm-up
        # reference outputs (untimed): a pool large enough to keep the preamble, so every wave reuses it
        big = rep.engine(args.pool_blocks * args.waves * 4)
        reference = [o for wave in waves for o in run_batch(big, wave)["outputs"]]
        host = [{"backend": "host_lru", "max_bytes": 2 << 30}]
        runs: dict[str, list[dict]] = {k: [] for k in ("off", "host", "replicas", "cost_off", "cost_on")}
        for r in range(args.repeats):
            runs["off"].append(shared_prefix(rep, waves, args.pool_blocks, None, vocab))
            runs["host"].append(shared_prefix(rep, waves, args.pool_blocks, host, vocab))
            runs["replicas"].append(replicas(rep, waves, args.pool_blocks, url, f"bench-{os.getpid()}-{r}:", vocab))
            runs["cost_off"].append(no_hits(rep, mixed, args.cost_pool_blocks, None))
            both = host + [{"backend": "redis", "url": url, "key_prefix": f"bench-cost-{os.getpid()}-{r}:"}]
            runs["cost_on"].append(no_hits(rep, mixed, args.cost_pool_blocks, both))
            summary = summarize(runs, reference, size)
            write(args, size, summary, runs)  # after every repeat, so an interrupted run keeps what it measured
            print(f"repeat {r + 1}/{args.repeats} done", flush=True)
    finally:
        if proc is not None:
            proc.kill()
    h, rp, c = summary["host_tier"], summary["replicas"], summary["no_hits"]
    print(f"\n{args.dtype}, {torch.get_num_threads()} threads, {args.repeats} repeats, {args.waves} waves of {size}, "
          f"pool {args.pool_blocks} blocks")
    print(f"host tier: mean TTFT waves 2+ {h['ttft_mean_later_waves_ms']['off']:.0f} ms off vs "
          f"{h['ttft_mean_later_waves_ms']['host_lru']:.0f} ms host_lru = {h['ttft_ratio_later_waves']:.2f}x; all waves "
          f"{h['ttft_ratio_all_waves']:.2f}x; outputs = reference {h['outputs_identical_to_reference']} "
          f"(off: {h['off_outputs_identical_to_reference']})")
    print(f"replicas: second replica's first wave TTFT {rp['second_replica_ttft_mean_ms']:.0f} ms vs "
          f"{rp['no_redis_replica_ttft_mean_ms']:.0f} ms without Redis = {rp['ttft_ratio']:.2f}x; outputs = reference "
          f"{rp['outputs_identical_to_reference']}")
    print(f"no hits: {c['gen_tok_s']['on']:.1f} vs {c['gen_tok_s']['off']:.1f} generated tok/s = "
          f"{c['throughput_ratio']:.3f}x (tier hits {c['tier_hit_tokens']}; the tiers took {100 * c['tier_time_fraction']:.2f}% "
          f"of the wall time); identical {c['outputs_identical']}")
    print(f"wrote {args.out}")


def summarize(runs: dict[str, list[dict]], reference: list, size: int) -> dict:
    """Medians over the repeats so far, their ratios, and whether outputs matched."""
    off_later, host_later = median_of(runs["off"], "ttft_mean_later_waves_ms"), median_of(runs["host"], "ttft_mean_later_waves_ms")
    off_all, host_all = median_of(runs["off"], "ttft_mean_all_waves_ms"), median_of(runs["host"], "ttft_mean_all_waves_ms")
    second = median_of(runs["replicas"], "second_replica_ttft_mean_ms")
    alone = median_of(runs["replicas"], "no_redis_replica_ttft_mean_ms")
    cost_off, cost_on = median_of(runs["cost_off"], "gen_tok_s"), median_of(runs["cost_on"], "gen_tok_s")
    return {
        "host_tier": {"ttft_mean_later_waves_ms": {"off": off_later, "host_lru": host_later},
                      "ttft_mean_all_waves_ms": {"off": off_all, "host_lru": host_all},
                      "ttft_ratio_later_waves": off_later / host_later, "ttft_ratio_all_waves": off_all / host_all,
                      "outputs_identical_to_off": all(a["outputs"] == b["outputs"] for a, b in zip(runs["off"], runs["host"])),
                      "outputs_identical_to_reference": all(x["outputs"] == reference for x in runs["host"]),
                      "off_outputs_identical_to_reference": all(x["outputs"] == reference for x in runs["off"])},
        "replicas": {"second_replica_ttft_mean_ms": second, "no_redis_replica_ttft_mean_ms": alone,
                     "ttft_ratio": alone / second,
                     "second_replica_tier_hit_tokens": median_of(runs["replicas"], "second_replica_tier_hit_tokens"),
                     "outputs_identical_to_no_redis": all(x["outputs_identical"] for x in runs["replicas"]),
                     "outputs_identical_to_reference": all(x["second_outputs"] == reference[size:2 * size]
                                                           for x in runs["replicas"])},
        "no_hits": {"gen_tok_s": {"off": cost_off, "on": cost_on}, "throughput_ratio": cost_on / cost_off,
                    "tier_hit_tokens": max(x["tier_hit_tokens"] for x in runs["cost_on"]),
                    # time the tiers took inside the run (publishing evicted blocks, lookups that missed) / wall:
                    # a bound on the cost that machine noise cannot blur
                    "tier_time_fraction": median_of(runs["cost_on"], "tier_time_fraction"),
                    "outputs_identical": all(a["outputs"] == b["outputs"] for a, b in zip(runs["cost_off"], runs["cost_on"]))},
    }


def write(args, size: int, summary: dict, runs: dict[str, list[dict]]) -> None:
    drop = ("outputs", "second_outputs")
    slim = {k: [{a: b for a, b in x.items() if a not in drop} for x in v] for k, v in runs.items()}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python", *sys.argv]), "dtype": args.dtype, "threads": torch.get_num_threads(),
                   "repeats_done": len(runs["off"]), "repeats": args.repeats, "waves": args.waves, "wave_size": size,
                   "pool_blocks": args.pool_blocks, "cost_pool_blocks": args.cost_pool_blocks,
                   "cost_new_tokens": args.cost_new_tokens, "summary": summary, "runs": slim}, f, indent=2)

if __name__ == "__main__":
    main()
