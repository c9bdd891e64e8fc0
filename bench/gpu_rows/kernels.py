"""Kernel rows: Triton paged attention and its KV-prune side output against the torch reference,
the FlashAttention adapters where importable (not on the current device image: the row says so)."""
from __future__ import annotations

import importlib.util

import torch

from devin_compile.backends.attention.kv_write import write_kv
from devin_compile.backends.attention.registry import get_backend
from devin_compile.backends.attention.torch_reference import reference_paged_attention
from devin_compile.step import AttentionMetadata

from .common import Run, check


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


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
    _sync(device)
    assert torch.equal(kc, kr) and torch.equal(vc, vr), "cache write differs from the reference"
    err = (out.float() - ref).abs().max().item()
    assert err < 3e-2, f"max error {err:.3e}"
    return err


@check("triton paged attention vs reference", triton=True)
def triton_attention(r: Run):
    device = r.device
    if importlib.util.find_spec("triton") is None:
        return ("skip", "triton not installed")
    errs = {}
    for dtype in (torch.float16, torch.bfloat16):
        for softcap, window, alibi in ((0.0, -1, False), (30.0, -1, False), (0.0, 64, False), (0.0, -1, True)):
            errs[f"{dtype}-cap{softcap}-win{window}-alibi{alibi}"] = _compare("triton", device, dtype, softcap=softcap,
                                                                             window=window, alibi=alibi)
    return f"max error {max(errs.values()):.2e} over {len(errs)} cases"


@check("triton KV-prune attention mass (side output) vs reference", triton=True)
def triton_mass(r: Run):
    device = r.device
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
        _sync(device)
        for b in rows:
            err = (mass[b].float() - ref[b].float()).abs().max().item()
            assert err < 2e-2, f"{dtype} row {b}: max mass error {err:.3e}"
            worst = max(worst, err)
    return f"max mass error {worst:.2e} (fp32 and bf16, decode + prefill rows)"


@check("FlashAttention-3 / -2 adapters vs reference", cuda_only=True)
def flash(r: Run):
    device = r.device
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
