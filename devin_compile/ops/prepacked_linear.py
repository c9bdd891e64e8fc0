"""oneDNN linears over prepacked weights (``mkldnn._linear_pointwise``): where this CPU has them.

Not a ``devin::`` op: the graphs call torch's own ``mkldnn._linear_pointwise`` over a weight
re-laid out once by ``mkldnn._reorder_linear_weight`` (``prepack_linear`` does it for dense
linears, ``assign_precision`` for INT4 linears' dense copies). This module answers the capability
question those passes, the INT4 crossover and the benchmarks share.
"""
from __future__ import annotations

import torch


def prepack_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs ``dtype`` linears natively on this CPU (float32 always, with oneDNN;
    bf16/fp16 where the CPU has native instructions for them, e.g. AVX-512-BF16 or AMX)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype in (torch.bfloat16, torch.float16):
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) if dtype == torch.bfloat16 \
            else bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32
