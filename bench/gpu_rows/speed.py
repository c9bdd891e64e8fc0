"""Speed and memory rows on a Llama-3.2-1B-shaped model (bf16, seeded random weights; speed does
not depend on the weights): batch-1 decode against HF eager and HF's static cache + torch.compile,
the share of the memory roofline, batch-64 mixed lengths against HF continuous batching, INT4
(Triton) and FP8 (``torch._scaled_mm``) end to end, and offloading the embedding and head."""
from __future__ import annotations

import random
import time

import torch

import devin_compile
from devin_compile import SamplingParams
from devin_compile.benchmarking import time_devin_decode, time_hf_decode

from .common import Run, byte_tokenizer, check, copy_bandwidth, llama_1b_shaped, prompt, smollm2_shaped, weight_bytes

PROMPT_LEN, NEW = 32, 128


def _kv_bytes_read(model, tokens: int) -> int:
    """K/V bytes one decode step reads at ``tokens`` cached tokens (bf16)."""
    c = model.config
    return tokens * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2


@check("1B shape, bf16, batch 1: devin (CUDA Graphs) vs HF eager vs HF static cache + compile; roofline", need_s=150)
def batch1(r: Run):
    model = llama_1b_shaped(torch.bfloat16, r.device, r.smoke)
    ids = prompt(PROMPT_LEN, model.config.vocab_size, seed=7)
    new = 16 if r.smoke else NEW
    opt = devin_compile.optimize(model, kv_cache_memory=2 << 30)
    dv = time_devin_decode(opt, ids, new, 3)
    graphs = opt.engine.runner.decode_graphs
    out = {"devin_tok_s": dv.decode_tok_s, "cuda_graphs": graphs is not None and graphs.mode == "cuda_graph"}
    del opt
    hf = time_hf_decode(model, ids, new, 3)
    out["hf_eager_tok_s"] = hf.decode_tok_s
    if r.device.type == "cuda":  # transformers compiles the decoding forward of a static cache (reduce-overhead)
        st = time_hf_decode(model, ids, new, 3, name="HF static+compile", cache_implementation="static")
        out["hf_static_compile_tok_s"] = st.decode_tok_s
        out["vs_hf_static_compile"] = dv.decode_tok_s / st.decode_tok_s
    out["vs_hf_eager"] = dv.decode_tok_s / hf.decode_tok_s
    bw = copy_bandwidth(r.device, mib=64 if r.smoke else 1024)
    step_bytes = weight_bytes(model) + _kv_bytes_read(model, PROMPT_LEN + new // 2)
    out["copy_bandwidth_gb_s"] = bw / 1e9
    out["bytes_per_step_mb"] = step_bytes / 1e6
    out["roofline"] = f"roofline {100 * step_bytes * dv.decode_tok_s / bw:.0f}%"
    out["same_greedy_as_hf"] = dv.tokens == hf.tokens
    return out


def _mixed_work(vocab: int, n: int, smoke: bool) -> list[tuple[list[int], int]]:
    """``n`` requests, long-tailed prompt lengths (16..1024) and 16..256 new tokens, seeded."""
    rng = random.Random(64)
    top = 6 if smoke else 10
    return [(prompt(int(2 ** rng.uniform(4, top)), vocab, seed=1000 + i), int(2 ** rng.uniform(4, 8 if not smoke else 5)))
            for i in range(n)]


def _devin_throughput(opt, work) -> float:
    eng = opt.engine
    t0 = time.perf_counter()
    for p, n in work:
        eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    return sum(n for _, n in work) / (time.perf_counter() - t0)


def _hf_cb_throughput(model, work) -> float:
    """HF's continuous batching (``generate_batch``), per-request ``max_new_tokens``, EOS ignored."""
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=max(n for _, n in work), do_sample=False, eos_token_id=None, pad_token_id=0)
    t0 = time.perf_counter()
    outs = model.generate_batch(inputs=[p for p, _ in work], generation_config=gc)  # (its own no-grad thread)
    wall = time.perf_counter() - t0
    errors = [o.error for o in outs.values() if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(outs)} HF requests failed: {errors[0]}")
    # HF runs every request to the longest max_new_tokens; count each request's own tokens only
    return sum(min(len(o.generated_tokens), n) for o, (_, n) in zip(outs.values(), work)) / wall


