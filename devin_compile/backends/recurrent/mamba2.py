"""Mamba2 (SSD) mixer core in torch: causal depthwise conv + SiLU + selective scan, over packed sequences.

Per head h, with ``a_t = dt_t·A_h`` (``A = -exp(A_log)``, ``dt = softplus(dt_raw + dt_bias)``), the state
``S [P, N]`` follows ``S_t = exp(a_t)·S_{t-1} + dt_t·x_t ⊗ B_t`` and the output is ``y_t = S_t·C_t + D_h·x_t``
(B, C shared by the heads of a group). Two forms, the same math:

- **chunked** (a prefill chunk of a sequence, any length, continuing from a stored state or from zeros): the
  tokens in windows of ``chunk_size``; inside a window, with ``s_t = Σ_{i≤t} a_i``,
  ``y_t = exp(s_t)·S_0·C_t + Σ_{u≤t} exp(s_t − s_u)(C_t·B_u) dt_u x_u + D x_t`` and the window's end state
  ``exp(s_L)·S_0 + Σ_u exp(s_L − s_u) dt_u x_u ⊗ B_u``. ``dt`` is clamped to ``time_step_limit`` here, as HF's
  chunked scan does;
- **recurrent** (one decode token of a sequence with a stored state), batched over the step's decode rows:
  the update above once (HF's ``selective_state_update`` does not clamp ``dt``; neither does this).

The conv window state holds each sequence's last ``K - 1`` conv inputs. States are float32 whatever the model's
dtype; the math runs in float32 and the output is returned in the input's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .conv import causal_conv_step
from .step_rows import StepRows


@dataclass(frozen=True)
class Mamba2Shape:
    """A mixer's sizes: heads H of size P, groups G of state size N, conv kernel K, chunk, dt limits."""

    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    chunk_size: int
    dt_min: float = 0.0
    dt_max: float = float("inf")

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim


def _split(xbc: torch.Tensor, sh: Mamba2Shape):
    """[L, Cd] → x [L, H, P], B [L, H, N], C [L, H, N] (B, C repeated over each group's heads)."""
    L, rep = xbc.shape[0], sh.num_heads // sh.n_groups
    gn = sh.n_groups * sh.state_size
    x, B, C = torch.split(xbc, [sh.inner, gn, gn], dim=-1)
    B = B.reshape(L, sh.n_groups, sh.state_size).repeat_interleave(rep, dim=1)
    C = C.reshape(L, sh.n_groups, sh.state_size).repeat_interleave(rep, dim=1)
    return x.reshape(L, sh.num_heads, sh.head_dim), B, C


def scan_chunked(x, dt, A, B, C, D, h0, chunk_size: int):
    """x [L,H,P], dt [L,H] (after softplus/clamp), A [H], B/C [L,H,N], D [H], h0 [H,P,N] → (y [L,H,P], h [H,P,N])."""
    ys, h = [], h0
    for s in range(0, x.shape[0], chunk_size):
        xs, ds, Bs, Cs = x[s:s + chunk_size], dt[s:s + chunk_size], B[s:s + chunk_size], C[s:s + chunk_size]
        cum = torch.cumsum(ds * A, dim=0)  # [l, H]
        l = xs.shape[0]
        causal = torch.ones(l, l, dtype=torch.bool, device=x.device).tril()
        diff = (cum[:, None, :] - cum[None, :, :]).masked_fill(~causal[..., None], float("-inf"))
        xd = xs * ds[..., None]  # [l, H, P]
        scores = torch.einsum("thn,shn->tsh", Cs, Bs) * torch.exp(diff)
        y = torch.einsum("tsh,shp->thp", scores, xd)
        y = y + torch.einsum("thn,hpn->thp", Cs, h) * torch.exp(cum)[..., None]
        ys.append(y + D[None, :, None] * xs)
        decay = torch.exp(cum[-1:] - cum)  # [l, H]
        h = torch.exp(cum[-1])[:, None, None] * h + torch.einsum("sh,shp,shn->hpn", decay, xd, Bs)
    return torch.cat(ys), h


def _scan_decode(x, dt_raw, B, C, p: dict, S: torch.Tensor):
    """R decode tokens (x [R, H, P], B/C [R, H, N], dt_raw [R, H]) over states S [R, H, P, N] → (y, new S)."""
    dt = F.softplus(dt_raw.float() + p["dt_bias"].float())  # [R, H]; no clamp, as HF's decode step
    dA = torch.exp(dt * -torch.exp(p["A_log"].float()))
    S = S * dA[..., None, None] + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    return (S * C[:, :, None, :]).sum(-1) + p["D"].float()[None, :, None] * x, S


def mamba2_forward(xbc: torch.Tensor, dt: torch.Tensor, params: dict, sh: Mamba2Shape,
                   conv_state: torch.Tensor, ssm_state: torch.Tensor, rows: StepRows) -> torch.Tensor:
    """The step's packed tokens (xbc [T, Cd], dt [T, H]) → y [T, H·P] in xbc's dtype; reads and writes the
    sequences' states (``conv_state`` [S, Cd, K-1], ``ssm_state`` [S, H, P, N]) at their slots, as ``rows``
    (:meth:`StepRows.plan`, made once per step) says: a slot -1 has no state and writes nothing, a fresh
    sequence starts from zeros, one token over a context decodes."""
    u = causal_conv_step(xbc, params["conv_weight"], params["conv_bias"], conv_state, rows)  # [T, Cd] float32
    x, B, C = _split(u, sh)
    out = torch.empty(xbc.shape[0], sh.num_heads, sh.head_dim, dtype=torch.float32, device=xbc.device)
    if rows.decode:
        y, new = _scan_decode(rows.gather(x), rows.gather(dt), rows.gather(B), rows.gather(C), params,
                              ssm_state[rows.slots].float())
        out = rows.place(out, y)
        rows.put(ssm_state, new)
    A = -torch.exp(params["A_log"].float())
    for span, slot, start in rows.chunks(ssm_state):
        d = F.softplus(dt[span].float() + params["dt_bias"].float()).clamp(sh.dt_min, sh.dt_max)
        out[span], new = scan_chunked(x[span], d, A, B[span], C[span], params["D"].float(), start, sh.chunk_size)
        if slot >= 0:
            ssm_state[slot] = new.to(ssm_state.dtype)
    return out.reshape(xbc.shape[0], sh.inner).to(xbc.dtype)
