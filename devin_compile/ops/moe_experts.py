"""``devin::moe_experts``: a MoE layer's routed experts (gate/up → SiLU·up → down → weighted sum) in one op.

Schema::

    devin::moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor gate_up, Tensor down) -> Tensor

x [T, H]; topk_ids [T, k] (int64, the router's choice per token; ids outside [0, E) select
nothing); topk_weights [T, k]; ``gate_up`` and ``down``: the experts' weights in the packed
layout of :func:`pack_experts` (HF's ``gate_up_proj`` [E, 2F, H] → [E, F/16, H, 32] and
``down_proj`` [E, H, F] → [E, H/16, F, 16]). Returns [T, H]:
``Σ_s w[t,s] · down_e(silu(gate_e(x_t)) · up_e(x_t))`` with ``e = topk_ids[t, s]``, which is what
transformers' ``grouped_mm_experts_forward`` computes (the slots summed in order, as its
``view(T, k, H).sum(1)``).

Kernels: the Python kernel (:func:`moe_experts_reference`, the oracle: unpacks each selected
expert and runs HF's math with torch ops, any device and dtype); on CPU for float32 a C++ kernel
(``backends/native/cpu_moe_experts_op.cpp`` + ``cpu_packed_gemm.c``) that reads each selected
expert's weights once per call for all of its rows. Values equal the reference up to float32
summation order.
"""
from __future__ import annotations

import torch

from ..backends.fused import cpu_moe_experts_op

_lib = torch.library.Library("devin", "FRAGMENT")
_lib.define("moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor gate_up, Tensor down) -> Tensor")

BLOCK = 16  # output columns per packed block (one AVX-512 vector of float32)


def pack_experts(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF expert weights ``gate_up`` [E, 2F, H] (gate rows, then up rows) and ``down`` [E, H, F] →
    the op's packed layout: [E, F/16, H, 32] (per block of 16 intermediate columns, each input row
    holds 16 gate then 16 up weights) and [E, H/16, F, 16]. F and H must be multiples of 16."""
    e, f2, h = gate_up.shape
    f = f2 // 2
    if f2 % 2 or f % BLOCK or h % BLOCK or tuple(down.shape) != (e, h, f):
        raise ValueError(f"devin::moe_experts packs gate_up [E, 2F, H] and down [E, H, F] with F and H multiples of "
                         f"{BLOCK}; got {tuple(gate_up.shape)} and {tuple(down.shape)}")
    blocks = gate_up.detach().reshape(e, 2, f // BLOCK, BLOCK, h).permute(0, 2, 4, 1, 3)  # [E, F/16, H, 2, 16]
    packed_gate_up = blocks.reshape(e, f // BLOCK, h, 2 * BLOCK).contiguous()
    packed_down = down.detach().reshape(e, h // BLOCK, BLOCK, f).transpose(2, 3).contiguous()
    return packed_gate_up, packed_down


def unpack_experts(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_experts`: HF's [E, 2F, H] and [E, H, F] (views where possible)."""
    e, fb, h, _ = gate_up.shape
    dense_gate_up = gate_up.reshape(e, fb, h, 2, BLOCK).permute(0, 3, 1, 4, 2).reshape(e, 2 * fb * BLOCK, h)
    dense_down = down.transpose(2, 3).reshape(e, h, fb * BLOCK)
    return dense_gate_up, dense_down


def moe_experts_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """HF's experts math, one expert at a time over the pairs that selected it."""
    dense_gate_up, dense_down = unpack_experts(gate_up, down)
    t, k = topk_ids.shape
    y = x.new_zeros((t, k, x.shape[-1]))
    for e in torch.unique(topk_ids).tolist():
        if not 0 <= e < dense_gate_up.shape[0]:
            continue
        tok, slot = torch.where(topk_ids == e)
        gate, up = torch.nn.functional.linear(x[tok], dense_gate_up[e]).chunk(2, dim=-1)
        out = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, dense_down[e])
        y[tok, slot] = out * topk_weights[tok, slot, None].to(out.dtype)
    return y.sum(1)


_lib.impl("moe_experts", moe_experts_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("devin::moe_experts", lib=_lib)
def _(x, topk_ids, topk_weights, gate_up, down):
    return x.new_empty(x.shape)


def load_cpu_kernel() -> bool:
    """Register the C++ CPU kernel (built the first time, then cached); False where it cannot be
    built (no C/C++ compiler), and the Python kernel then serves every call."""
    return cpu_moe_experts_op.load()


def cpu_kernel_declines(dtype: torch.dtype, hidden: int, intermediate: int) -> str | None:
    """Why the C++ kernel would not serve experts of this dtype and shape (None: it would)."""
    if dtype != torch.float32:
        return f"the CPU kernel computes float32 only, not {dtype}"
    if hidden % BLOCK or intermediate % BLOCK:
        return f"hidden {hidden} / intermediate {intermediate} not multiples of {BLOCK} (the packed layout's block)"
    return None
