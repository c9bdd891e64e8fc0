"""Tensor parallelism on this CPU: what splitting a model over 2 processes costs (issue 40).

    python bench/tensor_parallel.py [--new-tokens 32] [--repeats 5] [--dtype float32] [--tiny]

Three engines of SmolLM2-135M-Instruct (``--tiny``: a random 6-layer Llama) stay alive side by side:
tp=1 with 1 thread, tp=1 with 2 threads, and tp=2 (two ranks, gloo, 1 thread each). They are timed
in turns (A, B, C, A, B, C, ...: machine drift hits all alike), one batch-1 greedy decode each turn;
figures are medians over ``--repeats`` turns (each turn's figure is kept too), ratios against tp=1
measured in the same run, with the machine's load average before and after the timed turns.

Also: the all_reduces in tp=2's decode graph (per step), one all_reduce of a decode step's hidden
state timed alone between the two ranks (median of 200) and so their estimated share of the tp=2
step; rank 0's step-plan broadcast per step (timed in the decode runs); bytes of weights each
process holds (tp=2: each rank) and the sharded linears' bytes per rank. Writes
bench/results/tensor_parallel.json.
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

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

PROMPT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
          "First Citizen:\nYou are all resolved rather to die than to famish?\n")


def _model(tiny: bool, dtype):
    import torch

    from devin_compile.models import load_model

    if not tiny:
        model, tok = load_model(None, dtype)
        return model, tok(PROMPT)["input_ids"]
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval().to(dtype), list(range(5, 45))


def _held_bytes(opt) -> int:
    from devin_compile.weights import program_tensors

    seen = {}
    for _, _, t in program_tensors(opt.engine.runner.program):
        seen[(t.untyped_storage().data_ptr(), t.device)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def worker(args) -> None:
    """One engine (tp=1) or one rank (tp=2): answers "go" on stdin with one timed decode as a JSON line."""
    import torch
    import torch.distributed as dist

    import devin_compile
    from devin_compile.benchmarking import time_devin_decode
    from devin_compile.config import parse_dtype
    from devin_compile.runtime import distributed

    torch.set_num_threads(args.threads)
    model, ids = _model(args.tiny, parse_dtype(args.dtype))
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    opt = devin_compile.optimize(model, tensor_parallel=tp, num_kv_blocks=64)
    info = {"held_bytes": _held_bytes(opt), "note": next((r.note for r in opt.pass_report.records
                                                          if r.name == "shard_tensor_parallel"), "")}
    group = opt.rank_group
    if group is not None:
        decode = opt.engine.runner.program.graphs.get("decode") or opt.engine.runner.program.main
        info["all_reduces_per_step"] = sum(n.target == torch.ops._c10d_functional.all_reduce.default
                                           for n in decode.graph.nodes)
        x = torch.randn(1, model.config.hidden_size, dtype=parse_dtype(args.dtype))
        times = []
        for _ in range(220):
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        info["all_reduce_ms"] = statistics.median(times[20:]) * 1e3
        if group.rank != 0:
            distributed.follow(opt.engine.runner, group)
            return
        sent = [0.0, 0]
        send = group.broadcast

        def timed(message=None):
            t0 = time.perf_counter()
            out = send(message)
            sent[0] += time.perf_counter() - t0
            sent[1] += 1
            return out

        group.broadcast = timed
    print(json.dumps({"ready": info}), flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        sent = [0.0, 0] if group is None else sent
        sent[:] = [0.0, 0]
        t = time_devin_decode(opt, ids, args.new_tokens, repeats=1)
        print(json.dumps({"tok_s": t.decode_tok_s, "tokens": t.tokens,
                          "broadcast_ms_per_step": sent[0] * 1e3 / max(sent[1], 1)}), flush=True)
    if group is not None:
        group.broadcast = send
        with group.lock:
            group.broadcast(("done", None))


def _spawn(args, threads: int, rank: int | None, port: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": ROOT}
    if rank is not None:
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
    cmd = [sys.executable, __file__, "--worker", "--threads", str(threads), "--new-tokens", str(args.new_tokens),
           "--dtype", args.dtype] + (["--tiny"] if args.tiny else [])
    return subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _read(p: subprocess.Popen) -> dict:
    while True:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError("a bench worker exited early")
        if line.startswith("{"):
            return json.loads(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tiny", action="store_true", help="a random 6-layer Llama instead of SmolLM2")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "tensor_parallel.json"))
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from devin_compile.cli.launch import free_port

    port = free_port()
    # tp=2 first, alone: its ranks time the all_reduce before the other engines load and compile
    engines = {"tp=2, 1 thread/rank": [_spawn(args, 1, r, port) for r in range(2)]}
    try:
        ready = {name: _read(procs[0])["ready"] for name, procs in engines.items()}
        engines.update({"tp=1, 1 thread": [_spawn(args, 1, None, 0)], "tp=1, 2 threads": [_spawn(args, 2, None, 0)]})
        ready.update({name: _read(engines[name][0])["ready"] for name in ("tp=1, 1 thread", "tp=1, 2 threads")})
        load = [os.getloadavg()[0]]
        runs = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, procs in engines.items():
                procs[0].stdin.write("go\n")
                procs[0].stdin.flush()
                runs[name].append(_read(procs[0]))
        load.append(os.getloadavg()[0])
    finally:
        for procs in engines.values():
            for p in procs:
                if p.poll() is None and p.stdin:
                    p.stdin.close()
            for p in procs:
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
    report(args, ready, runs, load)


def report(args, ready: dict, runs: dict, load: list[float]) -> None:
    base = "tp=1, 1 thread"
    tok_s = {name: statistics.median(r["tok_s"] for r in rs) for name, rs in runs.items()}
    tp2 = "tp=2, 1 thread/rank"
    step_ms = 1e3 / tok_s[tp2]
    n_ar, ar_ms = ready[tp2]["all_reduces_per_step"], ready[tp2]["all_reduce_ms"]
    bcast = statistics.median(r["broadcast_ms_per_step"] for r in runs[tp2])
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"\n{cpu}, {os.cpu_count()} cores; {'tiny Llama' if args.tiny else 'SmolLM2-135M'} {args.dtype}, batch 1, "
          f"{args.new_tokens} new tokens, median of {args.repeats} interleaved runs; 1-min load average "
          f"{load[0]:.1f} before, {load[1]:.1f} after (a shared machine: other processes take cores too)")
    for name in runs:
        print(f"{name:22} {tok_s[name]:8.1f} tok/s  step {1e3 / tok_s[name]:7.2f} ms  {tok_s[name] / tok_s[base]:5.2f}x "
              f"tp=1/1 thread  weights held {ready[name]['held_bytes'] / 2**20:7.1f} MiB"
              + ("  (rank 0)" if name == tp2 else ""))
    same = all(rs[-1]["tokens"] == runs[base][-1]["tokens"] for rs in runs.values())
    print(f"tp=2: {n_ar} all_reduces per decode step, {ar_ms:.3f} ms each alone → {n_ar * ar_ms:.2f} ms "
          f"= {n_ar * ar_ms / step_ms:.0%} of the step; step-plan broadcast {bcast:.2f} ms "
          f"= {bcast / step_ms:.0%}; {ready[tp2]['note'].split('; ')[0]}; same greedy tokens: {same}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"cpu": cpu, "cores": os.cpu_count(), "model": "tiny" if args.tiny else "SmolLM2-135M",
                   "dtype": args.dtype, "new_tokens": args.new_tokens, "repeats": args.repeats,
                   "load_average_before_after": load, "decode_tok_s": tok_s,
                   "decode_tok_s_runs": {k: [r["tok_s"] for r in rs] for k, rs in runs.items()},
                   "ratio_vs_tp1_1thread": {k: v / tok_s[base] for k, v in tok_s.items()},
                   "tp2_all_reduces_per_step": n_ar, "tp2_all_reduce_ms": ar_ms, "tp2_step_ms": step_ms,
                   "tp2_all_reduce_share": n_ar * ar_ms / step_ms, "tp2_broadcast_ms_per_step": bcast,
                   "held_bytes": {k: v["held_bytes"] for k, v in ready.items()}, "tp2_note": ready[tp2]["note"],
                   "same_greedy_tokens": same}, f, indent=1)


if __name__ == "__main__":
    main()
