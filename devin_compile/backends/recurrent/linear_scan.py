"""Diagonal linear recurrence ``h_t = a_t·h_{t-1} + x_t`` (RecurrentGemma's RG-LRU scan) over a step's packed
tokens, with a per-sequence state ``h [W]``. The gates ``a`` and the normalised inputs ``x`` are computed in the
graph from each token alone; only ``h`` crosses tokens. Float32 state and sums (HF's ``acc_dtype``); the output
is float32."""
from __future__ import annotations

import torch

from .step_rows import StepRows


def linear_scan_step(a: torch.Tensor, x: torch.Tensor, state: torch.Tensor, rows: StepRows) -> torch.Tensor:
    """a, x [T, W]; state [S, W] at the sequences' slots → h [T, W] float32."""
    a, x = a.float(), x.float()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if rows.decode:
        h = rows.gather(a) * state[rows.slots].float() + rows.gather(x)
        out = rows.place(out, h)
        rows.put(state, h)
    for span, slot, h in rows.chunks(state):
        for t in range(span.start, span.stop):
            h = a[t] * h + x[t]
            out[t] = h
        if slot >= 0:
            state[slot] = h.to(state.dtype)
    return out
