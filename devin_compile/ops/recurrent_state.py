"""``devin::causal_conv1d``, ``devin::selective_scan``, ``devin::gated_delta_rule``, ``devin::linear_recurrence``:
the stateful steps of Mamba (v1) mixers, gated DeltaNet layers and RecurrentGemma's recurrent blocks.

Schemas::

    devin::causal_conv1d(Tensor x, Tensor weight, Tensor? bias, int layer, bool silu=True) -> Tensor
    devin::selective_scan(Tensor x, Tensor dt, Tensor A_log, Tensor B, Tensor C, Tensor D, Tensor z,
                          Tensor? dt_bias, int layer) -> Tensor
    devin::gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, int layer) -> Tensor
    devin::linear_recurrence(Tensor a, Tensor x, int layer) -> Tensor

``causal_conv1d``: x [1, T, C] → ``silu(depthwise causal conv)`` [1, T, C], its window state (the last K-1
inputs) is recurrent layer ``layer``'s state 0. ``selective_scan``: x, dt (before ``dt_bias`` and softplus),
z [1, T, I], B, C [1, T, N] → ``(scan(x) + D·x)·silu(z)`` [1, T, I], its SSM state [I, N] is state 1 of the
same layer. ``gated_delta_rule``: q, k [1, T, Hk, Dk], v [1, T, Hv, Dv], g (log decay), beta [1, T, Hv] →
o [1, T, Hv, Dv] (``backends/recurrent/gated_delta.py``), its state [Hv, Dk, Dv] is state 1 of the layer (its
conv, state 0, is ``causal_conv1d``'s). ``linear_recurrence``: ``h_t = a_t·h_{t-1} + x_t`` over a, x
[1, T, W] (RG-LRU), its state [W] is state 1 (``causal_conv1d(..., silu=False)``'s is state 0). Between them
the layer's other ops (Mamba's ``x_proj`` / ``dt_proj``, DeltaNet's head split and gates, the RG-LRU gates) stay
in the graph. Sequences, slots and fresh starts come from the step context exactly as for ``devin::mamba2_scan``
(see there): :func:`step_rows` plans them once per step; kernels in ``backends/recurrent/conv.py``, ``mamba.py``,
``gated_delta.py`` and ``linear_scan.py``. Inference only; state writes are side effects the graph does not see
(``devin::`` ops are never removed or merged by the passes).
"""
from __future__ import annotations

import torch

from ..backends.recurrent.conv import causal_conv_step
from ..backends.recurrent.gated_delta import gated_delta_step
from ..backends.recurrent.linear_scan import linear_scan_step
from ..backends.recurrent.mamba import selective_scan_step
from ..backends.recurrent.step_rows import StepRows
from ..step import current_context

_lib = torch.library.Library("devin", "FRAGMENT")
_lib.define("causal_conv1d(Tensor x, Tensor weight, Tensor? bias, int layer, bool silu=True) -> Tensor")
_lib.define("selective_scan(Tensor x, Tensor dt, Tensor A_log, Tensor B, Tensor C, Tensor D, Tensor z, "
            "Tensor? dt_bias, int layer) -> Tensor")
_lib.define("gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, int layer) -> Tensor")
_lib.define("linear_recurrence(Tensor a, Tensor x, int layer) -> Tensor")


def step_rows(op: str):
    """(the step's :class:`StepRows`, planned once per step; the state pool) for a recurrent op."""
    ctx = current_context()
    if ctx.states is None:
        raise RuntimeError(f"devin::{op} ran in a step without a state pool: this model has recurrent layers, so run "
                           "it through devin_compile's Engine/OptimizedModel (which allocate their state slots), "
                           "or install a StateStep in the step context")
    meta = ctx.attn
    rows = meta.scratch.get("recurrent_rows")
    if rows is None:
        context = [s - q for s, q in zip(meta.seq_lens_host, meta.query_lens_host)]
        rows = meta.scratch["recurrent_rows"] = StepRows.plan(meta.query_lens_host, context, ctx.states.slots,
                                                              meta.query_start_loc.device)
    return rows, ctx.states.pool


def causal_conv1d(x, weight, bias, layer: int, silu: bool = True) -> torch.Tensor:
    rows, pool = step_rows("causal_conv1d")
    return causal_conv_step(x[0], weight, bias, pool.layer(layer)[0], rows, silu).to(x.dtype)[None]


def linear_recurrence(a, x, layer: int) -> torch.Tensor:
    rows, pool = step_rows("linear_recurrence")
    return linear_scan_step(a[0], x[0], pool.layer(layer)[1], rows).to(x.dtype)[None]


def selective_scan(x, dt, A_log, B, C, D, z, dt_bias, layer: int) -> torch.Tensor:
    rows, pool = step_rows("selective_scan")
    return selective_scan_step(x[0], dt[0], A_log, B[0], C[0], D, z[0], dt_bias, pool.layer(layer)[1],
                               rows).to(x.dtype)[None]


def gated_delta_rule(q, k, v, g, beta, layer: int) -> torch.Tensor:
    rows, pool = step_rows("gated_delta_rule")
    return gated_delta_step(q[0], k[0], v[0], g[0], beta[0], pool.layer(layer)[1], rows).to(v.dtype)[None]


_lib.impl("gated_delta_rule", gated_delta_rule, "CompositeExplicitAutograd")
_lib.impl("causal_conv1d", causal_conv1d, "CompositeExplicitAutograd")
_lib.impl("linear_recurrence", linear_recurrence, "CompositeExplicitAutograd")
_lib.impl("selective_scan", selective_scan, "CompositeExplicitAutograd")


@torch.library.register_fake("devin::causal_conv1d", lib=_lib)
def _(x, weight, bias, layer, silu=True):
    return torch.empty_like(x)


@torch.library.register_fake("devin::linear_recurrence", lib=_lib)
def _(a, x, layer):
    return torch.empty_like(x)


@torch.library.register_fake("devin::gated_delta_rule", lib=_lib)
def _(q, k, v, g, beta, layer):
    return torch.empty_like(v)


@torch.library.register_fake("devin::selective_scan", lib=_lib)
def _(x, dt, A_log, B, C, D, z, dt_bias, layer):
    return torch.empty_like(x)
