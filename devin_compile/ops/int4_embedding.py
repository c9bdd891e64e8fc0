"""``devin::int4_embedding``: an embedding lookup that reads the rows of an INT4 output head (tied weights).

Schema::

    devin::int4_embedding(Tensor ids, Tensor qweight, Tensor scales_zeros, int group_size, int num_rows,
                          int dim, str kernel, ScalarType dtype, Tensor? col_scale=None) -> Tensor

``ids`` [...] → [..., dim] in ``dtype``: row ``v`` of the head's dequantized weight, for every id, times
``col_scale`` [dim] (float32) when given: AWQ quantizes the head as ``W · diag(s)``, so the rows are
multiplied by ``1 / s`` to be the embedding's again. When a
model ties its embedding to an output head quantized to INT4 (``lm_head=True``), the embedding reads the
head's INT4 operands (``assign_precision``), so the model holds neither a dense embedding table nor a second
quantized copy: SmolLM2's 113 MB float32 table becomes the head's ~16 MB. A token's embedding is then the
quantized row, as llama.cpp's Q4 files store ``token_embd`` too.

Layouts (``kernel``, :mod:`devin_compile.backends.int4.kernels`): "cpu_c" (rows interleaved in blocks of
16, float32 scale/minv per block and group: :mod:`devin_compile.backends.int4.cpu_int4_linear`; the values
are what :func:`devin_compile.backends.int4.format.dequantize` gives, bit for bit), "cpu" (aten's packing,
:func:`devin_compile.backends.int4.format.cpu_block_rows`) and "reference"/"triton" (nibble-packed rows);
the last two keep ``zero = minv + 8·scale`` in ``scales_zeros`` [G, N, 2] and compute ``(q - 8)·scale + zero``
as their linears do (within float rounding of ``dequantize``).
"""
from __future__ import annotations

import torch

from ..backends.int4 import cpu_int4_linear
from ..backends.int4 import format as fmt

_lib = torch.library.Library("devin", "FRAGMENT")
_lib.define("int4_embedding(Tensor ids, Tensor qweight, Tensor scales_zeros, int group_size, int num_rows, "
            "int dim, str kernel, ScalarType dtype, Tensor? col_scale=None) -> Tensor")

#: The head layouts the lookup reads.
KERNELS = ("cpu_c", "cpu", "reference", "triton")


def _cpu_c_rows(ids: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int,
                dim: int) -> torch.Tensor:
    """Rows ``ids`` (flat) of a "cpu_c" weight, float32 [T, dim]."""
    block, row = torch.div(ids, cpu_int4_linear.ROWS, rounding_mode="floor"), ids % cpu_int4_linear.ROWS
    nb, kp8 = qweight.shape
    data = qweight.view(nb, kp8 // 64, cpu_int4_linear.ROWS, 4)[block, :, row]  # [T, chunks, 4 bytes]
    q = torch.stack([data & 15, data >> 4], dim=2).reshape(ids.shape[0], kp8 // 8)[:, :dim]  # [T, Kp] → [T, dim]
    sm = scales[block, :, :, row]  # [T, G, 2]
    return q.float() * fmt.expand_groups(sm[..., 0], dim, group_size) + fmt.expand_groups(sm[..., 1], dim, group_size)


def _stored_rows(ids: torch.Tensor, qweight: torch.Tensor, sz: torch.Tensor, group_size: int,
                 dim: int) -> torch.Tensor:
    """Rows ``ids`` (flat) of a nibble-packed weight with [G, N, 2] scales/zeros, float32 [T, dim]."""
    q = fmt.unpack_nibbles(qweight[ids], dim).float()
    s, z = (fmt.expand_groups(sz[:, ids, i].t().float(), dim, group_size) for i in (0, 1))
    return (q - 8) * s + z


def _aten_cpu_rows(ids: torch.Tensor, qweight: torch.Tensor, sz: torch.Tensor, group_size: int,
                   dim: int) -> torch.Tensor:
    """Rows ``ids`` (flat) of a weight packed by ``aten._convert_weight_to_int4pack_for_cpu`` (row blocks of
    ``B``: row ``B r + b`` in the low nibbles of block r's bytes ``b``, row ``B r + B/2 + b`` in the high ones),
    float32 [T, dim]."""
    rows = fmt.cpu_block_rows()
    kp = sz.shape[0] * group_size
    block, b = torch.div(ids, rows, rounding_mode="floor"), ids % rows
    data = qweight.view(-1, kp, rows // 2)[block, :, b % (rows // 2)]  # [T, Kp]
    q = torch.where((b >= rows // 2)[:, None], data >> 4, data & 15)[:, :dim].float()
    s, z = (fmt.expand_groups(sz[:, ids, i].t().float(), dim, group_size) for i in (0, 1))
    return (q - 8) * s + z


def int4_embedding(ids: torch.Tensor, qweight: torch.Tensor, scales_zeros: torch.Tensor, group_size: int,
                   num_rows: int, dim: int, kernel: str, dtype: torch.dtype,
                   col_scale: torch.Tensor | None = None) -> torch.Tensor:
    flat = ids.reshape(-1)
    if flat.device.type == "cpu" and flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_rows):
        raise IndexError(f"devin::int4_embedding: token ids must be in [0, {num_rows}); got "
                         f"{int(flat.min())}..{int(flat.max())}")
    if kernel == "cpu_c":
        rows = _cpu_c_rows(flat, qweight, scales_zeros, group_size, dim)
    elif kernel in ("reference", "triton"):
        rows = _stored_rows(flat, qweight, scales_zeros, group_size, dim)
    elif kernel == "cpu":
        rows = _aten_cpu_rows(flat, qweight, scales_zeros, group_size, dim)
    else:
        raise ValueError(f"devin::int4_embedding reads the layouts of kernels {KERNELS}, not {kernel!r}")
    if col_scale is not None:
        rows = rows * col_scale[None, :]
    return rows.to(dtype).reshape(*ids.shape, dim)


_lib.impl("int4_embedding", int4_embedding, "CompositeExplicitAutograd")


@torch.library.register_fake("devin::int4_embedding", lib=_lib)
def _(ids, qweight, scales_zeros, group_size, num_rows, dim, kernel, dtype, col_scale=None):
    return ids.new_empty((*ids.shape, dim), dtype=dtype, device=qweight.device)
