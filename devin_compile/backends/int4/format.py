"""INT4 weight format: the one contract every algorithm, kernel and artifact shares.

Logical form of a quantized ``[N, K]`` weight with group size ``g`` (``G = ceil(K / g)``
groups per output row, asymmetric)::

    q      uint8  [N, K]   values 0..15
    scale  fp32   [N, G]
    minv   fp32   [N, G]   (the group's minimum; its "zero point" in real units)
    w[n, k] = q[n, k] * scale[n, k // g] + minv[n, k // g]

The last group of a row may be short when ``g`` does not divide ``K``: its statistics
come from its real columns only, and kernels pad K up to ``G * g`` with zero
activations, so the padding never contributes.

Stored form (artifacts, the Triton kernel and the reference): ``qweight`` uint8
``[N, ceil(K / 2)]``, two values a byte along K, the even column in the low nibble.

CPU kernel form (``aten._weight_int4pack_mm_for_cpu``), built by :func:`pack_for_cpu`:

- N is padded to a multiple of 64 and K to ``G * g`` (zero rows/columns). The op needs
  N % 16 == 0; 64 makes the layout uniform (torch 2.13 packs blocks of 64 rows, and
  tails of 32/16 rows differently);
- ``aten._convert_weight_to_int4pack_for_cpu(q.int32 [Np, Kp], 1)`` → uint8 ``[Np, Kp / 2]``,
  laid out as ``[Np / B, Kp, B / 2]`` with a row block ``B`` that depends on the CPU build
  torch picked: 64 on AVX-512 machines, 32 on AVX2 ones. Byte ``b`` of column ``k`` in row
  block ``r`` holds row ``B r + b`` in its low nibble and row ``B r + B / 2 + b`` in its high
  nibble (:func:`cpu_block_rows` finds ``B`` once by packing a probe; :func:`unpack_cpu`
  inverts the layout; a test pins it);
- ``scales_zeros`` ``[G, Np, 2]`` in the activation dtype: ``[..., 0] = scale`` and
  ``[..., 1] = zero = minv + 8 * scale``, because the kernel computes
  ``(q - 8) * scale + zero``.

The Triton kernel and the reference take the same ``scales_zeros`` tensor (``[G, N, 2]``,
unpadded N) with the stored ``qweight``.
"""
from __future__ import annotations

import functools
import math

import torch

SUPPORTED_GROUP_SIZES = (32, 64, 128)
SUPPORTED_BITS = (4,)
QMAX = 15


