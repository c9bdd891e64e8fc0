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


def _conv_chunk(x: torch.Tensor, state: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    """x [L, Cd], state [Cd, K-1] → (silu(conv) [L, Cd] float32, new state [Cd, K-1])."""
    window = torch.cat([state, x.t().float()], dim=1)  # [Cd, K-1+L]
    out = F.conv1d(window[None], w.float()[:, None, :], None if b is None else b.float(), groups=w.shape[0])[0]
    return F.silu(out).t(), window[:, window.shape[1] - state.shape[1]:]


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


def _prefill_row(xbc, dt_raw, p: dict, sh: Mamba2Shape, conv_s, ssm_s):
    """One sequence's tokens in chunked form from its states (zeros when fresh) → (y [L, I], conv, ssm)."""
    xbc, conv_s = _conv_chunk(xbc, conv_s, p["conv_weight"], p["conv_bias"])
    x, B, C = _split(xbc, sh)
    dt = F.softplus(dt_raw.float() + p["dt_bias"].float()).clamp(sh.dt_min, sh.dt_max)
    A = -torch.exp(p["A_log"].float())
    y, ssm_s = scan_chunked(x, dt, A, B, C, p["D"].float(), ssm_s, sh.chunk_size)
    return y.reshape(x.shape[0], sh.inner), conv_s, ssm_s


def _decode_rows(xbc, dt_raw, p: dict, sh: Mamba2Shape, conv_s, ssm_s):
    """R decode tokens, one per sequence: xbc [R, Cd], states [R, ...] → (y [R, I], conv, ssm)."""
    window = torch.cat([conv_s, xbc.float()[:, :, None]], dim=2)  # [R, Cd, K]
    conv = (window * p["conv_weight"].float()[None]).sum(-1)
    if p["conv_bias"] is not None:
        conv = conv + p["conv_bias"].float()
    x, B, C = _split(F.silu(conv), sh)  # [R, H, P], [R, H, N]
    dt = F.softplus(dt_raw.float() + p["dt_bias"].float())  # [R, H]
    dA = torch.exp(dt * -torch.exp(p["A_log"].float()))
    h = ssm_s * dA[..., None, None] + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = (h * C[:, :, None, :]).sum(-1) + p["D"].float()[None, :, None] * x
    return y.reshape(x.shape[0], sh.inner), window[:, :, 1:], h


@dataclass
class StepRows:
    """How one step's sequences split into decode rows and prefill rows (shared by every mixer of a step)."""

    starts: list[int]  # token offset of each sequence (and the total at the end)
    decode: list[int]  # sequences run as one recurrent step (one token over a context, with a slot)
    rows: torch.Tensor | None  # their token rows (None: the step is exactly its decode rows, in order)
    slots: torch.Tensor  # their state slots

    @staticmethod
    def plan(query_lens: list[int], context_lens: list[int], slots: list[int], device) -> "StepRows":
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        dec = [b for b, (n, c, s) in enumerate(zip(query_lens, context_lens, slots)) if n == 1 and c > 0 and s >= 0]
        whole = len(dec) == len(query_lens)
        rows = None if whole else torch.tensor([starts[b] for b in dec], dtype=torch.long, device=device)
        return StepRows(starts, dec, rows, torch.tensor([slots[b] for b in dec], dtype=torch.long, device=device))


def mamba2_forward(xbc: torch.Tensor, dt: torch.Tensor, params: dict, sh: Mamba2Shape,
                   conv_state: torch.Tensor, ssm_state: torch.Tensor, query_lens: list[int],
                   context_lens: list[int], slots: list[int], plan: StepRows | None = None) -> torch.Tensor:
    """The step's packed tokens (xbc [T, Cd], dt [T, H]) → y [T, H·P] in xbc's dtype; reads and writes the
    sequences' states (``conv_state`` [S, Cd, K-1], ``ssm_state`` [S, H, P, N]) at ``slots`` (-1: no state,
    nothing written). A sequence with ``context_lens`` 0 starts from zeros; one token over a context decodes.
    ``plan``: :meth:`StepRows.plan` of the same lists, made once per step."""
    plan = plan or StepRows.plan(query_lens, context_lens, slots, xbc.device)
    if plan.decode and plan.rows is None:  # a pure decode step: every row, in order
        y, conv_s, ssm_s = _decode_rows(xbc, dt, params, sh, conv_state[plan.slots], ssm_state[plan.slots])
        conv_state[plan.slots] = conv_s.to(conv_state.dtype)
        ssm_state[plan.slots] = ssm_s.to(ssm_state.dtype)
        return y.to(xbc.dtype)
    out = torch.empty(xbc.shape[0], sh.inner, dtype=torch.float32, device=xbc.device)
    if plan.decode:
        y, conv_s, ssm_s = _decode_rows(xbc[plan.rows], dt[plan.rows], params, sh, conv_state[plan.slots],
                                        ssm_state[plan.slots])
        out[plan.rows] = y
        conv_state[plan.slots] = conv_s.to(conv_state.dtype)
        ssm_state[plan.slots] = ssm_s.to(ssm_state.dtype)
    done, starts = set(plan.decode), plan.starts
    for b, (n, c, s) in enumerate(zip(query_lens, context_lens, slots)):
        if b in done or n == 0:
            continue
        fresh = c == 0 or s < 0
        cs = torch.zeros_like(conv_state[0]) if fresh else conv_state[s].float()
        ss = torch.zeros_like(ssm_state[0]) if fresh else ssm_state[s].float()
        y, cs, ss = _prefill_row(xbc[starts[b]:starts[b + 1]], dt[starts[b]:starts[b + 1]], params, sh, cs, ss)
        out[starts[b]:starts[b + 1]] = y
        if s >= 0:
            conv_state[s], ssm_state[s] = cs.to(conv_state.dtype), ss.to(ssm_state.dtype)
    return out.to(xbc.dtype)
