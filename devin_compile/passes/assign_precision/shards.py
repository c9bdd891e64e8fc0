"""assign_precision under tensor parallelism: a rank's slice of each quantized linear.

``shard_tensor_parallel`` recorded on every weight it cut which part this rank kept (a
:class:`~devin_compile.config.weight_slice.WeightSlice` in the ``get_attr``'s ``meta["tp_slice"]``,
carried onto a fused linear by ``fuse_projections`` as ``meta["fused_slices"]``). The full
quantization (every rank computes the same one, or loads the same artifact) is cut the same way::

    rows (dim 0: q/k/v, gate/up, the vocab-parallel head)  →  q, scale, minv, row_scale, fp8_q, fp8_scale,
        the INT8 head's q and scale: those rows (zero rows past the vocabulary: they dequantize to 0);
        in_scale whole
    columns (dim 1: o, down)  →  q and fp8_q columns, scale/minv the groups of those columns, in_scale
        entries; row_scale and the per-row FP8 scales whole

Invariant: a slice dequantizes to the same slice of the full dequantized weight (columns hold whole
groups: ``shard_tensor_parallel`` refused any other cut before a weight moved; checked again here).
The statistics (errors, estimated losses) stay those of the whole linear, so every rank chooses the
precision one process chooses.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx

from ...config.weight_slice import WeightSlice
from ...ops import fp8_linear as fp8_op
from ...ops import int4_linear as int4_op
from ...pipeline import PassError
from ...quant.precision import Candidate
from ...quant.result import Int8Head, QLinear


def slices_of(node: torch.fx.Node) -> list[WeightSlice | None]:
    """The cut of each part of graph linear ``node``'s weight (one per fused weight; None: kept whole)."""
    fused = node.meta.get("fused_weights")
    if fused:
        return list(node.meta.get("fused_slices") or [None] * len(fused))
    w = node.args[1]
    return [w.meta.get("tp_slice") if isinstance(w, torch.fx.Node) else None]


def shard_qlinear(ql: QLinear, cut: WeightSlice | None, name: str) -> QLinear:
    """``ql`` cut as its weight was (see the module docstring); ``ql`` itself when not cut."""
    if cut is None:
        return ql
    if len(cut.ranges) != 1 or cut.dim not in (0, 1):
        raise PassError(f"assign_precision: {name} was cut along dim {cut.dim} in {len(cut.ranges)} pieces; "
                        "quantized linears are cut by one run of output rows or input columns only")
    if cut.dim == 0:
        return _rows(ql, cut)
    return _columns(ql, cut, name)


def _rows(ql: QLinear, cut: WeightSlice) -> QLinear:
    take = cut.take
    fp8 = ql.fp8_q is not None
    return dataclasses.replace(
        ql, q=take(ql.q), scale=take(ql.scale), minv=take(ql.minv),
        row_scale=None if ql.row_scale is None else take(ql.row_scale, fill=1.0),
        fp8_q=take(ql.fp8_q) if fp8 else None, fp8_scale=take(ql.fp8_scale) if fp8 else None,
        dims=(cut.length, ql.shape[1]))


def _columns(ql: QLinear, cut: WeightSlice, name: str) -> QLinear:
    (cols,), k, g = cut.ranges, ql.shape[1], ql.group_size
    if cols.start % g or (cols.stop % g and cols.stop != k):
        raise PassError(f"assign_precision: {name}'s input features [{cols.start}, {cols.stop}) of {k} are not "
                        f"whole INT4 groups of {g}; quantize with a group size that divides them, or use "
                        "tensor_parallel=1")
    groups = WeightSlice(1, (range(cols.start // g, -(-cols.stop // g)),), -(-k // g))  # a short last group: ⌈K/g⌉
    fp8 = ql.fp8_q is not None
    return dataclasses.replace(
        ql, q=cut.take(ql.q), scale=groups.take(ql.scale), minv=groups.take(ql.minv),
        in_scale=None if ql.in_scale is None else cut.take(ql.in_scale, dim=0),
        fp8_q=cut.take(ql.fp8_q) if fp8 else None, dims=(ql.shape[0], len(cols)))


def shard_int8_head(head: Int8Head, cut: WeightSlice | None) -> Int8Head:
    """The INT8 head's rows this rank keeps (a vocabulary shard, zero rows past V); ``head`` when not cut."""
    if cut is None:
        return head
    if cut.dim != 0 or len(cut.ranges) != 1:
        raise PassError(f"assign_precision: the INT8 head {head.name!r} was cut along dim {cut.dim}; only a "
                        "vocabulary (row) cut is supported")
    return dataclasses.replace(head, q=cut.take(head.q), scale=cut.take(head.scale),
                               dims=(cut.length, head.dims[1]))


def local_candidate(c: Candidate, parts: list[QLinear], dtype: torch.dtype) -> Candidate:
    """Candidate ``c`` (the whole linear, as the tiers were chosen) with the shape and bytes of ``parts``,
    the slices this rank holds: what its operands and the precision table's bytes are built from."""
    n, k = sum(p.shape[0] for p in parts), parts[0].shape[1]
    if (n, k) == (c.n, c.k):
        return c
    elem = torch.empty((), dtype=dtype).element_size()
    return dataclasses.replace(c, n=n, k=k, fp_bytes=n * k * elem,
                               int4_bytes=int4_op.int4_bytes(n, k, c.group_size, elem),
                               fp8_bytes=fp8_op.fp8_bytes(n, k) if c.fp8_bytes else 0)
