"""``devin::int4_linear``: a linear over a weight-only INT4 (asymmetric, grouped) weight.

Schema::

    devin::int4_linear(Tensor x, Tensor qweight, Tensor scales_zeros, int group_size,
                       int out_features, str kernel, Tensor? bias=None, Tensor? dense=None,
                       int max_int4_tokens=-1, str dense_kernel="linear") -> Tensor

``x`` [..., K] → [..., out_features] in x's dtype. ``qweight``/``scales_zeros`` are in the
layout of ``kernel`` (``"reference" | "cpu" | "cpu_c" | "triton"``, see
:mod:`devin_compile.backends.int4.kernels`; the format contract is in :mod:`devin_compile.backends.int4.format`).

Kernel choice by the number of tokens in the step: up to ``max_int4_tokens`` rows the int4 kernel
runs. A longer step runs a dense GEMM: over ``dense`` when given (the weight dequantized once, at
compile time, to the activation dtype: :mod:`.dense_copy`, ``dense_kernel`` "mkldnn", "upcast" or
"linear"), else, for the "cpu_c" kernel, over tiles of the weight dequantized into a reused scratch
buffer (:mod:`.dequant_tiles`: no dense copy kept). ``max_int4_tokens=-1`` means "always int4".
"""
from __future__ import annotations

import torch

from ..backends.dequant import Int4Tiles
from ..backends.int4 import crossover, kernels
from ..backends.int4.format import dequantize, int4_bytes  # noqa: F401  (re-exported for passes)
from .onednn_linear import onednn_supports
from .dense_copy import dense_step
from .dequant_tiles import is_long_step, tiled_linear

_lib = torch.library.Library("devin", "FRAGMENT")
_lib.define("int4_linear(Tensor x, Tensor qweight, Tensor scales_zeros, int group_size, int out_features, "
            "str kernel, Tensor? bias=None, Tensor? dense=None, int max_int4_tokens=-1, "
            "str dense_kernel=\"linear\") -> Tensor")


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales_zeros: torch.Tensor, group_size: int,
                out_features: int, kernel: str, bias: torch.Tensor | None = None,
                dense: torch.Tensor | None = None, max_int4_tokens: int = -1,
                dense_kernel: str = "linear") -> torch.Tensor:
    y = dense_step(x, dense, bias, max_int4_tokens, dense_kernel)
    if y is None and kernel == "cpu_c" and is_long_step(x, dense, max_int4_tokens):
        y = tiled_linear(x, Int4Tiles(qweight, scales_zeros, group_size, out_features, x.shape[-1]), bias)
    if y is not None:
        return y
    return kernels.run(x, qweight, scales_zeros, group_size, out_features, kernel, bias)


_lib.impl("int4_linear", int4_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("devin::int4_linear", lib=_lib)
def _(x, qweight, scales_zeros, group_size, out_features, kernel, bias=None, dense=None, max_int4_tokens=-1,
      dense_kernel="linear"):
    return x.new_empty((*x.shape[:-1], out_features))


def default_kernel(device: torch.device) -> str:
    """The kernel ``kernel="auto"`` picks for weights on ``device``: "cpu_c" on CPU ("cpu",
    aten's, without a C compiler), "triton" where Triton runs, else "reference"."""
    if device.type == "cpu":
        return kernels.default_cpu_kernel()
    return "triton" if kernels.triton_available(device) else "reference"


def check_kernel(kernel: str, device: torch.device) -> None:
    """Raise ``ValueError`` (saying why) when ``kernel`` cannot serve weights on ``device``."""
    if kernel == "triton" and not kernels.triton_available(device):
        raise ValueError(f"int4 kernel 'triton' is not available on {device} (needs triton; on CPU only "
                         "under TRITON_INTERPRET=1)")
    if kernel in ("cpu", "cpu_c") and device.type != "cpu":
        raise ValueError(f"int4 kernel {kernel!r} runs on CPU tensors, the model is on {device}")
    if kernel == "cpu_c" and not kernels.cpu_int4_linear.available():
        raise ValueError("int4 kernel 'cpu_c' needs a working C compiler (set CC); use kernel='cpu' (aten's)")


def max_int4_tokens(kernel: str, dtype: torch.dtype) -> int:
    """Steps of more tokens than this use the dense copy: the measured crossover of CPU int4
    ``kernel`` against the dense path this CPU takes for ``dtype`` (backends/int4/crossover.py)."""
    return crossover.max_int4_tokens(kernel, dtype, dense_native=onednn_supports(dtype))


def prepare_operands(kernel: str, q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor, group_size: int,
                     dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qweight, scales_zeros)`` for the op: a logical int4 weight (``q`` [N, K], ``scale`` and
    ``minv`` [N, G]) in ``kernel``'s layout on ``device``, prepared once at compile time."""
    return kernels.prepare(kernel, q, scale, minv, group_size, dtype, device)


def quantize_weight(w: torch.Tensor, group_size: int = 64, kernel: str | None = None) -> tuple:
    """RTN-quantize a dense [N, K] weight into the op's operands ``(qweight, scales_zeros,
    group_size, out_features, kernel)`` for ``w``'s device (``torch.ops.devin.int4_linear(x, *ops)``);
    ``kernel`` defaults to "cpu_c" on CPU ("cpu" without a C compiler) and "triton" (else
    "reference") elsewhere."""
    from ..backends.int4 import format as fmt

    if kernel is None:
        kernel = default_kernel(w.device)
    q, s, m = fmt.rtn_quantize(w.detach().float().cpu(), group_size)
    qw, sz = kernels.prepare(kernel, q, s, m, group_size, w.dtype, w.device)
    return qw, sz, group_size, w.shape[0], kernel


def reference_int4_linear(x: torch.Tensor, operands: tuple) -> torch.Tensor:
    """The torch reference on the operands of :func:`quantize_weight` (any kernel's layout)."""
    from ..backends.int4 import format as fmt

    qw, sz, group_size, n, kernel = operands
    if kernel == "cpu":  # back to the stored nibble layout the reference reads
        kp = sz.shape[0] * group_size
        qw = fmt.pack_nibbles(fmt.unpack_cpu(qw, qw.shape[0], kp))
        sz = sz[:, :n]
    elif kernel == "cpu_c":
        qw = fmt.pack_nibbles(kernels.cpu_int4_linear.unpack(qw, sz.shape[1] * group_size, n))
        sz = fmt.scales_zeros(*kernels.cpu_int4_linear.unpack_scales(sz, n), torch.float32)  # kept in fp32
    return kernels.run(x, qw, sz, group_size, n, "reference")
