"""Kernels behind ``devin::int4_linear`` (see :mod:`devin_compile.backends.int4.format` for the format).

Four kernels, named by the op's ``kernel`` argument:

- ``"reference"``: unpack, dequantize to fp32, one fp32 matmul, cast to x's dtype. The
  oracle of the tests; any device.
- ``"cpu"``: ``aten._weight_int4pack_mm_for_cpu`` over weights packed by
  ``aten._convert_weight_to_int4pack_for_cpu``. Fast for bf16/fp16 activations at a few
  tokens (1 token of SmolLM2's 30 layers: ~2 ms vs ~4 ms for oneDNN bf16 linears on this
  machine) and slow above ~4 tokens, where the bf16 GEMM uses the CPU's matrix units, and
  very slow for fp32 activations (no vectorised fp32 path: ~50x oneDNN fp32).
- ``"cpu_c"``: devin-compile's own C kernel (:mod:`.cpu_int4_linear`): streams 4-bit weights
  at a few rows for float32, bf16 and fp16 activations alike (one row of bf16/fp16: integer dot
  products over x rounded per group to int16); the CPU default where a C
  compiler is found.
- ``"triton"``: a dequantize-GEMM (:mod:`.int4_triton`) that reads the stored nibble
  layout directly; CUDA, or CPU under ``TRITON_INTERPRET=1`` (tests).

:func:`prepare` turns a logical int4 weight into a kernel's operands once, at compile
time; :func:`run` is what the op calls per step.
"""
from __future__ import annotations

import importlib.util
import os

import torch

from . import format as fmt
from . import cpu_int4_linear, cpu_int4_op

KERNELS = ("reference", "cpu", "cpu_c", "triton")

_HAVE_TRITON = importlib.util.find_spec("triton") is not None


def triton_available(device: torch.device) -> bool:
    if not _HAVE_TRITON:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def cpu_kernel_fast(kernel: str, dtype: torch.dtype) -> bool:
    """Whether CPU int4 ``kernel`` beats dense linears at a few tokens for ``dtype`` activations:
    aten's only for half precision, the C kernel for all three."""
    return kernel == "cpu_c" or dtype in (torch.bfloat16, torch.float16)


def default_cpu_kernel() -> str:
    """"cpu_c" where the C kernel builds, else aten's "cpu"."""
    return "cpu_c" if cpu_int4_linear.available() else "cpu"


def prepare(kernel: str, q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor, group_size: int,
            dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight, scales_zeros) in ``kernel``'s layout, on ``device``, scales in ``dtype``."""
    if kernel == "cpu":
        packed, sz = fmt.pack_for_cpu(q, scale, minv, group_size, dtype)
        return packed.to(device), sz.to(device)
    if kernel == "cpu_c":
        cpu_int4_op.load()  # the op's C++ CPU kernel, for the per-step calls (falls back to Python)
        qw, scales = cpu_int4_linear.pack(q, scale, minv, group_size)
        return qw.to(device), scales.to(device)
    if kernel in ("reference", "triton"):
        kp = fmt.padded_k(q.shape[1], group_size)
        qp = torch.nn.functional.pad(q, (0, kp - q.shape[1]))
        return fmt.pack_nibbles(qp).to(device), fmt.scales_zeros(scale, minv, dtype).to(device)
    raise ValueError(f"int4 kernel {kernel!r} is unknown; valid: {list(KERNELS)}")


def _pad_k(x2: torch.Tensor, kp: int) -> torch.Tensor:
    return x2 if x2.shape[1] == kp else torch.nn.functional.pad(x2, (0, kp - x2.shape[1]))


def reference_int4_mm(x2: torch.Tensor, qweight: torch.Tensor, sz: torch.Tensor, group_size: int,
                      n: int) -> torch.Tensor:
    kp = sz.shape[0] * group_size
    q = fmt.unpack_nibbles(qweight, kp)[:n].float()
    s = sz[:, :n, 0].t().float().repeat_interleave(group_size, 1)
    z = sz[:, :n, 1].t().float().repeat_interleave(group_size, 1)
    w = (q - 8) * s + z
    return (_pad_k(x2, kp).float() @ w.t()).to(x2.dtype)


def cpu_int4_mm(x2: torch.Tensor, qweight: torch.Tensor, sz: torch.Tensor, group_size: int, n: int) -> torch.Tensor:
    kp = sz.shape[0] * group_size
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(_pad_k(x2, kp).contiguous(), qweight, group_size, sz)
    return y if y.shape[1] == n else y[:, :n]


def triton_int4_mm(x2: torch.Tensor, qweight: torch.Tensor, sz: torch.Tensor, group_size: int, n: int) -> torch.Tensor:
    if not _HAVE_TRITON:
        raise RuntimeError("the triton int4 kernel needs triton installed (pip install triton)")
    m, k = x2.shape
    kp = sz.shape[0] * group_size
    x2 = x2.contiguous()
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    block_m = 16 if m <= 16 else 64
    block_n = 64
    block_k = min(32, group_size)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    grid = (-(-m // block_m), -(-n // block_n))
    from .triton_kernel import int4_mm_kernel  # imported on first use: triton.jit reads TRITON_INTERPRET then

    int4_mm_kernel[grid](x2, qweight, sz, y, m, n, k, kp, x2.stride(0), qweight.stride(0), y.stride(0),
                          GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                          DOT_FP32=interpret or x2.dtype == torch.float32)
    return y


_RUN = {"reference": reference_int4_mm, "cpu": cpu_int4_mm, "cpu_c": cpu_int4_linear.int4_mm, "triton": triton_int4_mm}


def run(x: torch.Tensor, qweight: torch.Tensor, scales_zeros: torch.Tensor, group_size: int, out_features: int,
        kernel: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x[..., K] @ dequant(W)ᵀ (+ bias)`` → [..., N] with ``kernel``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    y = _RUN[kernel](x2, qweight, scales_zeros, group_size, out_features)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, out_features)
