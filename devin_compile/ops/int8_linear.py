"""``devin::int8_linear``: a linear over a weight-only INT8 weight (one scale per output row), the output
head's format with ``lm_head="int8"``.

Schema::

    devin::int8_linear(Tensor x, Tensor qweight, Tensor scale, int out_features, str kernel,
                       Tensor? bias=None) -> Tensor

``x`` [..., K] → [..., out_features] in x's dtype: ``x @ (q · scale)ᵀ`` with float32 sums.
``qweight``/``scale`` are in ``kernel``'s form (:func:`prepare_operands`; the kernels and layouts:
:mod:`devin_compile.backends.int8.kernels`). The head only multiplies the rows that need logits, so
the kernel serves every step (no dense copy, no long-step path).
"""
from __future__ import annotations

import torch

from ..backends.int8 import kernels
from ..backends.int8.format import int8_bytes  # noqa: F401  (re-exported for passes)

_lib = torch.library.Library("devin", "FRAGMENT")
_lib.define("int8_linear(Tensor x, Tensor qweight, Tensor scale, int out_features, str kernel, "
            "Tensor? bias=None) -> Tensor")


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, out_features: int, kernel: str,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    return kernels.run(x, qweight, scale, out_features, kernel, bias)


_lib.impl("int8_linear", int8_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("devin::int8_linear", lib=_lib)
def _(x, qweight, scale, out_features, kernel, bias=None):
    return x.new_empty((*x.shape[:-1], out_features))


def default_kernel(device: torch.device) -> str:
    return kernels.default_kernel(device)


def prepare_operands(kernel: str, q: torch.Tensor, scale: torch.Tensor,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qweight, scale)`` for the op in ``kernel``'s form on ``device``, prepared once at compile time."""
    return kernels.prepare(kernel, q, scale, device)
