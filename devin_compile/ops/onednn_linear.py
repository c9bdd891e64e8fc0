"""oneDNN linears over weights prepacked once in oneDNN's blocked layout (``mkldnn._linear_pointwise``).

Not a ``devin::`` op: the graphs call torch's own ``mkldnn._linear_pointwise`` (:func:`onednn_linear_op`)
over a weight re-laid out once by ``mkldnn._reorder_linear_weight`` (:func:`prepack_weight`;
``prepack_onednn_linears`` does it for dense linears, ``prepack_onednn_experts`` per MoE expert,
``assign_precision`` for quantized linears' dense copies through :mod:`.dense_copy`). This module
is the one place that calls ``torch.ops.mkldnn``: passes and ops ask it whether oneDNN runs a
dtype natively here (:func:`onednn_supports`, also the INT4/FP8 crossovers and the benchmarks),
prepack a weight, or run a linear. Not to be confused with :mod:`.packed_gemm_linear` (devin's
own C GEMM tile and its 16-column layout).
"""
from __future__ import annotations

import torch


def onednn_linear_op():
    """The graph op a prepacked linear becomes: ``onednn_linear_op()(*onednn_linear_args(x, packed, bias))``
    (looked up when asked: torch builds without oneDNN have no such op)."""
    return torch.ops.mkldnn._linear_pointwise.default


def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs ``dtype`` linears natively on this CPU (float32 always, with oneDNN;
    bf16/fp16 where the CPU has native instructions for them, e.g. AVX-512-BF16 or AMX)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype in (torch.bfloat16, torch.float16):
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) if dtype == torch.bfloat16 \
            else bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


def onednn_declines(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why prepacked oneDNN linears do not apply to a model on ``device`` in ``dtype`` (None: they do)."""
    if device.type != "cpu":
        return f"model is on {device.type}, not CPU"
    if not onednn_supports(dtype):
        return f"oneDNN linear for {dtype} not available on this CPU"
    return None


#: The attribute a prepacked weight carries its ``batch_hint`` in (the compile cache saves the dense
#: values, ``packed.to_dense()``, and prepacks them again with it).
PREPACK_HINT = "devin_batch_hint"


def prepack_weight(weight: torch.Tensor, batch_hint: int = 1) -> torch.Tensor:
    """A [N, K] linear weight re-laid out once for oneDNN (an MKLDNN tensor), tuned for steps of
    about ``batch_hint`` rows."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)
    setattr(packed, PREPACK_HINT, batch_hint)
    return packed


def onednn_linear_args(x, packed, bias) -> tuple:
    """The arguments of :func:`onednn_linear_op` for ``linear(x, W, bias)`` over ``packed = prepack_weight(W)``
    (graph nodes or tensors)."""
    return (x, packed, bias, "none", [], "")


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(x, W, bias)`` over ``packed = prepack_weight(W)``."""
    return onednn_linear_op()(*onednn_linear_args(x, packed, bias))
