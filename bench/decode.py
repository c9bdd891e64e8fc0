"""Batch-1 decode tokens/s and time to first token: HF eager vs devin-compile, side by side.

    python bench/decode.py [--dtypes float32 bfloat16] [--new-tokens 64] [--repeats 5] [--compile-decode]

For each dtype both engines run the same prompt in the same process, alternately, and
each figure is the median of ``--repeats`` runs. Also reports ``optimize()`` wall time
(the first call in the process is the cold one). ``--compile-decode`` adds a third engine:
devin-compile with the decode graph ahead-compiled by Inductor (``compile_decode=True``).
Writes bench/results/decode.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import devin_compile  # noqa: E402
from devin_compile.benchmarking import time_devin_decode, time_hf_decode  # noqa: E402
from devin_compile.config import parse_dtype  # noqa: E402
from devin_compile.models import load_model  # noqa: E402

PROMPT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
          "First Citizen:\nYou are all resolved rather to die than to famish?\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--compile-decode", action="store_true", help="also time optimize(compile_decode=True)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "decode.json"))
    args = ap.parse_args()

    rows = []
    for dtype_name in args.dtypes:
        dtype = parse_dtype(dtype_name)
        model, tok = load_model(None, dtype)
        ids = tok(PROMPT)["input_ids"]
        t0 = time.perf_counter()
        opt = devin_compile.optimize(model, tokenizer=tok)
        optimize_s = time.perf_counter() - t0
        hf = time_hf_decode(model, ids, args.new_tokens, args.repeats)
        dv = time_devin_decode(opt, ids, args.new_tokens, args.repeats)
        row = {
            "dtype": dtype_name, "prompt_tokens": len(ids), "new_tokens": args.new_tokens,
            "hf_decode_tok_s": hf.decode_tok_s, "devin_decode_tok_s": dv.decode_tok_s,
            "decode_speedup": dv.decode_tok_s / hf.decode_tok_s,
            "hf_ttft_ms": hf.ttft_s * 1e3, "devin_ttft_ms": dv.ttft_s * 1e3,
            "ttft_speedup": hf.ttft_s / dv.ttft_s,
            "optimize_s": optimize_s, "optimize_is_cold": not rows,
            "same_greedy_tokens": hf.tokens == dv.tokens,
        }
        if args.compile_decode:
            t0 = time.perf_counter()
            copt = devin_compile.optimize(model, tokenizer=tok, compile_decode=True, max_num_seqs=8)
            row["compiled_optimize_s"] = time.perf_counter() - t0
            cd = time_devin_decode(copt, ids, args.new_tokens, args.repeats)
            dv2 = time_devin_decode(opt, ids, args.new_tokens, args.repeats)  # interleaved: uncompiled again
            row.update({"compiled_decode_tok_s": cd.decode_tok_s, "uncompiled_decode_tok_s_2": dv2.decode_tok_s,
                        "compiled_vs_uncompiled": cd.decode_tok_s / max(dv.decode_tok_s, dv2.decode_tok_s),
                        "compiled_vs_hf": cd.decode_tok_s / hf.decode_tok_s,
                        "compiled_same_greedy_tokens": cd.tokens == hf.tokens})
        rows.append(row)
        print(f"\n== {dtype_name}: {len(ids)}-token prompt, {args.new_tokens} new tokens, median of {args.repeats}")
        print(hf.row())
        print(dv.row())
        print(f"decode speed-up {row['decode_speedup']:.2f}x, TTFT speed-up {row['ttft_speedup']:.2f}x, "
              f"optimize() {optimize_s:.1f} s ({'cold' if row['optimize_is_cold'] else 'warm'}), "
              f"same greedy tokens: {row['same_greedy_tokens']}", flush=True)
        if args.compile_decode:
            print(f"compiled decode {row['compiled_decode_tok_s']:.1f} tok/s = {row['compiled_vs_uncompiled']:.2f}x "
                  f"uncompiled (best of two interleaved runs), {row['compiled_vs_hf']:.2f}x HF; optimize() "
                  f"{row['compiled_optimize_s']:.1f} s; same greedy tokens: {row['compiled_same_greedy_tokens']}",
                  flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "machine": platform.processor() or platform.machine(),
                   "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
