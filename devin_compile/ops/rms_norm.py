"""``devin::rms_norm``: RMSNorm over the last dimension with a weight.

Schema::

    devin::rms_norm(Tensor x, Tensor weight, float eps) -> Tensor

``y = x / sqrt(mean(x², -1) + eps) · weight``, computed in float32 and rounded once to x's
dtype. The Python kernel is ``aten.rms_norm`` (what :mod:`~devin_compile.passes.fuse_rms_norm`
emitted before this op existed). On CPU, :mod:`~devin_compile.backends.fused.cpu_rms_norm_op`
registers a C++ kernel for the calls it serves (contiguous fp32/bf16/fp16): aten's composite
rms_norm dispatches ~9 ops, ~25 µs per call at one token on a 2-core CPU, and a SmolLM2
decode step makes 61 calls. Inductor gets ``aten.rms_norm`` back (``compile_decode`` rewrites
the op before compiling, so the norm fuses with its neighbours there).

``devin::add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)`` is a
residual add and the norm after it, ``s = x + residual; (rms_norm(s, weight, eps), s)``, for
:mod:`~devin_compile.passes.fuse_add_rms_norm`: one dispatched op where there were two, and on CPU
one C++ pass over the row (same kernel file, bit-identical to the add and the norm).
"""
from __future__ import annotations

import torch

from ..backends.fused import cpu_rms_norm_op

_lib = torch.library.Library("devin", "FRAGMENT")
_lib.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_lib.define("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.aten.rms_norm.default(x, [x.shape[-1]], weight, eps)


_lib.impl("rms_norm", rms_norm, "CompositeExplicitAutograd")


@torch.library.register_fake("devin::rms_norm", lib=_lib)
def _(x, weight, eps):
    return rms_norm(x, weight, eps)  # aten's meta kernel gives the shape and the promoted dtype


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.ops.aten.add.Tensor(x, residual)
    return rms_norm(s, weight, eps), s


_lib.impl("add_rms_norm", add_rms_norm, "CompositeExplicitAutograd")


@torch.library.register_fake("devin::add_rms_norm", lib=_lib)
def _(x, residual, weight, eps):
    return add_rms_norm(x, residual, weight, eps)


def load_cpu_kernel() -> bool:
    """Register the C++ CPU kernel of ``devin::rms_norm`` (built the first time, then cached); False
    where it cannot be built, and the Python kernel then serves every CPU call. Passes call this
    when they emit the op into a CPU graph."""
    return cpu_rms_norm_op.load()
