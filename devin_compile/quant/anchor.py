"""Outlier-anchored grids: the INT4 grid of a group holding an outlier input channel is shifted so
that channel's weight is exactly representable.

Pattern → replacement: a per-(row, group) grid ``(scale, minv)`` (from min-max or the clipping
search) → the same scale with ``minv`` moved by the rounding residual of the anchor weight,
``minv += w_c − (round((w_c − minv) / scale) · scale + minv)`` (at most half a step unless the
clipping search had cut ``w_c`` off the range, then as far as it takes to include it), for the
``count`` input channels with the largest objective-Hessian diagonal ``H_cc``, at most one per
group (a group has one offset to spend), and only outliers: ``H_cc ≥ MIN_RATIO · median(diag H)``
(RMS at least twice the median channel's; on SmolLM2 every linear's top three channels are 6-1000x
the median, on random activations none is, and anchoring a channel that is not an outlier only
moves the group's grid for nothing).

Why: some inputs of a linear carry a persistent outlier channel (SmolLM2's ``v_proj`` reads a
channel of ~8 when the others are ~0.5–1, on every token). Its weight column's rounding error is
multiplied by that activation on every token, so it dominates the linear's output error; GPTQ's
error feedback can move only part of it onto correlated columns, and plain RTN none. Anchoring
makes that column exact at no storage cost; the other weights of the group keep an error of at
most half a step (their grid moves by less than half a step; a weight at the range's end may
clamp by that much), which GPTQ then compensates as any other rounding error. (GPTQ with act-order
visits the strongest channel first, so that column is quantized as it is, exactly; a later anchor
column has taken error feedback by its turn, so its grid is near, not on, its value.)
Measured on held-out domains (bench/quant_domains.py, README): see the quantization section.

Invariants: ``scale`` is unchanged; the anchor weight dequantizes to itself (up to float
rounding) whenever it lies inside the shifted range; groups are processed in order of their
anchor's ``H_cc``, so a group is anchored on its strongest channel.
"""
from __future__ import annotations

import torch

from ..backends.int4 import format as fmt

MIN_RATIO = 4.0


def anchor_outlier_channels(w: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor,
                            group_size: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (scale, minv) [N, G] with the groups of the ``count`` strongest input channels anchored (module doc)."""
    if count <= 0:
        return scale, minv
    minv = minv.clone()
    used: set[int] = set()
    diag = torch.diag(h)
    floor = MIN_RATIO * float(diag.median())
    for c in torch.argsort(diag, descending=True).tolist():
        if len(used) >= count or float(diag[c]) < floor:
            break
        g = c // group_size
        if g in used:
            continue
        used.add(g)
        x, s, m = w[:, c].float(), scale[:, g], minv[:, g]
        q = ((x - m) / s).round().clamp(0, fmt.QMAX)
        minv[:, g] = m + (x - (q * s + m))
    return scale, minv
