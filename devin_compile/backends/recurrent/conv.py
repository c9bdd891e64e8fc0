"""Causal depthwise convolution with a per-sequence window state, then SiLU (or not), over a step's packed tokens.

For sequence b with window state ``W [C, K-1]`` (its last K-1 inputs; zeros when fresh) and tokens x [L, C]:
``out = silu(conv1d(cat(W, xᵀ), w, b))`` (``silu=False``, RecurrentGemma: no SiLU) and the new state is the last
K-1 columns of ``cat(W, xᵀ)``, what HF's ``causal_conv1d_fn`` / ``causal_conv1d_update`` compute with their conv
state.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .step_rows import StepRows


def conv_chunk(x: torch.Tensor, state: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, silu: bool = True):
    """x [L, C], state [C, K-1] → (silu(conv) [L, C] float32, new state [C, K-1])."""
    window = torch.cat([state, x.t().float()], dim=1)  # [C, K-1+L]
    out = F.conv1d(window[None], w.float()[:, None, :], None if b is None else b.float(), groups=w.shape[0])[0]
    return (F.silu(out) if silu else out).t(), window[:, window.shape[1] - state.shape[1]:]


def conv_decode(x: torch.Tensor, state: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, silu: bool = True):
    """R single tokens x [R, C] over states [R, C, K-1] → (silu(conv) [R, C] float32, new states)."""
    window = torch.cat([state.float(), x.float()[:, :, None]], dim=2)  # [R, C, K]
    conv = (window * w.float()[None]).sum(-1)
    if b is not None:
        conv = conv + b.float()
    return F.silu(conv) if silu else conv, window[:, :, 1:]


def causal_conv_step(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, state: torch.Tensor,
                     rows: StepRows, silu: bool = True) -> torch.Tensor:
    """The step's tokens x [T, C] → silu(conv) [T, C] float32, reading and writing the window states
    ``state`` [S, C, K-1] at the sequences' slots."""
    if rows.decode and rows.rows is None:
        out, new = conv_decode(x, state[rows.slots], w, b, silu)
        rows.put(state, new)
        return out
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if rows.decode:
        y, new = conv_decode(rows.gather(x), state[rows.slots], w, b, silu)
        out[rows.rows] = y
        rows.put(state, new)
    for span, slot, start in rows.chunks(state):
        out[span], new = conv_chunk(x[span], start, w, b, silu)
        if slot >= 0:
            state[slot] = new.to(state.dtype)
    return out
