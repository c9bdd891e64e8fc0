"""``devin::fp8_linear``: a linear over a weight-only FP8 weight (e4m3fn, one scale per output row).

Schema::

    devin::fp8_linear(Tensor x, Tensor qweight, Tensor scale, int out_features, str kernel,
                      Tensor? bias=None, Tensor? dense=None, int max_fp8_tokens=-1,
                      str dense_kernel="linear") -> Tensor

``x`` [..., K] → [..., out_features] in x's dtype. ``qweight`` [N, K] holds e4m3fn codes and
``scale`` [N] float32 (the format: :mod:`devin_compile.backends.fp8.format`); ``kernel``:
``"reference" | "cpu_c" | "scaled_mm"`` (:mod:`devin_compile.backends.fp8.kernels`). As for
``devin::int4_linear``, a step of more than ``max_fp8_tokens`` rows runs a dense GEMM: over the
dense copy ``dense`` when there is one (:mod:`.dense_copy`), else, for "cpu_c", over dequantized
tiles (:mod:`.dequant_tiles`).
"""
from __future__ import annotations

import torch

from ..backends.dequant import FP8Tiles
from ..backends.fp8 import kernels
from ..backends.fp8.format import dequantize, fp8_bytes, quantize  # noqa: F401  (re-exported for passes)
from .dense_copy import dense_step
from .dequant_tiles import is_long_step, tiled_linear
from .onednn_linear import onednn_supports

_lib = torch.library.Library("devin", "FRAGMENT")
_lib.define("fp8_linear(Tensor x, Tensor qweight, Tensor scale, int out_features, str kernel, Tensor? bias=None, "
            "Tensor? dense=None, int max_fp8_tokens=-1, str dense_kernel=\"linear\") -> Tensor")


def fp8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, out_features: int, kernel: str,
               bias: torch.Tensor | None = None, dense: torch.Tensor | None = None, max_fp8_tokens: int = -1,
               dense_kernel: str = "linear") -> torch.Tensor:
    y = dense_step(x, dense, bias, max_fp8_tokens, dense_kernel)
    if y is None and kernel == "cpu_c" and is_long_step(x, dense, max_fp8_tokens):
        y = tiled_linear(x, FP8Tiles(qweight, scale, out_features, x.shape[-1]), bias)
    if y is not None:
        return y
    return kernels.run(x, qweight, scale, out_features, kernel, bias)


_lib.impl("fp8_linear", fp8_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("devin::fp8_linear", lib=_lib)
def _(x, qweight, scale, out_features, kernel, bias=None, dense=None, max_fp8_tokens=-1, dense_kernel="linear"):
    return x.new_empty((*x.shape[:-1], out_features))


def default_kernel(device: torch.device) -> str:
    """The kernel for weights on ``device``: "cpu_c" on CPU ("reference" without a C compiler),
    "scaled_mm" on GPUs with FP8 matmuls (compute capability >= 8.9), else "reference"."""
    return kernels.default_kernel(device)


def max_fp8_tokens(dtype: torch.dtype) -> int:
    """Steps of more tokens than this use the dense copy: the C kernel's measured crossover against
    the dense path this CPU takes for ``dtype`` (``backends/fp8/kernels.MAX_FP8_TOKENS``)."""
    return kernels.max_fp8_tokens(dtype, dense_native=onednn_supports(dtype))


def prepare_operands(kernel: str, q: torch.Tensor, scale: torch.Tensor,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qweight, scale)`` for the op in ``kernel``'s form on ``device``, prepared once at compile time."""
    return kernels.prepare(kernel, q, scale, device)
