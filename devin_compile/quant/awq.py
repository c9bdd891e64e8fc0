"""AWQ (Lin et al. 2023): activation-aware per-input-channel scales, then a clipping search.

For linears that share one input ``x`` (q/k/v after the attention norm, gate/up after the
MLP norm, o after v when shapes allow, down after up), one scale vector ``s`` [K] is
chosen: ``W_i · diag(s)`` is quantized instead of ``W_i`` and ``1/s`` is folded into the op
that produced ``x`` (the norm's weight, or the preceding linear's output rows), so the
full-precision model is unchanged (``(W diag(s)) (x / s) = W x``).

- Scale search: ``s = mean|x| ** α`` (normalised by ``sqrt(max · min)``) for α on a 20-point
  grid ``0, 0.05, …, 0.95``; the winner minimises the group's output error after RTN,
  ``Σ_i tr(ΔW_i H ΔW_iᵀ)`` with ``ΔW_i = Q(W_i s)/s − W_i`` and ``H = mean(x xᵀ)``: exact over
  every calibration token, with no stored activations. α = 0 is plain RTN, so the search
  never does worse than RTN on this measure.
- Clipping search (on every linear; AutoAWQ skips q/k, but on SmolLM2 clipping them lowered the
  held-out KL on every domain; ``per_linear={"(q|k)_proj$": {"clip": False}}`` skips): per output row
  and group, the grid's range ``[r·min, r·max]`` for ``r = 1, 0.95, …, 0.55`` (10 points)
  that minimises that group's share of the output error ``Δw_g H_gg Δw_gᵀ``; then the top
  end alone and the bottom end alone over ``r = 1, 0.975, …, 0.425`` (24 points each). The
  grid is asymmetric (min + scale · q), so its ends need not shrink alike: the one-sided pass
  cut the SmolLM2 held-out KL of AWQ and GPTQ by ~15–20% (README).
"""
from __future__ import annotations

import torch

from ..backends.int4 import format as fmt

ALPHA_GRID = tuple(i / 20 for i in range(20))
CLIP_GRID = tuple(1 - i / 20 for i in range(10))  # the range shrunk at both ends alike
REFINE_GRID = tuple(1 - i / 40 for i in range(24))  # then one end at a time


def output_error(dw: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Per-row ``Δw H Δwᵀ`` (the mean squared output error over the calibration tokens)."""
    return ((dw @ h) * dw).sum(1)


def rtn_error(w: torch.Tensor, h: torch.Tensor, group_size: int, s: torch.Tensor | None = None,
              row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Total output error of RTN on ``w · diag(s)`` measured in ``x``'s basis (rows weighted by
    ``row_weight`` when given)."""
    ws = w if s is None else w * s[None, :]
    q, sc, mn = fmt.rtn_quantize(ws, group_size)
    deq = fmt.dequantize(q, sc, mn, group_size)
    dw = deq - ws if s is None else deq / s[None, :] - w
    err = output_error(dw, h)
    return (err if row_weight is None else err * row_weight).sum()


def search_scale(weights: list[torch.Tensor], h: torch.Tensor, absmean: torch.Tensor,
                 group_size: int, row_weights: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, float, float, float]:
    """→ (s [K], best α, error at best α, error at α = 0 i.e. plain RTN).

    ``row_weights`` (one [N] per weight, e.g. the output-gradient squares): the searched error is
    ``Σ_i Σ_j r_ij (ΔW_i H ΔW_iᵀ)_jj``, the second-order loss estimate, so a linear the loss is
    sensitive to (SmolLM2's v_proj next to q/k) weighs more in the scale the three share."""
    base = absmean.float().clamp(min=1e-5)
    best = (None, 0.0, float("inf"))
    rtn = None
    rws = row_weights or [None] * len(weights)
    for a in ALPHA_GRID:
        s = base.pow(a)
        s = s / (s.max() * s.min()).sqrt()
        err = float(sum(rtn_error(w, h, group_size, s, r) for w, r in zip(weights, rws)))
        if a == 0.0:
            rtn = err
        if err < best[2]:
            best = (s, a, err)
    return best[0], best[1], best[2], rtn


def clip_search(w: torch.Tensor, h: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, minv) [N, G]: per (row, group), the range ``[r·min, r·max]`` with the best ``r`` in
    CLIP_GRID, then its top alone moved to ``r·max`` and its bottom alone to ``r·min`` for the
    best ``r`` in REFINE_GRID (one pass of coordinate descent; a move is taken only where it
    lowers that group's error, so the result never does worse than the symmetric search)."""
    n, k = w.shape
    lo0, hi0 = fmt.group_minmax(w, group_size)
    if k % group_size:  # a short last group: keep the plain min-max grid
        return fmt.params_from_range(lo0, hi0)
    g = k // group_size
    wg = w.float().view(n, g, group_size).transpose(0, 1)  # [G, N, gs]
    idx = torch.arange(g)
    hg = h.float().view(g, group_size, g, group_size)[idx, :, idx, :]  # [G, gs, gs] diagonal blocks

    def error(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        s, m = (t.T[..., None] for t in fmt.params_from_range(lo, hi))  # [G, N, 1]
        d = ((wg - m) / s).round().clamp(0, fmt.QMAX) * s + m - wg
        return (torch.bmm(d, hg) * d).sum(-1).T  # [N, G]

    best_err = torch.full((n, g), float("inf"))
    best_lo, best_hi = lo0.clone(), hi0.clone()

    def consider(lo: torch.Tensor, hi: torch.Tensor) -> None:
        nonlocal best_err, best_lo, best_hi
        err = error(lo, hi)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_lo = torch.where(better, lo, best_lo)
        best_hi = torch.where(better, hi, best_hi)

    for r in CLIP_GRID:
        consider(lo0 * r, hi0 * r)
    lo1 = best_lo.clone()
    for r in REFINE_GRID:
        consider(lo1, hi0 * r)
    hi1 = best_hi.clone()
    for r in REFINE_GRID:
        consider(lo0 * r, hi1)
    return fmt.params_from_range(best_lo, best_hi)
