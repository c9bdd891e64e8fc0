"""Decode tokens/s of a tiny Mamba2-style hybrid (Bamba: Mamba2 mixers beside attention), HF eager vs
devin-compile, side by side in one run.

    python bench/recurrent.py [--new-tokens 64] [--repeats 5] [--hidden 256] [--layers 4] [--prompt 32]

The model is built from transformers' BambaConfig with seeded random weights (fp32; every 4th layer
attention, the rest Mamba2 mixers; nothing is downloaded). HF eager runs its own torch path for the mixers
(``causal_conv1d_update`` / ``selective_state_update`` reference code: mamba_ssm and causal_conv1d are GPU
kernels); devin-compile runs ``devin::mamba2_scan`` over its state pool. Both engines run the same prompt,
greedy, exactly ``--new-tokens`` tokens, batch 1, their repeats interleaved (HF, devin-compile, HF, ...; each
repeat after its own excluded warm-up run, and a whole first round excluded) so load drifting on a shared machine
skews both alike; figures are medians. Also checks the greedy tokens agree. Writes bench/results/recurrent.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import devin_compile  # noqa: E402
from devin_compile.benchmarking import DecodeTiming, time_devin_decode, time_hf_decode  # noqa: E402


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.machine())
    except OSError:
        return platform.machine()


def tiny_hybrid(hidden: int, layers: int):
    from transformers import AutoModelForCausalLM, BambaConfig

    heads = hidden // 64
    cfg = BambaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=max(heads, 1), num_key_value_heads=max(heads // 2, 1),
                      attn_layer_indices=list(range(3, layers, 4)), mamba_n_heads=hidden * 2 // 64, mamba_d_head=64,
                      mamba_d_state=64, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64,
                      max_position_embeddings=2048, tie_word_embeddings=False, pad_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()


def _median(timings: list) -> DecodeTiming:
    """One timing whose tokens/s and TTFT are the medians of ``timings`` (their tokens: the last run's)."""
    return DecodeTiming(timings[0].name, statistics.median(t.decode_tok_s for t in timings),
                        statistics.median(t.ttft_s for t in timings), timings[-1].tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "recurrent.json"))
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    model = tiny_hybrid(args.hidden, args.layers)
    ids = torch.randint(3, 4096, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    opt = devin_compile.optimize(model)
    # One round discarded first: the first engine runs after optimize() are still slow (lazy kernel builds and
    # first-touch of the step shapes), beyond time_devin_decode's own warm-up run.
    runs = [(time_hf_decode(model, ids, args.new_tokens, 1), time_devin_decode(opt, ids, args.new_tokens, 1))
            for _ in range(args.repeats + 1)][1:]
    hf, dv = (_median([r[i] for r in runs]) for i in (0, 1))
    row = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "hidden": args.hidden, "layers": args.layers, "mixers": len(opt.info.recurrent_modules),
           "prompt_tokens": len(ids), "new_tokens": args.new_tokens, "repeats": args.repeats,
           "hf_decode_tok_s": hf.decode_tok_s, "devin_decode_tok_s": dv.decode_tok_s,
           "decode_speedup": dv.decode_tok_s / hf.decode_tok_s,
           "hf_ttft_ms": hf.ttft_s * 1e3, "devin_ttft_ms": dv.ttft_s * 1e3,
           "same_greedy_tokens": hf.tokens == dv.tokens}
    print(f"{row['cpu']}, {row['threads']} threads, Bamba-style hybrid hidden {args.hidden}, {args.layers} layers "
          f"({row['mixers']} Mamba2 mixers), fp32, batch 1, medians of {args.repeats}")
    print(f"  decode tok/s: HF eager {hf.decode_tok_s:.1f}  devin-compile {dv.decode_tok_s:.1f}  "
          f"ratio {row['decode_speedup']:.2f}x")
    print(f"  TTFT ms ({len(ids)}-token prompt): HF eager {row['hf_ttft_ms']:.1f}  "
          f"devin-compile {row['devin_ttft_ms']:.1f}")
    print(f"  same greedy tokens: {row['same_greedy_tokens']}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(row, f, indent=2)


if __name__ == "__main__":
    main()
