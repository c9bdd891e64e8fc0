"""lm-eval through devin-compile's server against lm-eval's own ``hf`` backend, item by item.

    python bench/lm_eval_check.py [--tol 1e-3] [--out bench/results/lm_eval.json]

Needs the bench extra (``pip install -e ".[bench]"``: lm-eval 0.4.x). Runs offline: the tasks read a
local JSONL (``bench/lm_eval_local/``: ``devin_tiny_mc``, 12 multiple-choice items scored by
loglikelihood, and ``devin_tiny_gen``, the same items as greedy ``generate_until``, up to 24
tokens), and both sides load SmolLM2-135M-Instruct's tokenizer and weights from the folder
``devin_compile.models`` caches from the embedded GGUF
(``~/.cache/devin_compile/SmolLM2-135M-Instruct.Q4_1-hf``), with ``HF_HUB_OFFLINE=1`` so nothing is
looked up on the Hub (lm-eval's ``local-completions`` gets that folder as ``tokenizer=``; without it
it would fetch a tokenizer named by ``model``).

1. The embedded SmolLM2 optimized in float32 and served (``BackgroundServer``, an ephemeral port);
   lm-eval's ``local-completions`` runs both tasks against it. For a loglikelihood it sends token ids
   with ``max_tokens: 1, logprobs: 1, echo: true, temperature: 0`` and sums
   ``token_logprobs[ctxlen:-1]``.
2. lm-eval's ``hf`` backend, in this process, on the same weights in float32 (batch size 1).
3. Per (item, choice) loglikelihood differences (must stay within ``--tol``), the chosen answer of
   every item (``acc`` and ``acc_norm``'s argmax), and every generated text (must be identical).

The same by hand, from the repository root, with ``devin-compile serve`` on 127.0.0.1:8000::

    TOK=$HOME/.cache/devin_compile/SmolLM2-135M-Instruct.Q4_1-hf URL=http://127.0.0.1:8000/v1/completions
    HF_HUB_OFFLINE=1 lm_eval --model local-completions --include_path bench/lm_eval_local \\
        --tasks devin_tiny_mc,devin_tiny_gen --log_samples --output_path out/served \\
        --model_args model=smollm2,base_url=$URL,tokenizer_backend=huggingface,tokenizer=$TOK
    HF_HUB_OFFLINE=1 lm_eval --model hf --model_args pretrained=$TOK,dtype=float32 --device cpu \\
        --include_path bench/lm_eval_local --tasks devin_tiny_mc,devin_tiny_gen --log_samples --output_path out/hf
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, ".."))
sys.path.insert(0, ROOT)
TASK_DIR = os.path.join("bench", "lm_eval_local")  # the YAMLs name their data relative to the repo root
TASKS = ["devin_tiny_mc", "devin_tiny_gen"]


def model_folder() -> str:
    """The embedded SmolLM2 as an HF folder (converted from the GGUF on first use)."""
    import torch

    from devin_compile.models import _cache_dir, load_model, smollm2_gguf_path

    load_model(None, torch.float32)  # writes the cached folder the first time
    return str(_cache_dir() / (smollm2_gguf_path().stem + "-hf"))


def evaluate(model: str, model_args: dict) -> tuple[dict, float]:
    """lm-eval's simple_evaluate on the two local tasks: (results with samples, wall seconds)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, batch_size=1,
                                  task_manager=TaskManager(include_path=TASK_DIR), log_samples=True,
                                  device="cpu", random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    return out, time.perf_counter() - t0


