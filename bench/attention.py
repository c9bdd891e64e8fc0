"""CPU paged attention vs plain SDPA on contiguous tensors (SmolLM2 head layout: 9 q / 3 kv heads, d=64).

    python bench/attention.py [--dtype bfloat16] [--repeats 7]

Each case times one layer's attention call: the ``cpu_sdpa`` and ``torch_reference``
backends over the paged cache (including the K/V write) against
``F.scaled_dot_product_attention`` on contiguous [B, H, L, D] tensors that are already in
place (the lower bound a paged layout has to approach). Medians of ``--repeats`` runs of
20 calls. Writes bench/results/attention.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from devin_compile.backends.attention.registry import get_backend  # noqa: E402
from devin_compile.step import AttentionMetadata  # noqa: E402

HQ, HKV, D, BS = 9, 3, 64, 16


def _time(fn, repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        runs.append((time.perf_counter() - t0) / 20)
    return statistics.median(runs)


def case(batch: int, ctx: int, q_len: int, dtype: torch.dtype, repeats: int) -> dict:
    """``batch`` sequences, each with ``ctx`` cached tokens before this step and ``q_len`` new ones."""
    total = ctx + q_len
    nblk = (total + BS - 1) // BS
    k_cache = torch.randn(batch * nblk + 1, BS, HKV, D, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = [list(range(1 + b * nblk, 1 + (b + 1) * nblk)) for b in range(batch)]
    slots = [tables[b][p // BS] * BS + p % BS for b in range(batch) for p in range(ctx, total)]
    meta = AttentionMetadata.build([q_len] * batch, [total] * batch, tables, slots)
    q = torch.randn(batch * q_len, HQ, D, dtype=dtype)
    k = torch.randn(batch * q_len, HKV, D, dtype=dtype)
    v = torch.randn_like(k)
    scale = D ** -0.5
    qc = torch.randn(batch, HQ, q_len, D, dtype=dtype)
    kc = torch.randn(batch, HKV, total, D, dtype=dtype)
    vc = torch.randn_like(kc)
    out = {"batch": batch, "ctx": ctx, "q_len": q_len}
    out["sdpa_contiguous_us"] = 1e6 * _time(lambda: F.scaled_dot_product_attention(
        qc, kc, vc, is_causal=q_len > 1 and ctx == 0, scale=scale, enable_gqa=True), repeats)
    for name in ("cpu_sdpa", "torch_reference"):
        be = get_backend(name)
        out[f"{name}_us"] = 1e6 * _time(lambda: be.forward(q, k, v, k_cache, v_cache, meta, scale=scale, softcap=0.0,
                                                            sliding_window=-1), repeats)
    out["cpu_sdpa_vs_contiguous"] = out["cpu_sdpa_us"] / out["sdpa_contiguous_us"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "attention.json"))
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    cases = [(1, 0, 512), (1, 128, 1), (1, 1024, 1), (1, 3000, 1), (8, 512, 1), (32, 256, 1), (4, 256, 64)]
    rows = [case(b, c, q, dtype, args.repeats) for b, c, q in cases]
    print(f"{'batch':>5} {'ctx':>5} {'q_len':>5} {'sdpa contig us':>15} {'cpu_sdpa us':>12} {'reference us':>13} {'ratio':>6}")
    for r in rows:
        print(f"{r['batch']:5} {r['ctx']:5} {r['q_len']:5} {r['sdpa_contiguous_us']:15.0f} {r['cpu_sdpa_us']:12.0f} "
              f"{r['torch_reference_us']:13.0f} {r['cpu_sdpa_vs_contiguous']:6.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "dtype": args.dtype, "threads": torch.get_num_threads(),
                   "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
