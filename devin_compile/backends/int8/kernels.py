"""Kernels behind ``devin::int8_linear`` and ``devin::int8_embedding`` (the format: :mod:`.format`),
named by the ops' ``kernel``:

- ``"reference"``: the logical int8 ``[N, K]`` codes; the linear is ``(x @ qᵀ) · scale`` in float32
  (any device, the tests' oracle).
- ``"cpu_c"``: the codes in the pair layout of :func:`~..fp8.cpu_fp8_linear.pack`, multiplied by
  the FP8 C kernel's int8 decoder (:func:`~..fp8.cpu_fp8_linear.fp8_mm` with ``codes="int8"``):
  one byte a weight streamed once per tile of rows; the CPU default where a C compiler is found.

:func:`prepare` puts a logical weight into a kernel's operands once, at compile time; :func:`run`
multiplies and :func:`rows` reads whole rows (a tied embedding's lookup).
"""
from __future__ import annotations

import torch

from ..fp8 import cpu_fp8_linear

KERNELS = ("reference", "cpu_c")


def default_kernel(device: torch.device) -> str:
    """"cpu_c" on CPU where the C kernel builds, else "reference"."""
    return "cpu_c" if device.type == "cpu" and cpu_fp8_linear.available() else "reference"


def check_kernel(kernel: str, device: torch.device) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"int8 kernel {kernel!r} is unknown; valid: {list(KERNELS)}")
    if kernel == "cpu_c" and device.type != "cpu":
        raise ValueError(f"int8 kernel 'cpu_c' runs on CPU only, not on {device}; use 'reference'")


def prepare(kernel: str, q: torch.Tensor, scale: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight, scale) for ``kernel`` on ``device``: int8 [N, K] ("reference") or uint8 in the pair
    layout ("cpu_c"), and float32 [N] row scales; new tensors, sharing no storage with ``q`` and ``scale``."""
    check_kernel(kernel, device)
    # own copies, never views of the inputs: a tensor read from a memory-mapped artifact would keep the whole
    # mapping resident (every page loading touched) for the model's life
    qw = q.view(torch.int8)
    qw = cpu_fp8_linear.pack(qw.view(torch.uint8)) if kernel == "cpu_c" else qw.clone(memory_format=torch.contiguous_format)
    return qw.to(device), scale.to(device=device, dtype=torch.float32, copy=True).contiguous()


def run(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, out_features: int, kernel: str,
        bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x[..., K] @ (q · scale)ᵀ (+ bias)`` → [..., N] in x's dtype with ``kernel``."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if kernel == "cpu_c":
        y = cpu_fp8_linear.fp8_mm(x2, qweight, scale, out_features, codes="int8")
    else:
        y = ((x2.float() @ qweight.view(torch.int8).float().t()) * scale[None, :]).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, out_features)


def rows(ids: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, dim: int, kernel: str) -> torch.Tensor:
    """Rows ``ids`` (flat) of the weight, float32 [T, dim]: ``q[ids] · scale[ids]``."""
    if kernel == "cpu_c":
        pairs, kp2 = qweight.shape
        chunks = kp2 // 2 // cpu_fp8_linear.CHUNK
        data = qweight.view(pairs, chunks, 2, cpu_fp8_linear.CHUNK)[torch.div(ids, 2, rounding_mode="floor"), :, ids % 2]
        q = data.reshape(ids.shape[0], chunks * cpu_fp8_linear.CHUNK)[:, :dim].view(torch.int8)
    else:
        q = qweight.view(torch.int8)[ids]
    return q.float() * scale[ids, None]
