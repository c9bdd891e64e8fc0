"""Long steps of ``devin::int4_linear`` / ``devin::fp8_linear`` without a dense copy: dequantized tiles.

A step of more rows than the quantized kernel's crossover runs :func:`tiled_linear`: the weight is
dequantized a tile of 16-row blocks at a time (:mod:`devin_compile.backends.dequant`, C) into a
scratch buffer that the calling thread reuses for every call, and a dense GEMM multiplies x by the
tile. So the model keeps only its quantized weights; the price is one pass over the quantized
weight per long step, small against the GEMM at prefill lengths (``bench/memory.py``).

Which GEMM: float32 activations on a CPU where devin's packed GEMM tile holds 8 rows (AVX-512) run
``devin::packed_gemm_linear`` over tiles written in its ``[blocks, K, 16]`` layout (as fast as
oneDNN's prepacked GEMM there, where a plain ``torch.mm`` over an unpacked weight is 1.2-1.4x slower);
otherwise the tile is the weight transposed, ``[K, columns]``, and ``torch.mm`` runs it: in the
activation dtype where oneDNN runs it natively, else in float32 (bf16/fp16 on CPUs without native
half-precision GEMMs, as ``upcast_linear`` does for dense weights).
"""
from __future__ import annotations

import functools
import threading

import torch

from ..backends import dequant
from ..backends.dequant import ROWS, Tiles
from . import packed_gemm_linear as packed_op
from .onednn_linear import onednn_supports

# Bytes of one tile, in the GEMM's dtype: SmolLM2's widest linear (gate+up, 3072 x 576) is one float32
# tile; larger models' linears take several, so the scratch stays this size.
TILE_BYTES = 8 << 20

_scratch = threading.local()


def scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's scratch buffer of ``dtype`` with at least ``numel`` elements (grown, never shrunk)."""
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < numel:
        buffers[dtype] = None  # the old buffer goes before the new one is allocated
        with torch.inference_mode(False):  # a normal tensor: written in place in and out of inference mode
            buf = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buf


def available() -> bool:
    """Whether long steps can run as dequantized tiles here (the C dequantizer builds); loads it and
    the packed GEMM's kernel, so a pass can ask at compile time rather than in the first long step."""
    packed_gemm_serves()
    return dequant.available()


def is_long_step(x: torch.Tensor, dense: torch.Tensor | None, max_tokens: int) -> bool:
    """Whether the op runs this step as tiles: no dense copy, a row limit (``>= 0``), more rows than it."""
    return dense is None and max_tokens >= 0 and x.numel() // max(1, x.shape[-1]) > max_tokens


@functools.lru_cache(maxsize=None)
def packed_gemm_serves() -> bool:
    """Whether float32 tiles go to ``devin::packed_gemm_linear`` (its C++ kernel built, 8-row register tile)."""
    return packed_op.load_cpu_kernel() and packed_op.serves_many_rows()


def gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tile's GEMM computes in for ``dtype`` activations."""
    return dtype if dtype == torch.float32 or onednn_supports(dtype) else torch.float32


def blocks_per_tile(nblocks: int, k: int, dtype: torch.dtype, tile_bytes: int = TILE_BYTES) -> int:
    """16-row blocks in one tile of a [16 nblocks, k] weight: as many as fit in ``tile_bytes``, at least one."""
    per_block = ROWS * k * torch.empty((), dtype=dtype).element_size()
    return max(1, min(nblocks, tile_bytes // per_block))


def tiled_linear(x: torch.Tensor, tiles: Tiles, bias: torch.Tensor | None = None,
                 tile_bytes: int = TILE_BYTES) -> torch.Tensor:
    """``linear(x, W, bias)`` → [..., n] in x's dtype, with W [n, k] dequantized tile by tile by ``tiles``."""
    n, k = tiles.n, tiles.k
    x2 = x.reshape(-1, k)
    dt = gemm_dtype(x.dtype)
    nblocks = -(-n // ROWS)
    per_tile = blocks_per_tile(nblocks, k, dt, tile_bytes)
    buf = scratch(per_tile * ROWS * k, dt)
    packed = dt == torch.float32 and k % 2 == 0 and packed_gemm_serves()
    xg = x2 if x2.dtype == dt else x2.to(dt)
    y = None if per_tile == nblocks else xg.new_empty((x2.shape[0], n))
    for b0 in range(0, nblocks, per_tile):
        nb = min(per_tile, nblocks - b0)
        c0, cols = b0 * ROWS, min(nb * ROWS, n - b0 * ROWS)
        if packed:
            w = buf[: nb * ROWS * k].view(nb, k, ROWS)
            tiles(b0, nb, w, ROWS * k, ROWS)
            part = torch.ops.devin.packed_gemm_linear(xg, w, bias if y is None else None, cols)
        else:
            w = buf[: k * nb * ROWS].view(k, nb * ROWS)
            tiles(b0, nb, w, ROWS, nb * ROWS)
            part = _mm(xg, w[:, :cols], bias if y is None else None)
        if y is None:
            y = part
        else:
            y[:, c0:c0 + cols] = part
    if bias is not None and per_tile != nblocks:
        y += bias
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def _mm(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(x, w_t) if bias is None else torch.addmm(bias.to(x.dtype), x, w_t)