def num_groups(k: int, group_size: int) -> int:
    return -(-k // group_size)


def choose_group_size(k: int, requested: int, supported: tuple[int, ...] = SUPPORTED_GROUP_SIZES) -> tuple[int, str]:
    """The group size used for an input width ``k``: ``requested`` if it divides ``k``, else
    the largest supported size below it that does, else ``requested`` with a short last
    group (padded by the kernels). Returns ``(size, why)``; ``why`` is "" when unchanged."""
    if k % requested == 0:
        return requested, ""
    for g in sorted(supported, reverse=True):
        if g < requested and k % g == 0:
            return g, f"{requested} does not divide K={k}: largest dividing size {g}"
    return requested, f"no supported size divides K={k}: last group padded ({k % requested} of {requested})"


def group_minmax(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group min and max of ``w`` [N, K] (short last group: real columns only) → [N, G] each."""
    n, k = w.shape
    g = num_groups(k, group_size)
    pad = g * group_size - k
    wf = w.float()
    if pad:
        lo = torch.nn.functional.pad(wf, (0, pad), value=float("inf")).view(n, g, group_size).amin(-1)
        hi = torch.nn.functional.pad(wf, (0, pad), value=float("-inf")).view(n, g, group_size).amax(-1)
        return lo, hi
    v = wf.view(n, g, group_size)
    return v.amin(-1), v.amax(-1)


def params_from_range(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, minv) of the asymmetric 4-bit grid that spans [lo, hi] ; the kernels take a
    real-valued zero, so 0 need not lie on the grid."""
    scale = (hi - lo) / QMAX
    scale = torch.where(scale > 0, scale, torch.full_like(scale, 1e-8))
    return scale, lo


def expand_groups(t: torch.Tensor, k: int, group_size: int) -> torch.Tensor:
    """[N, G] per-group values → [N, K] per-column values."""
    return t.repeat_interleave(group_size, dim=1)[:, :k]


def quantize_with(w: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor, group_size: int) -> torch.Tensor:
    """q = clamp(round((w - minv) / scale), 0, 15) on a given grid → uint8 [N, K]."""
    k = w.shape[1]
    s = expand_groups(scale, k, group_size)
    m = expand_groups(minv, k, group_size)
    return ((w.float() - m) / s).round_().clamp_(0, QMAX).to(torch.uint8)


def rtn_quantize(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round to nearest on each group's min-max grid → (q uint8 [N,K], scale [N,G], minv [N,G])."""
    scale, minv = params_from_range(*group_minmax(w, group_size))
    return quantize_with(w, scale, minv, group_size), scale, minv


def dequantize(q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor, group_size: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    k = q.shape[1]
    w = q.float() * expand_groups(scale.float(), k, group_size) + expand_groups(minv.float(), k, group_size)
    return w.to(dtype)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values 0..15 → uint8 [N, ceil(K/2)], even column in the low nibble."""
    n, k = q.shape
    if k % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles` → uint8 [N, k]."""
    lo = packed & 15
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)[:, :k]


def scales_zeros(scale: torch.Tensor, minv: torch.Tensor, dtype: torch.dtype, pad_n: int = 0) -> torch.Tensor:
    """[N, G] scale and minv → the kernels' [G, N + pad_n, 2] (scale, minv + 8·scale) tensor."""
    sz = torch.stack([scale.float(), minv.float() + 8 * scale.float()], dim=-1)  # [N, G, 2]
    if pad_n:
        sz = torch.nn.functional.pad(sz, (0, 0, 0, 0, 0, pad_n))
    return sz.transpose(0, 1).contiguous().to(dtype)


def padded_k(k: int, group_size: int) -> int:
    return num_groups(k, group_size) * group_size


def pack_for_cpu(q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor, group_size: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical int4 weight → (packed [Np, Kp/2] uint8, scales_zeros [G, Np, 2]) for the CPU kernel."""
    n, k = q.shape
    pad_n = -n % 64
    kp = padded_k(k, group_size)
    qi = torch.nn.functional.pad(q.to(torch.int32), (0, kp - k, 0, pad_n))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qi.contiguous(), 1)
    return packed, scales_zeros(scale, minv, dtype, pad_n)


def unpack_cpu(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of the CPU packing (see the module docstring) → uint8 [n, k]."""
    return _unpack_blocks(packed, cpu_block_rows())[:n, :k]


def _unpack_blocks(packed: torch.Tensor, block: int) -> torch.Tensor:
    np_, half = packed.shape
    kp = half * 2
    p3 = packed.view(np_ // block, kp, block // 2)
    q = torch.stack([p3 & 15, p3 >> 4], dim=1)  # [Np/B, 2, Kp, B/2]: row B·r + B/2·nibble + b
    return q.permute(0, 1, 3, 2).reshape(np_, kp)


@functools.lru_cache(maxsize=None)
def cpu_block_rows() -> int:
    """The row block ``B`` of this machine's CPU int4 packing (64 or 32), found by packing a probe."""
    probe = torch.arange(64 * 4, dtype=torch.int32).view(64, 4) * 7 % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe.contiguous(), 1)
    for block in (64, 32, 16):
        if torch.equal(_unpack_blocks(packed, block).to(torch.int32), probe):
            return block
    raise RuntimeError("unrecognised layout from aten._convert_weight_to_int4pack_for_cpu; "
                       "use the reference or Triton int4 kernel (kernel='reference')")


def int4_bytes(n: int, k: int, group_size: int, scale_bytes: int = 2) -> int:
    """Storage of one INT4 linear: nibbles plus a scale and a zero per group (in ``scale_bytes``)."""
    return n * math.ceil(k / 2) + 2 * n * num_groups(k, group_size) * scale_bytes
