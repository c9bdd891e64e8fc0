"""MLA decode attention: the latent paged cache (absorbed) vs an expanded K/V paged cache (CPU).

    python bench/mla.py [--repeats 5] [--ctx 512] [--batches 1,16] [--threads N]

Shapes: DeepSeek-V2-Lite's attention (16 heads, qk_nope 128, qk_rope 64, v 128, kv_lora_rank 512),
fp32. One decode step of one layer for ``batch`` sequences of ``--ctx`` cached tokens:

- ``latent``: ``devin::mla_attention``'s kernel (``backends/attention/mla.py``): write the step's
  latent rows, absorbed attention over ``R + dr = 576`` values per cached token;
- ``expanded``: what a cache of expanded K/V does: expand the new token's latent with ``kv_b_proj``
  into K [16, 192] and V [16, 128] (V zero-padded to 192, the cache's one head size), then the
  ``cpu_sdpa`` backend (C decode kernel) over ``16·(192+192)`` values per cached token.

Also reports the KV bytes per token of both layouts. Medians of ``--repeats`` runs of 20 steps.
Writes bench/results/mla.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from devin_compile.backends.attention.mla import mla_forward  # noqa: E402
from devin_compile.backends.attention.registry import get_backend  # noqa: E402
from devin_compile.step import AttentionMetadata  # noqa: E402

H, DN, DR, DV, R, BS = 16, 128, 64, 128, 512, 16


def _time(fn, repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        runs.append((time.perf_counter() - t0) / 20)
    return statistics.median(runs)


def case(batch: int, ctx: int, repeats: int) -> dict:
    total = ctx + 1
    nblk = (total + BS - 1) // BS
    tables = [list(range(1 + b * nblk, 1 + (b + 1) * nblk)) for b in range(batch)]
    slots = [tables[b][ctx // BS] * BS + ctx % BS for b in range(batch)]
    meta = AttentionMetadata.build([1] * batch, [total] * batch, tables, slots)
    blocks = batch * nblk + 1
    g = torch.Generator().manual_seed(0)
    w_kv_b = torch.randn(H * (DN + DV), R, generator=g) * 0.05
    scale = (DN + DR) ** -0.5
    q_nope, q_rope = torch.randn(batch, H, DN, generator=g), torch.randn(batch, H, DR, generator=g)
    latent, k_rope = torch.randn(batch, R, generator=g), torch.randn(batch, DR, generator=g)
    lat_cache = torch.randn(blocks, BS, 1, R + DR, generator=g)
    lat_s = _time(lambda: mla_forward(q_nope, q_rope, latent, k_rope, lat_cache, meta, w_kv_b, scale), repeats)

    D = DN + DR
    k_cache = torch.randn(blocks, BS, H, D, generator=g)
    v_cache = torch.randn(blocks, BS, H, D, generator=g)
    backend = get_backend("cpu_sdpa")
    q = torch.cat([q_nope, q_rope], -1)

    def expanded():
        kv = (latent @ w_kv_b.T).view(batch, H, DN + DV)
        k = torch.cat([kv[..., :DN], k_rope[:, None].expand(batch, H, DR)], -1)
        v = torch.nn.functional.pad(kv[..., DN:], (0, D - DV))
        return backend.forward(q, k, v, k_cache, v_cache, meta, scale=scale, softcap=0.0, sliding_window=-1)

    exp_s = _time(expanded, repeats)
    return {"batch": batch, "ctx": ctx, "latent_us": 1e6 * lat_s, "expanded_us": 1e6 * exp_s,
            "latent_speedup": exp_s / lat_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [case(int(b), args.ctx, args.repeats) for b in args.batches.split(",")]
    for r in rows:
        print(json.dumps(r))
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001
        cpu = "unknown"
    out = {"command": "python bench/mla.py " + " ".join(sys.argv[1:]), "cpu": cpu, "threads": torch.get_num_threads(),
           "shape": dict(heads=H, qk_nope=DN, qk_rope=DR, v=DV, kv_lora_rank=R, dtype="float32"),
           "kv_values_per_token_layer": {"latent": R + DR, "expanded": H * (DN + DR + DV),
                                         "expanded_padded_v": H * 2 * (DN + DR)},
           "results": rows}
    path = os.path.join(os.path.dirname(__file__), "results", "mla.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print("wrote", path)


if __name__ == "__main__":
    main()