@check("1B shape, bf16, 64 mixed-length requests: devin vs HF continuous batching", need_s=90)
def batch64(r: Run):
    model = llama_1b_shaped(torch.bfloat16, r.device, r.smoke)
    work = _mixed_work(model.config.vocab_size, 64 if not r.smoke else 8, r.smoke)
    opt = devin_compile.optimize(model, kv_cache_memory=8 << 30 if not r.smoke else 64 << 20)
    _devin_throughput(opt, work[:4])  # warm-up
    out = {"requests": len(work), "generated": sum(n for _, n in work), "devin_tok_s": _devin_throughput(opt, work)}
    del opt
    try:
        out["hf_cb_tok_s"] = _hf_cb_throughput(model, work)
        out["vs_hf_cb"] = out["devin_tok_s"] / out["hf_cb_tok_s"]
    except Exception as e:  # noqa: BLE001  (the peer failing is reported with devin's own figure)
        out["hf_cb_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def _top1(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


@check("INT4 (Triton) and FP8 (scaled_mm) end to end: decode tok/s vs bf16, top-1 agreement", need_s=120)
def quantized(r: Run):
    model = llama_1b_shaped(torch.bfloat16, r.device, r.smoke)
    ids = prompt(PROMPT_LEN, model.config.vocab_size, seed=11)
    probe = prompt(256 if not r.smoke else 48, model.config.vocab_size, seed=12)
    new = 16 if r.smoke else 64
    calib = dict(method="rtn", group_size=64, calib_chunks=2, calib_len=256, progress=False)
    kw = dict(kv_cache_memory=1 << 30 if not r.smoke else 64 << 20, tokenizer=byte_tokenizer())
    base = devin_compile.optimize(model, **kw)
    ref_logits = base.engine.forward_logits(probe).float()
    out = {"bf16_tok_s": time_devin_decode(base, ids, new, 3).decode_tok_s}
    del base
    for label, q in (("int4", {}), ("fp8", {"tiers": "fp8"})):
        try:
            opt = devin_compile.optimize(model, quantization={**calib, **q}, **kw)
        except Exception as e:  # noqa: BLE001  (one tier failing leaves the other's figures)
            out[label] = f"FAIL {type(e).__name__}: {str(e)[:200]}"
            continue
        kernels = sorted({row.get("kernel", row.get("precision")) for row in (opt.precision_table or [])
                          if isinstance(row, dict)})
        tok_s = time_devin_decode(opt, ids, new, 3).decode_tok_s
        out[label] = {"tok_s": tok_s, "vs_bf16": tok_s / out["bf16_tok_s"], "kernels": kernels,
                      "top1_vs_bf16": _top1(opt.engine.forward_logits(probe).float(), ref_logits)}
        del opt
    return out


@check("offload embed_tokens + lm_head: device memory saved, step time, same tokens", need_s=60, cuda_only=True)
def offload(r: Run):
    res = {}
    for label, layers in (("off", ()), ("on", ("embed_tokens", "lm_head"))):
        torch.cuda.empty_cache()
        model = smollm2_shaped(torch.bfloat16, r.device, r.smoke)
        ids = prompt(24, model.config.vocab_size, seed=1)
        opt = devin_compile.optimize(model, offload_layers=list(layers), kv_cache_memory=256 << 20)
        del model
        torch.cuda.synchronize()
        mem = torch.cuda.memory_allocated()
        t = time_devin_decode(opt, ids, 64, 3)
        res[label] = {"device_bytes": mem, "decode_tok_s": t.decode_tok_s, "tokens": t.tokens}
        del opt
    same = res["on"].pop("tokens") == res["off"].pop("tokens")
    res["saved_mib"] = (res["off"]["device_bytes"] - res["on"]["device_bytes"]) / 2**20
    res["step_time_ratio"] = res["off"]["decode_tok_s"] / res["on"]["decode_tok_s"]
    res["same_greedy"] = same
    assert same, "offload changed the greedy tokens"
    return res
