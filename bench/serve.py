"""Server overhead: a workload through ``devin-compile serve`` with the official ``openai`` client
vs the same workload through the in-process engine, and metrics + tracing on vs off.

    python bench/serve.py [--workload ../shared/workloads/mixed-64.jsonl] [--requests N]
                          [--rates 0.25 0.5 1] [--poisson-requests N] [--model PATH]
                          [--trace-steps] [--out serve.json]

1. In-process: every request added to ``opt.engine`` at t=0, stepped to the end (as
   bench/throughput.py does). 2. Server "off" (``--no-metrics``, no tracing) and server
   "on" (metrics + ``--trace-file``), each its own process: all requests sent at once as
   streamed completions (greedy, ``ignore_eos``, exactly ``max_new_tokens``) by
   ``AsyncOpenAI``. The three run alternately, ``--repeats`` times each (medians), so load
   from elsewhere falls on all alike. Reported: generated tokens/s, ratios server/in-process
   and on/off, and whether the server's text equals the in-process tokens decoded. 3. TTFT
   p50/p99 on the "on" server under Poisson arrivals at a few rates (requests/s), as a table
   and a PNG (``--rates`` with no value: skipped). ``--trace-steps`` adds a fourth, server
   "on_steps" (metrics + ``--trace-file`` + ``--trace-steps``), to the alternation.
Writes bench/results/serve.json (or ``--out``) and bench/results/serve-ttft.png. The client runs on the
same CPU as the server (its cost is part of the measured overhead).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, ROOT)
DEFAULT_WORKLOAD = os.path.join(ROOT, "..", "shared", "workloads", "mixed-64.jsonl")


def load_rows(path: str, n: int | None) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:n] if n else rows


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def load_opt(model_path):
    import torch

    from devin_compile import optimize
    from devin_compile.models import load_model

    model, tok = load_model(model_path, torch.float32)
    return optimize(model, tokenizer=tok)


def in_process(opt, rows) -> dict:
    from devin_compile import SamplingParams

    engine, tok = opt.engine, opt.tokenizer
    work = [(tok(r["prompt"], add_special_tokens=False)["input_ids"], int(r["max_new_tokens"])) for r in rows]
    engine.generate([work[0][0]], SamplingParams(max_new_tokens=2))  # warm
    engine.reset_prefix_cache()
    t0 = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in work]
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - t0
    seqs = [engine.requests[i] for i in ids]
    texts = [tok.decode(s.output_ids, skip_special_tokens=True) for s in seqs]
    gen = sum(len(s.output_ids) for s in seqs)
    ttft = [s.metrics.first_token - t0 for s in seqs]
    return {"wall_s": wall, "generated": gen, "gen_tok_s": gen / wall, "ttft_p50_ms": 1e3 * pct(ttft, 0.5),
            "ttft_p99_ms": 1e3 * pct(ttft, 0.99), "texts": texts}


class ServerProcess:
    def __init__(self, model_path, extra: list[str]) -> None:
        cmd = [sys.executable, "-m", "devin_compile.cli", "serve", "--port", "0", "--served-model-name", "bench"]
        if model_path:
            cmd += ["--model", model_path]
        self.proc = subprocess.Popen(cmd + extra, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONPATH": ROOT})
        self.url = None
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                if "serving bench on " in line:
                    self.url = line.split(" on ", 1)[1].split()[0]
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(600):
            self.proc.kill()
            raise RuntimeError("the server did not start")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)


async def one(client, row, t_submit: float) -> tuple[str, float | None, float]:
    first = None
    parts = []
    stream = await client.completions.create(model="bench", prompt=row["prompt"], max_tokens=int(row["max_new_tokens"]),
                                             temperature=0, stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        text = chunk.choices[0].text if chunk.choices else ""
        if text and first is None:
            first = time.perf_counter() - t_submit
        parts.append(text)
    return "".join(parts), first, time.perf_counter() - t_submit


async def all_at_once(url: str, rows) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=3600)
    await one(client, rows[0] | {"max_new_tokens": 2}, time.perf_counter())  # warm the connection and engine
    t0 = time.perf_counter()
    res = await asyncio.gather(*(one(client, r, t0) for r in rows))
    wall = time.perf_counter() - t0
    gen = sum(int(r["max_new_tokens"]) for r in rows)
    ttft = [f for _, f, _ in res]
    await client.close()
    return {"wall_s": wall, "generated": gen, "gen_tok_s": gen / wall, "ttft_p50_ms": 1e3 * pct(ttft, 0.5),
            "ttft_p99_ms": 1e3 * pct(ttft, 0.99), "texts": [t for t, _, _ in res]}


async def poisson(url: str, rows, rate: float, seed: int = 0) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=3600)
    rng = random.Random(seed)
    tasks = []
    for r in rows:
        tasks.append(asyncio.create_task(one(client, r, time.perf_counter())))
        await asyncio.sleep(rng.expovariate(rate))
    res = await asyncio.gather(*tasks)
    await client.close()
    ttft = [f for _, f, _ in res]
    return {"rate_rps": rate, "requests": len(rows), "ttft_p50_ms": 1e3 * pct(ttft, 0.5),
            "ttft_p99_ms": 1e3 * pct(ttft, 0.99), "e2e_p50_ms": 1e3 * pct([e for _, _, e in res], 0.5)}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rates = [r["rate_rps"] for r in rows]
    ax.plot(rates, [r["ttft_p50_ms"] for r in rows], "o-", label="TTFT p50")
    ax.plot(rates, [r["ttft_p99_ms"] for r in rows], "s--", label="TTFT p99")
    ax.set_xlabel("request rate (requests/s, Poisson)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("devin-compile serve: TTFT under load")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default=DEFAULT_WORKLOAD)
    ap.add_argument("--requests", type=int, default=None, help="first N requests of the workload (default: all)")
    ap.add_argument("--rates", type=float, nargs="*", default=[0.25, 0.5, 1.0])
    ap.add_argument("--poisson-requests", type=int, default=16, help="requests per Poisson rate")
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs of each of the three (median)")
    ap.add_argument("--trace-steps", action="store_true",
                    help="also run a server with --trace-file --trace-steps (a span per request per engine step)")
    ap.add_argument("--out", default="serve.json", help="file name under bench/results (default serve.json)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch/OpenMP threads of the engine, in-process and in the servers alike (default 1: on a "
                         "small shared CPU, OpenMP barriers with contended cores cost more than they gain)")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the server processes inherit it
    import torch

    torch.set_num_threads(args.threads)
    rows = load_rows(args.workload, args.requests)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    out = {"command": "python bench/serve.py " + " ".join(sys.argv[1:]), "cpu": cpu, "cores": os.cpu_count(),
           "threads": args.threads,
           "workload": os.path.basename(args.workload), "requests": len(rows)}
    # all three stay up, and the runs alternate (in-process, off, on; rotated each repeat), so load
    # from elsewhere on the machine falls on all of them alike; medians over the repeats
    opt = load_opt(args.model)
    trace = tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False).name
    servers = {"server_off": ServerProcess(args.model, ["--no-metrics"]),
               "server_on": ServerProcess(args.model, ["--trace-file", trace])}
    step_trace = None
    if args.trace_steps:
        step_trace = tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False).name
        servers["server_on_steps"] = ServerProcess(args.model, ["--trace-file", step_trace, "--trace-steps"])
    runs: dict[str, list[dict]] = {"in_process": [], **{name: [] for name in servers}}
    order = list(runs)
    poisson_rows = []
    try:
        for rep in range(args.repeats):
            k = rep % len(order)
            for name in order[k:] + order[:k]:
                res = in_process(opt, rows) if name == "in_process" else \
                    asyncio.run(all_at_once(servers[name].url, rows))
                runs[name].append(res)
                print(f"repeat {rep}: {name} {res['gen_tok_s']:.1f} tok/s", flush=True)
        poisson_rows = [asyncio.run(poisson(servers["server_on"].url, rows[:args.poisson_requests], r))
                        for r in args.rates]
    finally:
        exits = {name: srv.stop() for name, srv in servers.items()}
    ref_texts = runs["in_process"][0]["texts"]
    results = {}
    for name, rs in runs.items():
        results[name] = {
            "gen_tok_s_median": statistics.median(r["gen_tok_s"] for r in rs),
            "gen_tok_s_runs": [r["gen_tok_s"] for r in rs],
            "ttft_p50_ms_median": statistics.median(r["ttft_p50_ms"] for r in rs),
            "ttft_p99_ms_median": statistics.median(r["ttft_p99_ms"] for r in rs),
            "generated_per_run": rs[0]["generated"],
            "same_text_as_in_process": all(r["texts"] == ref_texts for r in rs),
        }
        if name in exits:
            results[name]["exit_code_after_sigterm"] = exits[name]
    for name, path in (("server_on", trace), ("server_on_steps", step_trace)):
        if path is not None:
            with open(path) as f:
                results[name]["spans_written"] = sum(1 for _ in f)
            os.unlink(path)
    results["server_on"]["poisson"] = poisson_rows
    med = {k: v["gen_tok_s_median"] for k, v in results.items()}
    out["results"] = results
    out["ratios"] = {
        "server_off_vs_in_process": med["server_off"] / med["in_process"],
        "server_on_vs_in_process": med["server_on"] / med["in_process"],
        "on_vs_off": med["server_on"] / med["server_off"],
    }
    if "server_on_steps" in med:
        out["ratios"]["on_steps_vs_off"] = med["server_on_steps"] / med["server_off"]
        out["ratios"]["on_steps_vs_on"] = med["server_on_steps"] / med["server_on"]
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", args.out), "w") as f:
        json.dump(out, f, indent=2)
    if poisson_rows:
        plot(poisson_rows, os.path.join(HERE, "results", "serve-ttft.png"))
    print(json.dumps(out["ratios"], indent=2))
    print("| rate (req/s) | TTFT p50 (ms) | TTFT p99 (ms) |\n|---|---|---|")
    for p in results["server_on"]["poisson"]:
        print(f"| {p['rate_rps']:g} | {p['ttft_p50_ms']:.0f} | {p['ttft_p99_ms']:.0f} |")


if __name__ == "__main__":
    main()
