"""Every GPU check in one command: the one script to run on a lent H100/H200 (≤ 8 minutes, no downloads).

    python bench/gpu_check.py [--out bench/results/gpu_check.json] [--budget-s 420]
    python bench/gpu_check.py --smoke     # the same rows at tiny shapes on this CPU (checks the script;
                                          # TRITON_INTERPRET=1 adds the kernel rows, through the interpreter)

Rows (bench/gpu_rows/), each ok / FAIL / skipped with its figures; a failing row does not stop the
others, and a row that would start past the time budget is skipped and says so. Models are built
from transformers configs with seeded random weights on the device.

1. kernels: ``triton`` paged attention and its KV-prune side output vs the torch reference; the
   FlashAttention-3/-2 adapters where importable (the current image has neither: the row says so).
2. parity: four tiny families (llama, qwen2, mistral, gemma2) and a SmolLM2-shaped model: greedy
   tokens identical to HF eager (fp32); bf16 teacher-forced logits within twice HF's own bf16 error.
3. CUDA-Graph decode vs uncaptured: identical greedy tokens (fp32), step time per bucket (bf16).
4. Llama-3.2-1B shape, bf16, batch 1: devin vs HF eager vs HF static cache + ``torch.compile``
   (reduce-overhead); the share of the memory roofline (bytes per step × tok/s ÷ a device copy's
   bandwidth measured in the same run).
5. the same model, 64 mixed-length requests: devin vs HF continuous batching (``generate_batch``).
6. INT4 (Triton) and FP8 (``torch._scaled_mm``, compute capability ≥ 8.9) end to end: tok/s vs bf16,
   top-1 agreement with bf16.
7. ``offload_layers=["embed_tokens", "lm_head"]``: device memory saved, step time, same tokens.

Writes the rows to ``--out`` (JSON) and the table beside it (``.md``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from gpu_rows.common import Run  # noqa: E402
from gpu_rows.kernels import flash, triton_attention, triton_mass  # noqa: E402
from gpu_rows.parity import cuda_graphs, parity  # noqa: E402
from gpu_rows.speed import batch1, batch64, offload, quantized  # noqa: E402

# in priority order: what must be known first runs first, so a short budget cuts the least
ROWS = (triton_attention, triton_mass, flash, parity, cuda_graphs, batch1, batch64, quantized, offload)


def table(run: Run) -> str:
    lines = ["| check | status | s | detail |", "|---|---|---:|---|"]
    for r in run.rows:
        lines.append(f"| {r['check']} | {r['status']} | {r['seconds']} | {json.dumps(r['detail'], default=str)[:600]} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gpu_check.json"))
    ap.add_argument("--budget-s", type=float, default=420.0, help="rows that would start later are skipped")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script")
    args = ap.parse_args()
    if args.smoke:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("no CUDA device: this script is for a GPU machine (--smoke runs it at tiny shapes on the CPU)")
        sys.exit(2)
    else:
        device = torch.device("cuda")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)"
    import transformers

    print(f"device: {name} | torch {torch.__version__} | transformers {transformers.__version__}", flush=True)
    run = Run(device, args.smoke, time.perf_counter() + args.budget_s)
    for row in ROWS:
        row(run)
    md = table(run)
    print("\n" + md)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": name, "torch": torch.__version__, "transformers": transformers.__version__,
                   "rows": run.rows}, f, indent=2, default=str)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(f"{name} · torch {torch.__version__} · transformers {transformers.__version__}\n\n{md}\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