def served(folder: str) -> tuple[dict, float]:
    """Both tasks through devin-compile's server (local-completions)."""
    import torch

    from devin_compile import optimize
    from devin_compile.models import load_model
    from devin_compile.serve.app import Server
    from devin_compile.serve.server import BackgroundServer

    model, tok = load_model(None, torch.float32)
    opt = optimize(model, tokenizer=tok)
    with BackgroundServer(Server(opt, "smollm2")) as bg:
        args = {"model": "smollm2", "base_url": bg.url + "/v1/completions", "tokenizer_backend": "huggingface",
                "tokenizer": folder, "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1}
        return evaluate("local-completions", args)


def per_item(results: dict) -> dict:
    """{task: {doc_id: filtered responses}} of a simple_evaluate result."""
    return {task: {s["doc_id"]: s["filtered_resps"] for s in samples}
            for task, samples in results["samples"].items()}


def compare_mc(srv: dict, hf: dict, docs: list[dict]) -> dict:
    """Per (item, choice) loglikelihood differences and each item's argmax (raw and length-normalised)."""
    rows, worst, same, same_norm = [], 0.0, 0, 0
    for doc_id in sorted(hf):
        a = [float(r[0]) for r in srv[doc_id]]
        b = [float(r[0]) for r in hf[doc_id]]
        choices = docs[doc_id]["choices"]
        lens = [len(" " + c) for c in choices]
        diff = max(abs(x - y) for x, y in zip(a, b))
        worst = max(worst, diff)
        pick = (_argmax(a), _argmax(b))
        norm = (_argmax([x / n for x, n in zip(a, lens)]), _argmax([y / n for y, n in zip(b, lens)]))
        same += pick[0] == pick[1]
        same_norm += norm[0] == norm[1]
        rows.append({"doc_id": doc_id, "served": a, "hf": b, "max_abs_diff": diff, "answer_served": pick[0],
                     "answer_hf": pick[1], "answer_norm_served": norm[0], "answer_norm_hf": norm[1],
                     "target": docs[doc_id]["answer"]})
    return {"items": len(rows), "max_abs_diff": worst, "same_answer": same, "same_answer_norm": same_norm,
            "per_item": rows}


def compare_gen(srv: dict, hf: dict) -> dict:
    rows = [{"doc_id": d, "served": srv[d][0], "hf": hf[d][0]} for d in sorted(hf)]
    return {"items": len(rows), "identical": sum(r["served"] == r["hf"] for r in rows), "per_item": rows}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return platform.processor() or platform.machine()


def _argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=xs.__getitem__)


def scores(results: dict) -> dict:
    return {task: {k: v for k, v in r.items() if isinstance(v, (int, float))}
            for task, r in results["results"].items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tol", type=float, default=1e-3, help="largest allowed loglikelihood difference")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "lm_eval.json"))
    args = ap.parse_args()
    os.chdir(ROOT)
    import lm_eval
    import torch

    torch.manual_seed(0)
    folder = model_folder()
    srv_res, srv_s = served(folder)
    hf_res, hf_s = evaluate("hf", {"pretrained": folder, "dtype": "float32"})
    srv, hf = per_item(srv_res), per_item(hf_res)
    with open(os.path.join(TASK_DIR, "tiny_mc.jsonl")) as f:
        docs = [json.loads(line) for line in f if line.strip()]
    mc = compare_mc(srv["devin_tiny_mc"], hf["devin_tiny_mc"], docs)
    gen = compare_gen(srv["devin_tiny_gen"], hf["devin_tiny_gen"])
    ok = mc["max_abs_diff"] <= args.tol and mc["same_answer"] == mc["items"] == mc["same_answer_norm"] \
        and gen["identical"] == gen["items"]
    report = {
        "what": "lm-eval local-completions through devin-compile's server vs lm-eval's hf backend, SmolLM2-135M fp32",
        "command": "python bench/lm_eval_check.py", "machine": cpu_name(), "cpus": os.cpu_count(),
        "lm_eval": lm_eval.__version__, "torch": torch.__version__, "tol": args.tol,
        "ok": ok, "wall_s": {"served": round(srv_s, 1), "hf": round(hf_s, 1)},
        "scores": {"served": scores(srv_res), "hf": scores(hf_res)}, "multiple_choice": mc, "generate_until": gen,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"multiple_choice: {mc['items']} items, max |Δ loglikelihood| {mc['max_abs_diff']:.2e} (tol {args.tol:g}), "
          f"same answer {mc['same_answer']}/{mc['items']} (acc_norm {mc['same_answer_norm']}/{mc['items']})")
    print(f"generate_until: identical {gen['identical']}/{gen['items']}")
    print(f"wall: served {srv_s:.1f} s, hf {hf_s:.1f} s; {'OK' if ok else 'MISMATCH'} -> {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
