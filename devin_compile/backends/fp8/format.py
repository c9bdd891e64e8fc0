"""FP8 weight format: e4m3fn values with one float32 scale per output channel.

Logical form of a quantized ``[N, K]`` weight (the one contract the quantizer, every kernel and
the artifact share)::

    q      uint8  [N, K]   e4m3fn bit patterns (sign, 4 exponent bits with bias 7, 3 mantissa bits)
    scale  fp32   [N]      amax of the row / 448 (448: e4m3fn's largest finite value)
    w[n, k] = e4m3(q[n, k]) * scale[n]

Quantizing rounds ``w / scale`` to the nearest e4m3fn value (torch's cast: round half to even),
so no value saturates and the NaN codes (0x7F, 0xFF) never occur. A row of zeros gets scale 1.
The relative rounding error of a normal value is at most 2⁻⁴; values below 2⁻⁶ · scale are
subnormal (absolute error at most 2⁻¹⁰ · scale).
"""
from __future__ import annotations

import functools

import torch

FP8_MAX = 448.0
NAN_CODES = (0x7F, 0xFF)


@functools.lru_cache(maxsize=None)
def lut() -> torch.Tensor:
    """The 256-entry table e4m3fn code → float32 (codes 0x7F and 0xFF are NaN)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``w`` [N, K] to e4m3fn with per-row absmax scales → (q uint8 [N, K], scale fp32 [N])."""
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1) if wf.shape[1] else torch.zeros(wf.shape[0])
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).contiguous(), scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``e4m3(q) * scale[:, None]`` in float32, then cast to ``dtype``."""
    return (q.view(torch.float8_e4m3fn).float() * scale.float()[:, None]).to(dtype)


def fp8_bytes(n: int, k: int) -> int:
    """Storage of one FP8 linear: a byte per weight and a float32 scale per output row."""
    return n * k + 4 * n


def has_nan_codes(q: torch.Tensor) -> bool:
    return bool(((q == NAN_CODES[0]) | (q == NAN_CODES[1])).any())
