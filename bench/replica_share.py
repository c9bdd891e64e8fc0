"""Replicas sharing a prefix through Redis while the first one still holds it (write-through), and the cost
of publishing every registered block on decode throughput.

    python bench/replica_share.py [--dtype bfloat16] [--repeats 3] [--prompt-tokens 1500] [--quick]

Two processes on one redis-server (started on a free port unless ``--redis-url`` is given), SmolLM2 greedy,
EOS ignored:

1. **TTFT.** Process A (a child of this one) serves a ``--prompt-tokens`` prompt (tinyshakespeare text) on a
   fresh engine with a Redis tier and keeps it (nothing is evicted). Then this process, B, serves the same
   prompt on a fresh engine with the same Redis tier, and on a fresh engine without tiers (a process without
   the tier), in alternating order. Per repeat a fresh Redis key prefix; medians over ``--repeats``; the ratio
   of the medians. Texts compared: B with the tier, B without, and A.
2. **Decode throughput, publishing on vs off.** ``--batch`` distinct prompts (``mixed-16``) of
   ``--decode-new-tokens`` tokens each, on an engine with the Redis tier (every registered block written
   through, nothing to hit) and one without tiers, interleaved ``--decode-repeats`` times: decode tokens/s
   (the engine's decode-step time), generated tokens/s over the wall time, and the write-through counters.

Writes bench/results/replica_share.json (after every part), with the machine's load average.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import devin_compile  # noqa: E402
from cache_tiers import Replicas, load_workload, run_batch, start_redis  # noqa: E402
from devin_compile.cache import sampled_state_dict_digest  # noqa: E402
from devin_compile.config import parse_dtype  # noqa: E402
from devin_compile.models import load_model  # noqa: E402

SHAKESPEARE = os.path.join(HERE, "..", "..", "shared", "data", "tinyshakespeare.txt")
MARK = "@@"  # protocol lines between this process and process A start with it


def setup(args) -> tuple[Replicas, object, list[int]]:
    """The compiled model (one per process), a fresh-engine factory and the prompt's token ids."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(None, parse_dtype(args.dtype))
    opt = devin_compile.optimize(model, tokenizer=tok, num_kv_blocks=args.pool_blocks)
    opt.wait_until_ready()
    with open(SHAKESPEARE) as f:
        text = f.read(40_000)
    prompt = tok(text, add_special_tokens=False)["input_ids"][:args.prompt_tokens]
    if len(prompt) < args.prompt_tokens:
        raise SystemExit(f"{SHAKESPEARE} gave {len(prompt)} tokens, fewer than --prompt-tokens {args.prompt_tokens}")
    return Replicas(opt, sampled_state_dict_digest(model.state_dict())), tok, prompt


def redis_tier(url: str, prefix: str) -> list[dict]:
    return [{"backend": "redis", "url": url, "key_prefix": prefix}]


