"""Mamba (v1) selective scan over a step's packed tokens, with per-sequence SSM states.

Per channel i and state index n (``A = -exp(A_log)`` [I, N], ``dt = softplus(dt_raw + dt_bias)``):
``S_t = exp(dt_t·A)·S_{t-1} + dt_t·x_t·B_t`` (S [I, N]), ``y_t = (S_t·C_t + D·x_t)·silu(z_t)``, what HF's
``mamba_selective_scan`` (prefill) and ``mamba_selective_state_update`` (decode) compute. Prefill chunks run the
recurrence token by token from the stored state (or zeros), decode rows one step batched. Float32 states and
math; the output is float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .step_rows import StepRows


def _step(S, x, dt, A, B, C):
    """One token for R rows: S [R, I, N], x/dt [R, I], B/C [R, N] → (S·C [R, I], new S)."""
    S = S * torch.exp(dt[..., None] * A) + (dt * x)[..., None] * B[:, None, :]
    return (S * C[:, None, :]).sum(-1), S


def selective_scan_step(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                        D: torch.Tensor, z: torch.Tensor, dt_bias: torch.Tensor | None, state: torch.Tensor,
                        rows: StepRows) -> torch.Tensor:
    """x, dt, z [T, I]; B, C [T, N]; state [S, I, N] at the sequences' slots → y [T, I] float32."""
    x, B, C = x.float(), B.float(), C.float()
    dt = F.softplus(dt.float() + (0.0 if dt_bias is None else dt_bias.float()))
    A = -torch.exp(A_log.float())
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if rows.decode:
        y, new = _step(state[rows.slots].float(), rows.gather(x), rows.gather(dt), A, rows.gather(B), rows.gather(C))
        out = rows.place(out, y)
        rows.put(state, new)
    for span, slot, S in rows.chunks(state):
        S = S[None]
        xs, ds, Bs, Cs = x[span], dt[span], B[span], C[span]
        for t in range(xs.shape[0]):
            y, S = _step(S, xs[t:t + 1], ds[t:t + 1], A, Bs[t:t + 1], Cs[t:t + 1])
            out[span.start + t] = y[0]
        if slot >= 0:
            state[slot] = S[0].to(state.dtype)
    return (out + D.float() * x) * F.silu(z.float())
