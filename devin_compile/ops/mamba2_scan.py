"""``devin::mamba2_scan``: a Mamba2 mixer's stateful core over the step's packed tokens.

Schema::

    devin::mamba2_scan(Tensor xbc, Tensor dt, Tensor conv_weight, Tensor? conv_bias, Tensor dt_bias,
                       Tensor A_log, Tensor D, int layer, int num_heads, int head_dim, int n_groups,
                       int state_size, int chunk_size, float dt_min=0., float dt_max=-1.) -> Tensor

``xbc`` [1, T, Cd] (the conv's input: x, B, C before the depthwise conv), ``dt`` [1, T, H] (before
``dt_bias`` and softplus) → ``y`` [1, T, H·P]: conv + SiLU + selective scan + the ``D`` skip, what HF's
``causal_conv1d_forward`` and ``mamba2_scan_forward`` compute between a Mamba2 mixer's ``in_proj`` split and its
gated norm (``dt_max`` ≤ 0: no upper limit). Sequence b owns tokens
``query_start_loc[b]:query_start_loc[b+1]`` of the step
(``AttentionMetadata``); its conv window and SSM state live in recurrent layer ``layer``'s slot
``StepContext.states.slots[b]`` of the state pool, read when the sequence has cached tokens before the step
(``seq_lens - query_len > 0``), else zeros, and written back after. Prefill chunks run the chunked form, decode
tokens the one-step recurrence (``backends/recurrent/mamba2.py``). The state is side-effect the graph does not
see: the op is never removed, merged or reordered by the passes (``graph_utils`` treats ``devin::`` ops as
side-effecting). Inference only.
"""
from __future__ import annotations

import torch

from ..backends.recurrent.mamba2 import Mamba2Shape, mamba2_forward
from .recurrent_state import step_rows

_lib = torch.library.Library("devin", "FRAGMENT")
_lib.define("mamba2_scan(Tensor xbc, Tensor dt, Tensor conv_weight, Tensor? conv_bias, Tensor dt_bias, "
            "Tensor A_log, Tensor D, int layer, int num_heads, int head_dim, int n_groups, int state_size, "
            "int chunk_size, float dt_min=0., float dt_max=-1.) -> Tensor")


def mamba2_scan(xbc, dt, conv_weight, conv_bias, dt_bias, A_log, D, layer: int, num_heads: int, head_dim: int,
                n_groups: int, state_size: int, chunk_size: int, dt_min: float = 0.0,
                dt_max: float = -1.0) -> torch.Tensor:
    rows, pool = step_rows("mamba2_scan")
    conv_state, ssm_state = pool.layer(layer)
    sh = Mamba2Shape(num_heads, head_dim, n_groups, state_size, chunk_size, dt_min,
                     dt_max if dt_max > 0 else float("inf"))
    params = dict(conv_weight=conv_weight, conv_bias=conv_bias, dt_bias=dt_bias, A_log=A_log, D=D)
    return mamba2_forward(xbc[0], dt[0], params, sh, conv_state, ssm_state, rows)[None]


_lib.impl("mamba2_scan", mamba2_scan, "CompositeExplicitAutograd")


@torch.library.register_fake("devin::mamba2_scan", lib=_lib)
def _(xbc, dt, conv_weight, conv_bias, dt_bias, A_log, D, layer, num_heads, head_dim, n_groups, state_size,
      chunk_size, dt_min=0.0, dt_max=-1.0):
    return xbc.new_empty((xbc.shape[0], xbc.shape[1], num_heads * head_dim))
