"""MoE decode speed: devin-compile vs HF eager on a Mixtral-shaped random model (CPU).

    python bench/moe.py [--dtype float32] [--repeats 3] [--new-tokens 24] [--prompt-len 64] [--threads N]

Model (random weights, seed 0; Mixtral's shape ratios at a size a 2-core CPU runs in seconds):
``MixtralConfig(hidden_size=512, intermediate_size=1792, num_hidden_layers=4, num_attention_heads=8,
num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000)`` (123M parameters,
91M of them outside the embedding and lm_head; 8 experts top-2 as Mixtral 8x7B, GQA 4:1, intermediate =
3.5 x hidden).

For batch 1 and batch 16 (prompts of ``--prompt-len`` random tokens), each side generates
``--new-tokens`` greedy tokens (EOS ignored); decode tok/s = batch x (new tokens - 1) / (time of
the whole generate - time of a 1-token generate), i.e. prefill excluded on both sides. HF eager:
``model.generate`` with its KV cache (batch of equal-length prompts, no padding) and the model's
default experts implementation; devin-compile: ``optimize(model)`` on the default CPU backend.
Medians of ``--repeats`` runs; the two sides' runs alternate (HF full, devin full, HF 1-token,
devin 1-token, per repeat), so a burst of load from other jobs on a shared machine hits both. Writes bench/results/moe.json (moe-<dtype>.json for other dtypes).
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
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from devin_compile import optimize  # noqa: E402

CONFIG = dict(hidden_size=512, intermediate_size=1792, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
              max_position_embeddings=1024, tie_word_embeddings=False)


def _cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001
        return platform.processor() or "unknown"


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    from transformers import MixtralConfig, MixtralForCausalLM

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**CONFIG)).to(dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    opt = optimize(model, max_num_seqs=16)
    compile_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1)
    n = args.new_tokens
    results = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = torch.randint(3, CONFIG["vocab_size"], (batch, args.prompt_len), generator=g)
        mask = torch.ones_like(prompts)

        def hf(k):
            with torch.no_grad():
                return model.generate(prompts, attention_mask=mask, max_new_tokens=k, min_new_tokens=k,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)

        def ours(k):
            return opt.generate(prompts.tolist(), max_new_tokens=k, ignore_eos=True)

        hf(2), ours(2)  # warm-up
        row = {"batch": batch, "prompt_len": args.prompt_len, "new_tokens": n}
        sides = (("hf_eager", hf), ("devin", ours))
        times = {(name, k): [] for name, _ in sides for k in (n, 1)}
        for _ in range(args.repeats):  # the two sides take turns, so load from other jobs hits both alike
            for k in (n, 1):
                for name, fn in sides:
                    times[name, k].append(_time(lambda: fn(k)))
        for name, _ in sides:
            full, first = statistics.median(times[name, n]), statistics.median(times[name, 1])
            row[f"{name}_decode_tok_s"] = batch * (n - 1) / max(full - first, 1e-9)
        row["speedup"] = row["devin_decode_tok_s"] / row["hf_eager_decode_tok_s"]
        same = [list(r) for r in hf(8)[:, args.prompt_len:].tolist()] == ours(8)
        row["greedy_tokens_identical_8"] = same
        results.append(row)
        print(json.dumps(row))
    out = {
        "command": "python bench/moe.py " + " ".join(sys.argv[1:]),
        "cpu": _cpu_name(), "threads": torch.get_num_threads(), "dtype": args.dtype,
        "model": {"config": CONFIG, "parameters": params}, "compile_s": compile_s,
        "repeats": args.repeats, "results": results,
    }
    name = "moe.json" if args.dtype == "float32" else f"moe-{args.dtype}.json"
    path = os.path.join(os.path.dirname(__file__), "results", name)
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print("wrote", path)


if __name__ == "__main__":
    main()
