"""Kernels behind ``devin::fp8_linear`` (the format: :mod:`.format`), named by the op's ``kernel``:

- ``"reference"``: dequantize to float32, one float32 matmul, cast to x's dtype. The oracle of
  the tests; any device.
- ``"cpu_c"``: devin-compile's C kernel (:mod:`.cpu_fp8_linear`, rows packed in pairs); the CPU
  default where a C compiler is found.
- ``"scaled_mm"``: ``torch._scaled_mm`` on GPUs with FP8 tensor cores (CUDA compute capability
  >= 8.9): each row of x is rounded to e4m3 with its own absmax scale (so on this path
  activations are FP8 too: W8A8, not weight-only), the e4m3 product runs with unit tensorwise
  scales into float32, and the row scales of x and of the weight multiply the result. Shapes
  whose K or N is not a multiple of 16 (cuBLASLt's requirement) take the reference. **Not yet
  run on a GPU**: tested on CPU, where torch 2.13 also implements ``_scaled_mm``.

:func:`prepare` puts a logical weight into a kernel's operands once, at compile time; :func:`run`
is what the op calls per step.
"""
from __future__ import annotations

import torch

from . import cpu_fp8_linear, cpu_fp8_op
from .format import FP8_MAX, dequantize

KERNELS = ("reference", "cpu_c", "scaled_mm")
# Steps of more rows than this run the dense copy instead of the C kernel, by activation dtype and the
# dense path this CPU takes (bench/quant.py --parts fp8, bench/results/quant-fp8-kernel.json: SmolLM2's
# gate/up and down shapes, 30 distinct copies streamed, a 2-core AMD EPYC with AVX-512 BF16/VBMI):
# float32 activations: FP8 3.4x oneDNN fp32 at 1 row, 1.8-2.6x at 4, 1.4x at 8, even at 16; bf16
# against native oneDNN bf16: 2-2.9x at 1 row, 1.2-1.6x at 4, 0.9x at 8; bf16 where the dense copy
# runs as float32 GEMMs (no native bf16): taken as float32's (not measured).
MAX_FP8_TOKENS = {("fp32", True): 8, ("fp32", False): 8, ("half", True): 4, ("half", False): 8}


def max_fp8_tokens(dtype: torch.dtype, dense_native: bool) -> int:
    """Steps of more tokens than this use the dense copy (``dense_native``: oneDNN runs ``dtype`` natively)."""
    return MAX_FP8_TOKENS[("fp32" if dtype == torch.float32 else "half", dense_native)]


def has_fp8_matmul(device: torch.device) -> bool:
    """Whether ``device`` has FP8 tensor cores for ``torch._scaled_mm`` (CUDA compute capability >= 8.9)."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)


def default_kernel(device: torch.device) -> str:
    """"cpu_c" on CPU where it builds, "scaled_mm" on GPUs with FP8 matmuls, else "reference"."""
    if device.type == "cpu":
        return "cpu_c" if cpu_fp8_linear.available() else "reference"
    return "scaled_mm" if has_fp8_matmul(device) else "reference"


def prepare(kernel: str, q: torch.Tensor, scale: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight, scale) for ``kernel`` on ``device``: the codes as uint8 [N, K] (``cpu_c``: in
    :func:`.cpu_fp8_linear.pack`'s pair layout; ``scaled_mm``: viewed as float8_e4m3fn) and the
    float32 row scales [N]."""
    if kernel not in KERNELS:
        raise ValueError(f"fp8 kernel {kernel!r} is unknown; valid: {list(KERNELS)}")
    qw = q.to(torch.uint8).contiguous()
    if kernel == "cpu_c":
        cpu_fp8_op.load()  # the op's C++ CPU kernel, for the per-step calls (falls back to Python)
        qw = cpu_fp8_linear.pack(qw)
    if kernel == "scaled_mm":
        qw = qw.view(torch.float8_e4m3fn)
    return qw.to(device), scale.float().contiguous().to(device)


def reference_fp8_mm(x2: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    return (x2.float() @ dequantize(qweight.view(torch.uint8), scale).t()).to(x2.dtype)


def quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x to e4m3 with its own absmax scale → (codes float8_e4m3fn [M, K], scales fp32 [M, 1])."""
    amax = x2.float().abs().amax(dim=1, keepdim=True)
    sx = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x2.float() / sx).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), sx


def scaled_mm_fp8(x2: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    m, k = x2.shape
    if k % 16 or n % 16:
        return reference_fp8_mm(x2, qweight, scale, n)
    pad = -m % 16
    xp = torch.nn.functional.pad(x2, (0, 0, 0, pad)) if pad else x2
    xq, sx = quantize_rows(xp)
    one = torch.ones((), dtype=torch.float32, device=x2.device)
    y = torch._scaled_mm(xq, qweight.view(torch.float8_e4m3fn).t(), scale_a=one, scale_b=one,
                         out_dtype=torch.float32)  # row-major x, column-major weight (a transposed [N, K])
    return (y[:m] * sx[:m] * scale[None, :]).to(x2.dtype)


_RUN = {"reference": reference_fp8_mm, "cpu_c": cpu_fp8_linear.fp8_mm, "scaled_mm": scaled_mm_fp8}


def run(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, out_features: int, kernel: str,
        bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x[..., K] @ (e4m3(q) · scale)ᵀ (+ bias)`` → [..., N] with ``kernel``."""
    lead = x.shape[:-1]
    y = _RUN[kernel](x.reshape(-1, x.shape[-1]), qweight, scale, out_features)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, out_features)
