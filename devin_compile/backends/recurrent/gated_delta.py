"""Gated delta rule (Qwen3-Next's gated DeltaNet) over a step's packed tokens, with per-sequence states.

Per value head h, with q, k L2-normalised (eps 1e-6), q scaled by ``1/sqrt(Dk)``, key heads repeated over the
value heads of their group, and the state ``S [Dk, Dv]``:
``S ← exp(g_t)·S``; ``S ← S + k_t ⊗ β_t (v_t − Sᵀk_t)``; ``o_t = Sᵀ q_t``, what HF's
``torch_recurrent_gated_delta_rule`` computes token by token (and its chunked form computes per chunk). Prefill
chunks run it token by token from the stored state (or zeros), decode rows one step batched. Float32 states and
math; the output is float32.
"""
from __future__ import annotations

import torch

from .step_rows import StepRows


def _prep(q, k, v, g, beta, rep: int):
    def l2(x):
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    q, k = l2(q.float()), l2(k.float())
    q = q / (q.shape[-1] ** 0.5)
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    return q, k, v.float(), g.float(), beta.float()


def _step(S, q, k, v, g, beta):
    """R rows, one token: S [R, H, Dk, Dv], q/k [R, H, Dk], v [R, H, Dv], g/beta [R, H] → (o [R, H, Dv], S)."""
    S = S * torch.exp(g)[..., None, None]
    delta = (v - (S * k[..., None]).sum(-2)) * beta[..., None]
    S = S + k[..., None] * delta[..., None, :]
    return (S * q[..., None]).sum(-2), S


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, rows: StepRows) -> torch.Tensor:
    """q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; state [S, Hv, Dk, Dv] at the sequences' slots →
    o [T, Hv, Dv] float32."""
    q, k, v, g, beta = _prep(q, k, v, g, beta, v.shape[-2] // k.shape[-2])
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    if rows.decode:
        o, new = _step(state[rows.slots].float(), *(rows.gather(t) for t in (q, k, v, g, beta)))
        out = rows.place(out, o)
        rows.put(state, new)
    for span, slot, S in rows.chunks(state):
        S = S[None]
        for t in range(span.start, span.stop):
            o, S = _step(S, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1])
            out[t] = o[0]
        if slot >= 0:
            state[slot] = S[0].to(state.dtype)
    return out