def serve_a(args) -> None:
    """Process A: on each ``serve <prefix>`` line, serve the prompt on a fresh engine with the Redis tier,
    report, and keep the engine (its pool holds the prompt's blocks) until stdin closes."""
    rep, _, prompt = setup(args)
    run_batch(rep.engine(args.pool_blocks), [(prompt[:64], 2)])  # warm-up
    kept = []
    print(MARK, json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        prefix = line.split()[1]
        engine = rep.engine(args.pool_blocks, redis_tier(args.redis_url, prefix))
        r = run_batch(engine, [(prompt, args.new_tokens)])
        depth = engine.kv_stats()["kv_tier_write_through_queue_depth"]
        t0 = time.perf_counter()
        engine.kv.tiers.flush(60)  # normally empty already: the blocks were stored during decode
        s = engine.kv_stats()
        kept.append(engine)
        print(MARK, json.dumps({"ttft_ms": 1e3 * r["ttft"][0], "output": r["outputs"][0],
                                "queue_depth_when_done": depth, "flush_wait_ms": 1e3 * (time.perf_counter() - t0),
                                "blocks_cached": s["blocks_cached"], "prefix_evictions": s["prefix_evictions"],
                                **{k: s[k] for k in s if k.startswith("kv_tier_write_through_")}}), flush=True)


class ProcessA:
    """The child process running :func:`serve_a`."""

    def __init__(self, args) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--role", "a", "--redis-url", args.redis_url,
               "--dtype", args.dtype, "--prompt-tokens", str(args.prompt_tokens), "--new-tokens",
               str(args.new_tokens), "--pool-blocks", str(args.pool_blocks)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.read()

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise SystemExit(f"process A exited (rc {self.proc.wait()}) before answering")

    def serve(self, prefix: str) -> dict:
        self.proc.stdin.write(f"serve {prefix}\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def ttft_part(args, rep: Replicas, a: ProcessA, prompt: list[int]) -> list[dict]:
    runs = []
    for r in range(args.repeats):
        prefix = f"share-{os.getpid()}-{r}:"
        first = a.serve(prefix)
        order = ("tier", "off") if r % 2 == 0 else ("off", "tier")
        got = {}
        for kind in order:
            tiers = redis_tier(args.redis_url, prefix) if kind == "tier" else None
            engine = rep.engine(args.pool_blocks, tiers)
            got[kind] = run_batch(engine, [(prompt, args.new_tokens)])
            if tiers:
                engine.close()
        runs.append({"a": first, "b_tier_ttft_ms": 1e3 * got["tier"]["ttft"][0],
                     "b_off_ttft_ms": 1e3 * got["off"]["ttft"][0],
                     "b_tier_hit_tokens": got["tier"]["tier_hit_tokens"],
                     "b_tier_output": got["tier"]["outputs"][0], "b_off_output": got["off"]["outputs"][0],
                     "order": list(order)})
        print(f"repeat {r + 1}: A {first['ttft_ms']:.0f} ms, B with the tier {runs[-1]['b_tier_ttft_ms']:.0f} ms "
              f"({runs[-1]['b_tier_hit_tokens']} tokens loaded), B without {runs[-1]['b_off_ttft_ms']:.0f} ms",
              flush=True)
    return runs


def redis_cpu_s(url: str) -> float:
    """CPU seconds the redis-server has used (user + system)."""
    import redis

    info = redis.Redis.from_url(url).info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def decode_part(args, rep: Replicas, url: str) -> list[dict]:
    """Publishing on (Redis tier, write-through) vs off (no tiers), interleaved. Besides throughput, the
    CPU publishing took: the step's copies, the write-through thread's and the redis-server's."""
    mixed = load_workload("mixed-16", rep.opt.tokenizer)[:args.batch]
    work = [(p, args.decode_new_tokens) for p, _ in mixed]
    runs = []
    for r in range(args.decode_repeats):
        for kind in (("on", "off") if r % 2 == 0 else ("off", "on")):
            tiers = redis_tier(url, f"decode-{os.getpid()}-{r}:") if kind == "on" else None
            engine = rep.engine(args.pool_blocks, tiers, max_num_seqs=args.batch)
            redis0 = redis_cpu_s(url)
            res = run_batch(engine, work)
            m = engine.metrics
            if tiers:
                engine.close()  # the queue drains: every block's cost is counted
            s = engine.kv_stats()
            runs.append({"kind": kind, "decode_tok_s": m.decode_tokens / m.decode_time,
                         "gen_tok_s": res["generated"] / res["wall_s"], "wall_s": res["wall_s"],
                         "redis_cpu_ms": 1e3 * (redis_cpu_s(url) - redis0), "outputs": res["outputs"],
                         **{k: s[k] for k in s if k.startswith("kv_tier_write_through_") or k == "kv_tier_publish_ms"}})
        print(f"decode repeat {r + 1}: " + ", ".join(f"{x['kind']} {x['decode_tok_s']:.1f} tok/s" for x in runs[-2:]),
              flush=True)
    return runs


def summarize(tok, ttft: list[dict], decode: list[dict]) -> dict:
    out: dict = {}
    if ttft:
        tier, off = (statistics.median(x[k] for x in ttft) for k in ("b_tier_ttft_ms", "b_off_ttft_ms"))
        text = tok.decode(ttft[0]["a"]["output"])
        out["ttft"] = {
            "b_with_tier_ms": tier, "b_without_tier_ms": off, "ratio": off / tier,
            "a_ms": statistics.median(x["a"]["ttft_ms"] for x in ttft),
            "b_tier_hit_tokens": [x["b_tier_hit_tokens"] for x in ttft],
            "texts_identical_b_tier_b_off_a": all(x["b_tier_output"] == x["b_off_output"] == x["a"]["output"]
                                                  for x in ttft),
            "a_queue_depth_when_done": [x["a"]["queue_depth_when_done"] for x in ttft],
            "a_flush_wait_ms": [x["a"]["flush_wait_ms"] for x in ttft],
            "a_prefix_evictions": [x["a"]["prefix_evictions"] for x in ttft], "text": text}
    if decode:
        on = [x for x in decode if x["kind"] == "on"]
        off = [x for x in decode if x["kind"] == "off"]
        med = {k: {"on": statistics.median(x[k] for x in on), "off": statistics.median(x[k] for x in off)}
               for k in ("decode_tok_s", "gen_tok_s")}
        paired = [a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(on, off)]  # the two runs of one repeat
        out["decode"] = {**med, "decode_ratio": med["decode_tok_s"]["on"] / med["decode_tok_s"]["off"],
                         "gen_ratio": med["gen_tok_s"]["on"] / med["gen_tok_s"]["off"],
                         "decode_ratio_paired_median": statistics.median(paired), "decode_ratios_paired": paired,
                         "outputs_identical": all(a["outputs"] == off[0]["outputs"] for a in on + off),
                         "published": [x["kv_tier_write_through_published"] for x in on],
                         "dropped": [x["kv_tier_write_through_dropped"] for x in on],
                         "failed": [x["kv_tier_write_through_failed"] for x in on],
                         "stage_ms": [x["kv_tier_write_through_stage_ms"] for x in on],
                         "store_cpu_ms": [x["kv_tier_write_through_store_cpu_ms"] for x in on],
                         "redis_cpu_ms": [x["redis_cpu_ms"] for x in on],
                         "redis_cpu_ms_off": [x["redis_cpu_ms"] for x in off],
                         # CPU publishing took (step copies + thread + redis-server beyond its idle use) / the
                         # run's wall time: what it costs a fully busy CPU, which machine noise cannot blur
                         "publish_cpu_fraction": statistics.median(
                             (x["kv_tier_write_through_stage_ms"] + x["kv_tier_write_through_store_cpu_ms"]
                              + x["redis_cpu_ms"] - statistics.median(y["redis_cpu_ms"] for y in off))
                             / (1e3 * x["wall_s"]) for x in on)}
    return out


def write(args, tok, ttft: list[dict], decode: list[dict], load: dict) -> dict:
    summary = summarize(tok, ttft, decode)
    slim_ttft = [{k: v for k, v in x.items() if not k.endswith("output")} | {"a": {k: v for k, v in x["a"].items()
                                                                                 if k != "output"}} for x in ttft]
    slim_decode = [{k: v for k, v in x.items() if k != "outputs"} for x in decode]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python", *sys.argv]), "dtype": args.dtype, "threads": torch.get_num_threads(),
                   "cpu": cpu_name(), "cpus": os.cpu_count(), "load": {**load, "end": os.getloadavg()},
                   "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "repeats": args.repeats,
                   "batch": args.batch, "decode_new_tokens": args.decode_new_tokens,
                   "decode_repeats": args.decode_repeats, "summary": summary,
                   "ttft_runs": slim_ttft, "decode_runs": slim_decode}, f, indent=2)
    return summary


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["main", "a"], default="main", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens each replica generates in part 1")
    ap.add_argument("--pool-blocks", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="sequences decoding together in part 2")
    ap.add_argument("--decode-new-tokens", type=int, default=96)
    ap.add_argument("--decode-repeats", type=int, default=5)
    ap.add_argument("--parts", default="ttft,decode")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--quick", action="store_true", help="a small check that the bench runs")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "replica_share.json"))
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.prompt_tokens, args.new_tokens = 1, 200, 4
        args.batch, args.decode_new_tokens, args.decode_repeats = 2, 16, 2
    return args


def main() -> None:
    args = parse_args()
    if args.role == "a":
        return serve_a(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop the children
    load = {"start": os.getloadavg()}
    proc, url = (None, args.redis_url) if args.redis_url else start_redis()
    args.redis_url = url
    a = None
    try:
        rep, tok, prompt = setup(args)
        run_batch(rep.engine(args.pool_blocks), [(prompt[:64], 2)])  # warm-up
        ttft, decode = [], []
        if "ttft" in args.parts:
            a = ProcessA(args)
            ttft = ttft_part(args, rep, a, prompt)
            write(args, tok, ttft, decode, load)
            a.close()
            a = None
        if "decode" in args.parts:
            decode = decode_part(args, rep, url)
        summary = write(args, tok, ttft, decode, load)
    finally:
        if a is not None:
            a.proc.kill()
        if proc is not None:
            proc.kill()
    print(json.dumps({k: {f: x for f, x in v.items() if f != "text"} for k, v in summary.items()}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
