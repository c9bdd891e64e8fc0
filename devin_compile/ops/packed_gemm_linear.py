"""``devin::packed_gemm_linear``: a linear over a weight packed for devin's C GEMM tile, in blocks of 16
output columns.

Schema::

    devin::packed_gemm_linear(Tensor x, Tensor weight, Tensor? bias, int out_features) -> Tensor

x [..., K]; weight [⌈N/16⌉, K, 16] (:func:`pack_weight` of a [N, K] linear weight: block j, row k
holds columns 16j..16j+15, zeros past N); returns ``linear(x, W, bias)`` [..., N], N = ``out_features``.
Float32, and bf16 where the CPU has AVX512-BF16 (a bf16 model's tied output head, ``pack_gemm_linears``):
bf16 weights are packed in pairs, [⌈N/16⌉, K/2, 16, 2] (row k2 holds columns 16j..16j+15 of k = 2k2 and
2k2 + 1), the operand layout of ``vdpbf16ps``, which the C tile multiplies with pairs of x: products
exact, float32 sums, one rounding to bf16, as oneDNN's bf16 GEMM does.
Meant for few rows (a decode step's, the logits rows of a step; with AVX-512 as fast as oneDNN up to
512 rows): its CPU kernel (``backends/native/cpu_packed_gemm_linear_op.cpp`` + ``cpu_packed_gemm.c``)
streams the weight once for all rows, MR rows per register tile, where oneDNN's GEMV reads
a large weight at about half the memory bandwidth here. The Python kernel
(:func:`packed_gemm_linear_reference`: unpack, ``F.linear``) serves every other device, dtype and
layout and is the oracle. Values equal up to float32 summation order. Not to be confused with
:mod:`.onednn_linear` (oneDNN's own prepacked layout, which ``mkldnn._linear_pointwise`` reads).

``devin::packed_embedding(Tensor weight, Tensor ids) -> Tensor`` looks rows up in the same layout,
``embedding(W, ids)`` [*ids.shape, K]: a tied embedding reads the packed output head, so the model does
not keep its dense weight beside the packed one (a gather of 16-strided values: K cache lines a token).
"""
from __future__ import annotations

import torch

from ..backends.fused import cpu_packed_gemm_linear_op

_lib = torch.library.Library("devin", "FRAGMENT")
_lib.define("packed_gemm_linear(Tensor x, Tensor weight, Tensor? bias, int out_features) -> Tensor")
_lib.define("packed_embedding(Tensor weight, Tensor ids) -> Tensor")

BLOCK = 16
def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] → [⌈N/16⌉, K, 16] (bf16: [⌈N/16⌉, K/2, 16, 2]), N padded with zero rows to whole blocks;
    K must be even."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"devin::packed_gemm_linear packs [N, K] weights with K even; got {tuple(weight.shape)}")
    nb = -(-n // BLOCK)
    padded = torch.nn.functional.pad(weight.detach(), (0, 0, 0, nb * BLOCK - n))
    if weight.dtype == torch.bfloat16:
        return padded.reshape(nb, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return padded.reshape(nb, BLOCK, k).transpose(1, 2).contiguous()


def unpack_weight(weight: torch.Tensor, out_features: int) -> torch.Tensor:
    """:func:`pack_weight`'s inverse → [N, K]."""
    if weight.dim() == 4:
        nb, k2 = weight.shape[:2]
        return weight.permute(0, 2, 1, 3).reshape(nb * BLOCK, 2 * k2)[:out_features]
    nb, k, _ = weight.shape
    return weight.transpose(1, 2).reshape(nb * BLOCK, k)[:out_features]


def packed_gemm_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 out_features: int) -> torch.Tensor:
    return torch.nn.functional.linear(x, unpack_weight(weight, out_features), bias)


_lib.impl("packed_gemm_linear", packed_gemm_linear_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("devin::packed_gemm_linear", lib=_lib)
def _(x, weight, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def packed_embedding(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``embedding(W, ids)`` over W packed by :func:`pack_weight`: row v is ``weight[v // 16, :, v % 16]``
    (bf16 pairs: ``weight[v // 16, :, v % 16, :]``, flattened)."""
    rows = weight[torch.div(ids, BLOCK, rounding_mode="floor"), :, ids % BLOCK]
    return rows.flatten(-2) if weight.dim() == 4 else rows


_lib.impl("packed_embedding", packed_embedding, "CompositeExplicitAutograd")


@torch.library.register_fake("devin::packed_embedding", lib=_lib)
def _(weight, ids):
    return weight.new_empty((*ids.shape, weight.shape[1] * (2 if weight.dim() == 4 else 1)))


def load_cpu_kernel() -> bool:
    """Register the C++ CPU kernel (built the first time, then cached); False where it cannot be
    built, and the Python kernel then serves every call."""
    return cpu_packed_gemm_linear_op.load()


def serves_many_rows() -> bool:
    """Whether the CPU kernel is as fast as oneDNN's prepacked GEMM at prefill row counts too (its
    register tile holds 8 rows: AVX-512), not only at a few rows."""
    return cpu_packed_gemm_linear_op.tile_rows() >= 8


def serves_bf16() -> bool:
    """Whether the CPU kernel takes bf16 weights here (built with AVX512-BF16's ``vdpbf16ps``)."""
    return cpu_packed_gemm_linear_op.bf16_pairs()


def cpu_kernel_declines(weight: torch.Tensor) -> str | None:
    """Why the C++ kernel would not serve this [N, K] weight (None: it would)."""
    if weight.dtype == torch.bfloat16 and not serves_bf16():
        return "bf16 weights need AVX512-BF16, which this CPU lacks"
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return f"the CPU kernel computes float32 and bf16 only, not {weight.dtype}"
    if weight.shape[1] % 2:
        return f"weight {tuple(weight.shape)}: K odd"
    return None
