"""The dense copy a weight-only quantized linear keeps for long steps (prefill): which kind, how it
is made (:func:`dense_copy_policy`, what ``assign_precision`` asks) and how a step runs it
(:func:`dense_step`, what ``devin::int4_linear`` and ``devin::fp8_linear`` call).

The ops may carry ``dense``: the weight dequantized once, at compile time, to the activation dtype.
A step of more than ``max_tokens`` rows runs it instead of the quantized kernel: ``dense_kernel=
"mkldnn"`` a oneDNN prepacked weight (:mod:`.onednn_linear`, where this CPU runs the dtype
natively), ``"upcast"`` float32 GEMMs over a half-precision copy (:func:`~.upcast_linear.upcast_linear`,
CPUs without native bf16/fp16 GEMMs), ``"linear"`` a plain ``F.linear``. ``max_tokens=-1`` means
"never the copy".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .onednn_linear import onednn_linear, onednn_supports, prepack_weight
from .upcast_linear import upcast_linear

_DESCRIBE = {"mkldnn": "oneDNN ", "upcast": "float32-GEMM ", "linear": ""}


@dataclass(frozen=True)
class DenseCopyPolicy:
    """How dense copies are made on one device for one activation dtype."""

    device: torch.device
    kernel: str  # the ops' ``dense_kernel``: "mkldnn" | "upcast" | "linear"

    def make(self, weight: torch.Tensor) -> torch.Tensor:
        """The dense copy of a dequantized [N, K] ``weight`` (prepacked for oneDNN where it runs it)."""
        w = weight.to(self.device)
        return prepack_weight(w) if self.kernel == "mkldnn" else w

    @property
    def describe(self) -> str:
        """``"oneDNN "``, ``"float32-GEMM "`` or ``""``: the kind of copy, for reports."""
        return _DESCRIBE[self.kernel]


def dense_copy_policy(device: torch.device, dtype: torch.dtype) -> DenseCopyPolicy:
    """oneDNN prepacked copies on CPUs that run ``dtype`` natively; float32 GEMMs over bf16/fp16 copies on
    CPUs that do not; plain linears elsewhere."""
    if device.type == "cpu" and onednn_supports(dtype):
        return DenseCopyPolicy(device, "mkldnn")
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return DenseCopyPolicy(device, "upcast")
    return DenseCopyPolicy(device, "linear")


def dense_step(x: torch.Tensor, dense: torch.Tensor | None, bias: torch.Tensor | None, max_tokens: int,
               dense_kernel: str) -> torch.Tensor | None:
    """The dense copy's output when this step is long enough to use it, else None (run the quantized kernel)."""
    if dense is None or max_tokens < 0 or x.numel() // x.shape[-1] <= max_tokens:
        return None
    if dense_kernel == "mkldnn":
        return onednn_linear(x, dense, bias)
    if dense_kernel == "upcast":
        return upcast_linear(x, dense, bias, min_rows=0)
    return torch.nn.functional.linear(x, dense, bias)
