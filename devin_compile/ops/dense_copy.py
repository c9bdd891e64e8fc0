"""The dense copy a weight-only quantized linear keeps for long steps (prefill).

``devin::int4_linear`` and ``devin::fp8_linear`` may carry ``dense``: the weight dequantized
once, at compile time, to the activation dtype. A step of more than ``max_tokens`` rows runs it
instead of the quantized kernel: ``dense_kernel="mkldnn"`` a oneDNN prepacked weight (as
:mod:`~devin_compile.passes.prepack_linear` makes them), ``"upcast"`` float32 GEMMs over a
half-precision copy (:func:`~.upcast_linear.upcast_linear`, CPUs without native bf16/fp16
GEMMs), ``"linear"`` a plain ``F.linear``. ``max_tokens=-1`` means "never the copy".
"""
from __future__ import annotations

import torch

from .upcast_linear import upcast_linear


def dense_step(x: torch.Tensor, dense: torch.Tensor | None, bias: torch.Tensor | None, max_tokens: int,
               dense_kernel: str) -> torch.Tensor | None:
    """The dense copy's output when this step is long enough to use it, else None (run the quantized kernel)."""
    if dense is None or max_tokens < 0 or x.numel() // x.shape[-1] <= max_tokens:
        return None
    if dense_kernel == "mkldnn":
        return torch.ops.mkldnn._linear_pointwise(x, dense, bias, "none", [], "")
    if dense_kernel == "upcast":
        return upcast_linear(x, dense, bias, min_rows=0)
    return torch.nn.functional.linear(x, dense, bias)
