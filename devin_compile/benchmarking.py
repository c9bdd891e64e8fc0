"""Side-by-side timing helpers shared by ``devin-compile run`` and ``bench/``.

Decode tokens/s counts tokens after the first one, over the time after the first
token appeared, so prefill cost is reported separately as time to first token (TTFT).
Every figure is a median over ``repeats`` runs, after one excluded full-length warm-up run.
Both timers run with the arena reuse pool of :mod:`~devin_compile.runtime.arena_reuse` in place
(the engine installs it), so HF and devin-compile see the same interpreter.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass

import torch

from .runtime import arena_reuse


@dataclass
class DecodeTiming:
    name: str
    decode_tok_s: float
    ttft_s: float
    tokens: list[int]

    def row(self) -> str:
        return f"{self.name:24} {self.decode_tok_s:10.1f} tok/s   TTFT {self.ttft_s * 1e3:8.1f} ms"


def hf_peer_dtype(model) -> tuple[torch.dtype, str]:
    """The dtype to time HF eager in, and why when it is not the model's: a CPU model in bfloat16 or
    float16 without native oneDNN GEMMs for it (e.g. AVX2 without AVX-512 BF16/AMX) runs HF's linears
    on a slow fallback (~0.5 tok/s on SmolLM2), so its fair peer there is HF in float32."""
    from .ops.onednn_linear import onednn_supports  # oneDNN has native kernels for the dtype

    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype == torch.float32 or onednn_supports(p.dtype):
        return p.dtype, ""
    return torch.float32, f"{str(p.dtype).replace('torch.', '')} is not native on this CPU"


def time_hf_decode(model, prompt_ids: list[int], new_tokens: int, repeats: int = 3,
                   name: str = "HF eager", **generate_kw) -> DecodeTiming:
    """HF eager ``generate`` (greedy, exactly ``new_tokens``, EOS ignored), batch 1. ``generate_kw``
    go to ``generate`` (e.g. ``cache_implementation="static"``: on CUDA, transformers then compiles
    the decoding forward with ``mode="reduce-overhead"``, the gpt-fast recipe)."""
    arena_reuse.install()
    ids = torch.tensor([prompt_ids], device=next(model.parameters()).device)
    # EOS ignored the way devin-compile's ignore_eos does it: eos_token_id=None makes EOS an
    # ordinary token (min_new_tokens alone would forbid it and so change the greedy picks).
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=pad, **generate_kw)
    rates, ttfts, out = [], [], None
    with torch.inference_mode():
        # warm-up: one full-length run, excluded (as for devin-compile below)
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        for _ in range(repeats):
            rate, ttft, out = hf_decode_round(model, ids, new_tokens, **kw)
            ttfts.append(ttft)
            rates.append(rate)
    if out.shape[1] - len(prompt_ids) != new_tokens:
        raise RuntimeError(f"HF generated {out.shape[1] - len(prompt_ids)} tokens, expected {new_tokens}")
    return DecodeTiming(name, statistics.median(rates), statistics.median(ttfts),
                        out[0, len(prompt_ids):].tolist())


def hf_decode_round(model, ids: torch.Tensor, new_tokens: int, **kw) -> tuple[float, float, torch.Tensor]:
    """One timed HF round: the first token alone (TTFT), then ``new_tokens`` → (decode tokens/s after the first
    token, TTFT seconds, the generated ids [1, T + new])."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        total = time.perf_counter() - t0
    return (new_tokens - 1) / max(total - ttft, 1e-9), ttft, out


def parse_options(pairs: list[str]) -> dict:
    """``OPTION=VALUE`` strings (a bench's ``--base``) → optimize() options: true/false and integers parsed."""
    return {k: json.loads(v.lower()) if v.lower() in ("true", "false") or v.isdigit() else v
            for k, v in (o.split("=", 1) for o in pairs)}


def time_devin_decode(opt, prompt_ids: list[int], new_tokens: int, repeats: int = 3,
                      name: str = "devin-compile") -> DecodeTiming:
    """``OptimizedModel`` through its engine (greedy, exactly ``new_tokens``), batch 1."""
    return time_devin_decodes({name: opt}, prompt_ids, new_tokens, repeats)[0]


def time_devin_decodes(opts: dict, prompt_ids: list[int], new_tokens: int, repeats: int = 3,
                       others: dict | None = None) -> list[DecodeTiming]:
    """Several ``OptimizedModel``s (``{name: opt}``) timed like :func:`time_devin_decode`, with
    their repeats interleaved (A, B, A, B, ...) so a ratio between them is not skewed by the
    machine's load drifting between one's repeats and the other's. ``others`` (``{name: fn}``,
    e.g. a peer engine) join the rotation: each call of ``fn()`` runs one repeat and returns
    its decode tokens/s (their rows have no TTFT or tokens)."""
    from .runtime.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for opt in opts.values():
        opt.wait_until_ready()
        opt.engine.generate([prompt_ids], params)  # warm-up: one full-length run, excluded
    rates = {name: [] for name in opts}
    ttfts = {name: [] for name in opts}
    tokens = {}
    for _ in range(repeats):
        for name, opt in opts.items():
            opt.engine.reset_prefix_cache()  # every repeat prefills cold, like HF's
            out = opt.engine.generate([prompt_ids], params)[0]
            m = out.metrics
            ttfts[name].append(m.ttft)
            rates[name].append((new_tokens - 1) / max(m.finished - m.first_token, 1e-9))
            tokens[name] = out.output_ids
        for name, fn in (others or {}).items():
            rates.setdefault(name, []).append(float(fn()))
    return [DecodeTiming(name, statistics.median(rates[name]), statistics.median(ttfts[name]), tokens[name])
            for name in opts] + [DecodeTiming(name, statistics.median(rates[name]), float("nan"), [])
                                 for name in (others or {})]


# -- this machine's limits, measured in the run that quotes a share of them ------------------------
def cpu_info() -> dict:
    """The CPU's model name, the ISA flags that matter for these kernels, torch's threads, the cores and the
    load average (the name alone can hide the ISA; a shared machine's load moves every figure)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    isa = sorted(f for f in info.get("flags", "").split()
                 if f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile"))
    return {"cpu": info.get("model name", "?"), "isa": isa, "threads": torch.get_num_threads(),
            "cores": os.cpu_count(), "loadavg": os.getloadavg(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}


def median_time(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls, after one excluded call."""
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def read_bandwidth(repeats: int = 9) -> float:
    """Read bandwidth in bytes/s: a 256 MiB float32 sum with torch's threads (the memory roofline of a
    decode step, which streams its weights once)."""
    x = torch.ones(64 * 1024 * 1024, dtype=torch.float32)
    return x.nbytes / median_time(lambda: x.sum(), repeats)


def gemm_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of one n×n×n ``F.linear`` in ``dtype`` (the compute roofline of a batched step)."""
    a = torch.randn(n, n).to(dtype)
    w = torch.randn(n, n).to(dtype)
    with torch.inference_mode():
        return 2 * n ** 3 / median_time(lambda: torch.nn.functional.linear(a, w), repeats)
