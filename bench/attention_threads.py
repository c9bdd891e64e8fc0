"""Batch-1 decode attention (``devin::cpu_decode_layer``, SmolLM2's heads) on one thread vs all of torch's.

    python bench/attention_threads.py [--contexts 64 256 1024 4096] [--repeats 7] [--calls 200]

One sequence, one query, 9 query heads over 3 KV heads of 64, bf16, the same split-K chunk either way;
per context, ``--repeats`` rounds alternating 1 thread / 2 threads of ``--calls`` calls each, median µs per
call, and whether both outputs are equal. The kernel runs a step below its serial-work threshold on the
calling thread whatever it is given, so after that change the two columns match at short contexts.
Writes ``bench/results/attention_threads.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from devin_compile.backends.attention import cpu_paged_decode as cpd  # noqa: E402
from devin_compile.benchmarking import cpu_info  # noqa: E402

HQ, HKV, D, BS = 9, 3, 64, 16


def case(ctx: int):
    nb = ctx // BS + 2
    g = torch.Generator().manual_seed(ctx)
    kc, vc = (torch.randn(nb, BS, HKV, D, generator=g).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(1, HQ, D, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, HKV, D, generator=g).to(torch.bfloat16) for _ in range(2))
    tables = torch.arange(nb, dtype=torch.int32)[None]
    lens = torch.tensor([ctx + 1], dtype=torch.int32)
    slots, rows = torch.tensor([ctx]), torch.tensor([0])
    chunk = cpd.chunk_for(ctx + 1, 2)
    return lambda: cpd.decode_layer(q, k, v, kc, vc, slots, rows, tables, lens, D ** -0.5, chunk)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 1024, 4096])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "attention_threads.json"))
    args = ap.parse_args()
    if not cpd.load_layer_op():
        sys.exit("the C++ decode-layer op cannot be built here (no C++ compiler)")
    threads = torch.get_num_threads()
    if threads < 2:
        sys.exit("torch has one thread here: nothing to compare (unset OMP_NUM_THREADS)")
    rows = []
    for ctx in args.contexts:
        f, us, outs = case(ctx), {1: [], threads: []}, {}
        for _ in range(args.repeats):
            for th in us:
                torch.set_num_threads(th)
                outs[th] = f().clone()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    f()
                us[th].append((time.perf_counter() - t0) / args.calls * 1e6)
        rows.append({"context": ctx, "us_1_thread": statistics.median(us[1]),
                     f"us_{threads}_threads": statistics.median(us[threads]), "equal": torch.equal(*outs.values())})
        print(rows[-1], flush=True)
    torch.set_num_threads(threads)
    with open(args.out, "w") as fh:
        json.dump({"command": " ".join(sys.argv), "machine": cpu_info(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
