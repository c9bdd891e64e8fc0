"""``devin::rotary_heads``: attention's q/k/v projections → rotated heads for paged attention.

Schema::

    devin::rotary_heads(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, int head_dim)
        -> (Tensor, Tensor, Tensor)

q: [..., T, Hq·D], k: [..., T, Hkv·D], v: [..., T, Hkv·Dv] (leading dims of size 1; rows may
be strided, e.g. slices of a fused qkv projection), cos/sin: T·D values ([1, 1, T, D]), with
``sin`` the pre-signed sine of :mod:`~devin_compile.passes.fuse_rotary`. Returns contiguous

    q' = q·cos + roll(q, D/2, -1)·sin   as [T, Hq, D]
    k' = k·cos + roll(k, D/2, -1)·sin   as [T, Hkv, D]
    v' = v                              as [T, Hkv, Dv]   (a copy: an op's outputs never alias)

with each multiply and the add rounded to the inputs' dtype, as the three aten ops would.
The Python kernel is those aten ops; on CPU, :mod:`~devin_compile.backends.fused.cpu_rotary_op`
registers a C++ kernel that does the whole thing in one pass (bit-identical), replacing the
~20 dispatched ops (views, transposes, roll, mul, add, squeeze) a decode step spends per layer.
"""
from __future__ import annotations

import torch

from ..backends.fused import cpu_rotary_op

_lib = torch.library.Library("devin", "FRAGMENT")
_lib.define("rotary_heads(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, int head_dim) "
            "-> (Tensor, Tensor, Tensor)")


def rotary_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 head_dim: int):
    T = q.shape[-2]
    c = cos.reshape(T, 1, head_dim)
    s = sin.reshape(T, 1, head_dim)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(T, x.shape[-1] // head_dim, head_dim)
        return x * c + torch.roll(x, head_dim // 2, -1) * s

    kv_heads = k.shape[-1] // head_dim
    return rotate(q), rotate(k), v.reshape(T, kv_heads, v.shape[-1] // kv_heads).clone(memory_format=torch.contiguous_format)


_lib.impl("rotary_heads", rotary_heads, "CompositeExplicitAutograd")


@torch.library.register_fake("devin::rotary_heads", lib=_lib)
def _(q, k, v, cos, sin, head_dim):
    T = q.shape[-2]
    kv_heads = k.shape[-1] // head_dim
    return (q.new_empty((T, q.shape[-1] // head_dim, head_dim)), k.new_empty((T, kv_heads, head_dim)),
            v.new_empty((T, kv_heads, v.shape[-1] // kv_heads)))


def load_cpu_kernel() -> bool:
    """Register the C++ CPU kernel of ``devin::rotary_heads`` (built the first time, then cached); False
    where it cannot be built, and the Python kernel then serves every CPU call. Passes call this
    when they emit the op into a CPU graph."""
    return cpu_rotary_op.load()
