"""GPTQ (Frantar et al. 2022): quantize columns one at a time, pushing each column's rounding
error onto the columns not yet quantized through the inverse Hessian.

``H = mean(x xᵀ)`` over the calibration tokens (the layer's input statistics). Steps:
dead input channels (``H_ii = 0``) get ``H_ii = 1`` and a zero weight column; dampening
``λ = damp · mean(diag H)`` is added to the diagonal and multiplied by 10 until the
Cholesky factorisation succeeds (at most 6 tries, the last ``λ`` is reported); the upper
Cholesky factor of ``H⁻¹`` drives the updates; columns are processed in blocks of
``block_size`` (128) with the lazy batch update of the rest of the matrix after each
block, on ``Wᵀ`` so that a column is a contiguous row (the same codes as the unblocked
column-by-column loop, tested). ``act_order=True`` visits columns by decreasing ``H_ii``; groups are then fixed up
front from the original weights ("static groups", so a group's columns share one grid
whatever the visiting order); without it each group's grid is fitted when its first
column is reached, on the already-updated weights.

Generalisation (``bench/gptq_generalisation.py``, log in ``bench/results/``): GPTQ's error
feedback fits the calibration text's activation correlations. Measured as layer output error
relative to RTN's on the same text (5 of SmolLM2's 30 layers, 8 x 512 calibration tokens):
calibrated on Shakespeare alone, 0.05x RTN on Shakespeare but 0.46x on licences, changelogs
and CMake docs. The largest fix is the calibration text (the shipped mix: 0.28x held out);
then dampening: 0.1 · mean(diag H) (the default) gives 0.26x, against 0.28x at 0.01 and at 0.3;
shrinking ``H`` towards its diagonal did not help (0.28x); dropping the clipped static grid
hurt (0.56x against 0.46x on Shakespeare-only statistics).

Grid refit (``refits``, :mod:`.grid_refit`): GPTQ fixes each group's grid (scale, min) before it
chooses the codes, so once the codes are chosen the grid is no longer the best one for them; with
``refits = R``, GPTQ runs ``R`` times, each pass followed by the least-squares refit of the grid to
its codes and each pass after the first on the previous one's refitted grid.
"""
from __future__ import annotations

import torch

from ..backends.int4 import format as fmt
from .grid_refit import refit_grid


def _damped_inverse_cholesky(h: torch.Tensor, damp: float) -> tuple[torch.Tensor, float]:
    """(upper ``U`` with ``Uᵀ U = (H + λI)⁻¹``, ``λ``). Computed as ``J L⁻¹ J`` from the lower Cholesky
    factor ``L`` of the reversed ``J (H + λI) J`` (``J`` the reversal): one factorisation and one
    triangular solve, a third of the time of inverting ``H`` and factorising the inverse."""
    k = h.shape[0]
    lam = damp * float(torch.diag(h).mean())
    eye = torch.eye(k, dtype=h.dtype)
    rev = h.flip(0, 1)
    for _ in range(6):
        lower, info = torch.linalg.cholesky_ex(rev + lam * eye)
        if int(info) == 0:
            return torch.linalg.solve_triangular(lower, eye, upper=False).flip(0, 1), lam
        lam *= 10.0
    raise ValueError(f"GPTQ: the Hessian is not positive definite even with dampening {lam:.3g}; "
                     "calibrate on more (or more varied) text")


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, group_size: int, *, damp: float = 0.1,
                  block_size: int = 128, act_order: bool = False,
                  grid: tuple[torch.Tensor, torch.Tensor] | None = None,
                  refits: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """→ (q uint8 [N, K], scale [N, G], minv [N, G], info) in the format of :mod:`.int4`.

    ``grid``: fixed (scale, minv) per group (static groups), e.g. from a clipping search.
    ``refits``: that many rounds of GPTQ, each followed by :func:`refit_grid`, each round after the
    first on the previous round's refitted grid (0: one plain GPTQ pass; also where ``group_size``
    does not divide ``K``, reported in ``info["refits"]``)."""
    if w.shape[1] % group_size:
        refits = 0  # a short last group: refit_grid leaves the grid as it is, so more passes change nothing
    prepared = _prepare(w, h, damp, act_order)  # one factorisation for every pass
    q, scale, minv, info = _gptq_pass(prepared, group_size, block_size, act_order, grid)
    for r in range(refits):
        if r:
            q, scale, minv, info = _gptq_pass(prepared, group_size, block_size, act_order, (scale, minv))
        scale, minv = refit_grid(w, h, q, scale, minv, group_size)
    return q, scale, minv, {**info, "refits": refits}


