"""``devin::int8_embedding``: an embedding lookup that reads the rows of an INT8 output head (tied weights).

Schema::

    devin::int8_embedding(Tensor ids, Tensor qweight, Tensor scale, int num_rows, int dim, str kernel,
                          ScalarType dtype) -> Tensor

``ids`` [...] → [..., dim] in ``dtype``: row ``v`` of the head's dequantized weight (``q[v] · scale[v]``)
for every id, from the head's operands in ``kernel``'s layout (:func:`~devin_compile.backends.int8.kernels.rows`).
When a model ties its embedding to an output head quantized to INT8 (``lm_head="int8"``, the default of
INT4 quantization), the embedding reads the head's operands (``assign_precision``): the model holds one
copy of the table, at a byte a value (SmolLM2: 27 MiB instead of 108 MiB in float32).
"""
from __future__ import annotations

import torch

from ..backends.int8 import kernels

_lib = torch.library.Library("devin", "FRAGMENT")
_lib.define("int8_embedding(Tensor ids, Tensor qweight, Tensor scale, int num_rows, int dim, str kernel, "
            "ScalarType dtype) -> Tensor")


def int8_embedding(ids: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, num_rows: int, dim: int,
                   kernel: str, dtype: torch.dtype) -> torch.Tensor:
    flat = ids.reshape(-1)
    if flat.device.type == "cpu" and flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_rows):
        raise IndexError(f"devin::int8_embedding: token ids must be in [0, {num_rows}); got "
                         f"{int(flat.min())}..{int(flat.max())}")
    return kernels.rows(flat, qweight, scale, dim, kernel).to(dtype).reshape(*ids.shape, dim)


_lib.impl("int8_embedding", int8_embedding, "CompositeExplicitAutograd")


@torch.library.register_fake("devin::int8_embedding", lib=_lib)
def _(ids, qweight, scale, num_rows, dim, kernel, dtype):
    return torch.empty((*ids.shape, dim), dtype=dtype, device=ids.device)
