"""Parity rows: devin-compile on the device against HF eager, and CUDA-Graph decode against uncaptured."""
from __future__ import annotations

import copy
import statistics
import time

import torch

import devin_compile
from devin_compile import SamplingParams

from .common import FAMILIES, Run, check, family, prompt, smollm2_shaped

NEW = 12


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """HF eager greedy, exactly ``n`` tokens (EOS an ordinary token)."""
    x = torch.tensor([ids], device=next(model.parameters()).device)
    with torch.inference_mode():
        out = model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def _models(r: Run):
    for name in FAMILIES:
        yield name, lambda dtype, name=name: family(name, dtype, r.device)
    yield "smollm2_shape", lambda dtype: smollm2_shaped(dtype, r.device, r.smoke)


def _bf16_logits(model32, opt32_kw: dict, ids: list[int]) -> dict:
    """Teacher-forced logits of devin bf16 and HF bf16 against HF fp32 (max |Δ|, top-1 agreement)."""
    x = torch.tensor([ids], device=next(model32.parameters()).device)
    with torch.inference_mode():
        ref = model32(x).logits[0].float()
        model16 = copy.deepcopy(model32).to(torch.bfloat16)
        hf16 = model16(x).logits[0].float()
        dv16 = devin_compile.optimize(model16, **opt32_kw).engine.forward_logits(ids).float()
    scale = ref.abs().max().item()
    return {"devin_bf16_err": (dv16 - ref).abs().max().item() / scale, "hf_bf16_err": (hf16 - ref).abs().max().item() / scale,
            "devin_bf16_top1": (dv16.argmax(-1) == ref.argmax(-1)).float().mean().item()}


@check("parity on the device: 4 tiny families + SmolLM2 shape (greedy fp32 = HF eager; bf16 logits)", need_s=60)
def parity(r: Run):
    rows, bad = {}, []
    for name, make in _models(r):
        model = make(torch.float32)
        vocab = model.config.vocab_size
        ids = prompt(20, vocab, seed=len(rows))
        kw = dict(kv_cache_memory=256 << 20)
        opt = devin_compile.optimize(model, **kw)
        dv = opt.engine.generate([ids], greedy(NEW))[0].output_ids
        same = dv == hf_greedy(model, ids, NEW)
        row = {"backend": opt.engine.runner.backend.name, "greedy_fp32_same": same, **_bf16_logits(model, kw, ids)}
        # devin's bf16 error may be HF's own bf16 rounding error twice over, plus a little
        row["bf16_ok"] = row["devin_bf16_err"] <= 2 * row["hf_bf16_err"] + 1e-2
        if not (same and row["bf16_ok"]):
            bad.append(name)
        rows[name] = row
        del model, opt
    assert not bad, f"parity fails for {bad}: {rows}"
    return rows


def _decode_step_s(opt, prompts: list[list[int]], repeats: int = 3) -> float:
    """Seconds per decode step of ``len(prompts)`` sequences: (a 33-token run − a 1-token run) / 32."""
    def wall(n: int) -> float:
        opt.engine.reset_prefix_cache()
        t0 = time.perf_counter()
        opt.engine.generate(prompts, greedy(n))
        return time.perf_counter() - t0
    wall(33)  # warm-up
    return statistics.median((wall(33) - wall(1)) / 32 for _ in range(repeats))


@check("CUDA-Graph decode vs uncaptured: identical greedy tokens (fp32), step time per bucket (bf16)",
       need_s=60, cuda_only=True)
def cuda_graphs(r: Run):
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = smollm2_shaped(dtype, r.device, r.smoke)
        kw = dict(kv_cache_memory=1 << 30)
        graphs, plain = devin_compile.optimize(model, **kw), devin_compile.optimize(model, cuda_graphs=False, **kw)
        dg = graphs.engine.runner.decode_graphs
        assert dg is not None and dg.mode == "cuda_graph", f"no CUDA Graphs: {graphs.report()}"
        out["buckets"] = list(dg.buckets)
        for b in (1, 3, 16, 64):
            prompts = [prompt(8 + 5 * i, model.config.vocab_size, seed=100 + i) for i in range(b)]
            if dtype == torch.float32:
                same = ([o.output_ids for o in graphs.engine.generate(prompts, greedy(NEW))]
                        == [o.output_ids for o in plain.engine.generate(prompts, greedy(NEW))])
                assert same, f"batch {b}: CUDA-Graph decode tokens differ from uncaptured"
                out[f"batch{b}_same_tokens"] = same
            else:
                g, p = _decode_step_s(graphs, prompts), _decode_step_s(plain, prompts)
                out[f"batch{b}_step_ms"] = {"graphs": g * 1e3, "uncaptured": p * 1e3, "speedup": p / g}
        out[f"{dtype}_steps_replayed"] = dg.steps
        out[f"{dtype}_recomputes"] = dg.recomputes
        del model, graphs, plain
    return out