def _prepare(w: torch.Tensor, h: torch.Tensor, damp: float,
             act_order: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(W with dead columns zeroed, the column visiting order, the upper factor ``U`` of the damped
    inverse Hessian in that order, the dampening used)."""
    W = w.detach().float().clone()
    H = h.detach().double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        H = H[perm][:, perm]
    else:
        perm = torch.arange(w.shape[1])
    U, lam = _damped_inverse_cholesky(H, damp)
    return W, perm, U.float(), lam


def _gptq_pass(prepared: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float], group_size: int,
               block_size: int, act_order: bool,
               grid: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """One GPTQ pass (the module docstring's steps) on :func:`_prepare`'s output."""
    W, perm, U, lam = prepared
    n, k = W.shape
    ng = fmt.num_groups(k, group_size)
    scale = torch.empty(n, ng)
    minv = torch.empty(n, ng)
    static = act_order or grid is not None
    if static:
        s0, m0 = grid if grid is not None else fmt.params_from_range(*fmt.group_minmax(W, group_size))
        scale.copy_(s0)
        minv.copy_(m0)
    # Work on Wᵀ [K, N]: each column of W is a contiguous row, so a column's quantization and its
    # rank-1 error update of the block's later columns (``addr_``) stream through memory.
    Wt = (W.t()[perm] if act_order else W.t()).contiguous()
    Qt = torch.empty(k, n)
    scale_t, minv_t = scale.t().contiguous(), minv.t().contiguous()  # [G, N]: a group's grid is a row
    group_of = torch.div(perm, group_size, rounding_mode="floor").tolist()
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = Wt[i1:i2].clone()
        Err = torch.empty(i2 - i1, n)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = group_of[col]
            if not static and col % group_size == 0:
                # fit this group's grid on the current (error-updated) weights of its columns
                cols = W1[i:i + group_size]
                if cols.shape[0] < group_size:  # a group that crosses the block's end: its later
                    # columns with this block's pending updates applied
                    r = group_size - cols.shape[0]
                    tail = Wt[i2:i2 + r] - U[i1:col, i2:i2 + r].t() @ Err[:i]
                    cols = torch.cat([cols, tail])
                s, m = fmt.params_from_range(cols.amin(0), cols.amax(0))
                scale_t[g], minv_t[g] = s, m
            s, m = scale_t[g], minv_t[g]
            x = W1[i]
            q = Qt[col]
            torch.sub(x, m, out=q).div_(s).round_().clamp_(0, fmt.QMAX)
            err = Err[i]
            torch.addcmul(m, q, s, out=err)
            err.sub_(x).div_(-U1[i, i])
            if i + 1 < i2 - i1:
                W1[i + 1:].addr_(U1[i, i + 1:], err, alpha=-1.0)
        if i2 < k:
            Wt[i2:].addmm_(U[i1:i2, i2:].t(), Err, alpha=-1.0)
    Q = Qt.t().to(torch.uint8)
    scale, minv = scale_t.t().contiguous(), minv_t.t().contiguous()
    inv = torch.argsort(perm)
    return Q[:, inv].contiguous(), scale, minv, {"damp": lam, "act_order": act_order, "static_groups": static}
