"""A soak with faults: many requests against one ``devin-compile serve`` (SmolLM2 fp32, embedded)
whose KV cache has a Redis tier, Redis killed and restarted part-way.

    python bench/soak.py [--requests 1000] [--concurrency 16] [--max-tokens 256] [--warmup 100]
                         [--workloads mixed-64 shared-prefix-32] [--max-prompt-tokens 1024]
                         [--num-kv-blocks 512] [--max-num-seqs 16] [--threads 1] [--time-limit 7200]
                         [--model PATH] [--out soak.json]

The plan (``bench/soaklib/plan.py``): prompts and lengths from ``../shared/workloads`` (each row's
``max_new_tokens`` capped at ``--max-tokens``), completions and chat, streamed and not; 20% of the
clients leave mid-stream (after 0-3 content chunks), 5% send malformed bodies (bad JSON, wrong types,
unknown fields, out-of-range values, an unknown model, a body past the server's 1 MiB limit), 3% ask
for ``n`` of 2-3 sampled choices with a seed and logprobs; at most ``--concurrency`` in flight. The
first ``--warmup`` requests warm the server up; redis-server (started here on a free 127.0.0.1 port)
is SIGKILLed once half the requests have completed and restarted at 60%.

Checked (``bench/soaklib/checks.py``; exit status 1 when anything fails): every request not cut off
completes (200, or its 4xx), greedy and seeded answers equal the in-process engine's (this process
runs ``devin_compile.optimize`` on the same model, without a tier, before the server starts: text,
token count and logprobs within 1e-3), ``/metrics`` shows 0 KV blocks used and no 5xx at the end,
the server's resident memory (``/proc/PID/status``) grows at most 5% from after warm-up to the end,
and ``/health`` answers. Reported: client-side TTFT and inter-token latency p50/p99 of the streams,
end-to-end latency, requests by kind and status, the Redis tier's counters and the faults' times.
Writes bench/results/soak.json (or ``--out``). Everything listens on 127.0.0.1 only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # redis_server.RedisServer: the tests' redis-server runner
WORKLOADS = os.path.join(ROOT, "..", "shared", "workloads")

from redis_server import RedisServer  # noqa: E402
from serve import ServerProcess, load_opt  # noqa: E402  (bench/serve.py)
from soaklib.checks import problems, summary  # noqa: E402
from soaklib.driver import Fault, soak  # noqa: E402
from soaklib.observe import health, rss_bytes  # noqa: E402
from soaklib.plan import build_plan, load_rows  # noqa: E402
from soaklib.reference import reference  # noqa: E402


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    ap.add_argument("--max-tokens", type=int, default=256, help="cap on each row's max_new_tokens")
    ap.add_argument("--warmup", type=int, default=None, help="requests before the first memory reading "
                                                             "(default: a tenth)")
    ap.add_argument("--workloads", nargs="+", default=["mixed-64", "shared-prefix-32"],
                    help="names under ../shared/workloads")
    ap.add_argument("--max-prompt-tokens", type=int, default=None, help="only rows with at most this many")
    ap.add_argument("--num-kv-blocks", type=int, default=512, help="the server's KV pool (16-token blocks)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads, here and in the server")
    ap.add_argument("--seed", type=int, default=0, help="the plan's seed")
    ap.add_argument("--time-limit", type=float, default=7200, help="seconds the soak may take")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--out", default="soak.json", help="file name under bench/results")
    return ap.parse_args()


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]}


def run_soak(args, plan, redis) -> tuple:
    """Start the server on ``redis``, run the soak against it, SIGTERM it; (run, /health status, exit code)."""
    server = ServerProcess(args.model, ["--kv-cache-redis", redis.url, "--num-kv-blocks", str(args.num_kv_blocks),
                                        "--max-num-seqs", str(args.max_num_seqs)])
    try:
        url = server.url.removesuffix("/v1")
        faults = [Fault(args.requests // 2, "redis killed", redis.kill),
                  Fault(args.requests * 6 // 10, "redis restarted", redis.start)]
        warmup = args.warmup if args.warmup is not None else args.requests // 10
        run = asyncio.run(soak(url, plan, concurrency=args.concurrency, warmup=warmup, faults=faults,
                               rss=lambda: rss_bytes(server.proc.pid), time_limit_s=args.time_limit))
        status = asyncio.run(health(url))
    finally:
        code = server.stop()
    return run, status, code


def main() -> int:
    args = arguments()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the server inherits it
    import torch

    torch.set_num_threads(args.threads)
    out = {"command": "python bench/soak.py " + " ".join(sys.argv[1:]), **machine()}
    rows = load_rows([os.path.join(WORKLOADS, f"{w}.jsonl") for w in args.workloads], args.max_prompt_tokens)
    plan = build_plan(rows, args.requests, "bench", max_tokens=args.max_tokens, seed=args.seed)
    t = time.perf_counter()
    opt = load_opt(args.model)
    refs = reference(opt, plan)
    del opt
    out["reference_s"] = round(time.perf_counter() - t, 1)
    print(f"in-process reference: {len(refs)} distinct requests in {out['reference_s']} s", flush=True)
    redis = RedisServer(shutil.which("redis-server") or sys.exit("redis-server is not installed"),
                        Path(tempfile.mkdtemp(prefix="soak-redis-"))).start()
    try:
        run, health_status, exit_code = run_soak(args, plan, redis)
    finally:
        redis.stop()
    found = problems(plan, run, refs)
    if health_status != 200:
        found.append(f"/health answered {health_status}")
    out.update(size={k: getattr(args, k) for k in ("requests", "concurrency", "max_tokens", "workloads",
                                                   "max_prompt_tokens", "num_kv_blocks", "max_num_seqs", "threads")},
               results=summary(plan, run), health=health_status, exit_code_after_sigterm=exit_code,
               load_average_at_end=[round(x, 2) for x in os.getloadavg()], problems=found, passed=not found)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", args.out), "w") as f:
        json.dump(out, f, indent=2)
    shown = {k: v for k, v in out["results"].items() if k != "rss_mib"}
    print(json.dumps(shown | {"rss_mib": {k: v for k, v in out["results"]["rss_mib"].items() if k != "series"}},
                     indent=1))
    print("PASSED" if not found else "FAILED:\n" + "\n".join(found[:50]))
    return 0 if not found else 1


if __name__ == "__main__":
    sys.exit(main())
