"""Compact storage of symmetric positive semi-definite matrices (the calibration Hessians).

A [K, K] matrix ``H`` is kept as its exact fp32 diagonal ``d`` plus the strict upper triangle of
its correlation matrix ``C = D^-1/2 H D^-1/2`` (every entry in [-1, 1] for a PSD matrix),
rounded to ``bits``-bit fixed point (``round(C · L)``, ``L = 2^(bits-1) - 1``, stored with the
offset ``L`` as an unsigned code) and packed little-endian: ``bits`` is 8 (one byte each), 12
(two values in 3 bytes) or 16. Decoding gives ``H_ij = C_ij √(d_i d_j)`` with the diagonal exact,
so each entry errs by at most ``√(d_i d_j) / 2L`` (about 2.4e-4 of its Cauchy-Schwarz bound at 12 bits,
3.9e-3 at 8). A channel with ``d_i = 0`` has an all-zero row, decoded exactly.

Stored bytes for one matrix: ``4 K`` + the packed ``K (K - 1) / 2`` codes (:func:`stored_bytes`).
"""
from __future__ import annotations

import torch


BITS = (8, 12, 16)  # the fixed-point widths with a packing here


def levels(bits: int) -> int:
    """``L``: the fixed-point scale, codes run over ``[-L, L]``."""
    if bits not in BITS:
        raise ValueError(f"correlation bits must be one of {BITS}, got {bits}")
    return (1 << (bits - 1)) - 1


def packed_bytes(count: int, bits: int) -> int:
    """Bytes holding ``count`` values of ``bits`` bits (12-bit values go in pairs, 3 bytes each)."""
    levels(bits)
    return 3 * (-(-count // 2)) if bits == 12 else count * bits // 8


def stored_bytes(k: int, bits: int) -> int:
    """Bytes one [k, k] matrix takes (fp32 diagonal + packed upper correlation triangle)."""
    return 4 * k + packed_bytes(k * (k - 1) // 2, bits)


def upper_triangle(m: torch.Tensor, offset: int = 1) -> torch.Tensor:
    """The entries of the square ``m`` at and right of diagonal ``offset`` (1: strictly upper),
    row by row, as one vector."""
    k = m.shape[0]
    rows = [m[r, r + offset:] for r in range(max(0, k - offset))]
    return torch.cat(rows) if rows else m.new_zeros(0)


def from_upper_triangle(vec: torch.Tensor, k: int, offset: int = 1) -> torch.Tensor:
    """The [k, k] matrix with :func:`upper_triangle` ``vec`` in place and zeros elsewhere."""
    mask = torch.ones(k, k, dtype=torch.bool).triu_(offset)
    n = int(mask.sum())
    if vec.numel() != n:
        raise ValueError(f"{vec.numel()} values do not fill the triangle of a {k} x {k} matrix at offset {offset}")
    return vec.new_zeros(k, k).masked_scatter_(mask, vec)  # row-major, as upper_triangle reads it


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The unsigned ``bits``-bit values ``codes`` [M] as uint8 bytes, little-endian."""
    levels(bits)
    c = codes.to(torch.int32)
    if bits == 8:
        return c.to(torch.uint8)
    if bits == 16:
        return torch.stack([c & 0xFF, c >> 8], 1).to(torch.uint8).reshape(-1)
    if c.numel() % 2:
        c = torch.cat([c, c.new_zeros(1)])
    a, b = c[0::2], c[1::2]
    return torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], 1).to(torch.uint8).reshape(-1)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``count`` values as int32."""
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != packed_bytes(count, bits):
        raise ValueError(f"expected {packed_bytes(count, bits)} packed uint8 bytes for {count} values of {bits} "
                         f"bits, got {packed.dtype} {tuple(packed.shape)}")
    p = packed.to(torch.int32)
    if bits == 8:
        return p
    if bits == 16:
        p = p.reshape(-1, 2)
        return p[:, 0] | (p[:, 1] << 8)
    p = p.reshape(-1, 3)
    a = p[:, 0] | ((p[:, 1] & 0xF) << 8)
    b = (p[:, 1] >> 4) | (p[:, 2] << 4)
    return torch.stack([a, b], 1).reshape(-1)[:count]


def encode_psd(h: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 diagonal [K], packed correlation codes [uint8]) of the symmetric PSD matrix ``h``."""
    if h.dim() != 2 or h.shape[0] != h.shape[1]:
        raise ValueError(f"expected a square matrix, got shape {tuple(h.shape)}")
    lv = levels(bits)
    h = h.detach().float().cpu()
    diag = torch.diagonal(h).clone()
    s = diag.clamp(min=0).sqrt()
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    corr = h * (inv[:, None] * inv[None, :])
    codes = corr.clamp_(-1.0, 1.0).mul_(lv).round_().to(torch.int32).add_(lv)
    return diag, pack_bits(upper_triangle(codes), bits)


def decode_psd(diag: torch.Tensor, packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The fp32 [K, K] matrix that :func:`encode_psd` stored (exactly symmetric)."""
    lv = levels(bits)
    k = diag.numel()
    vals = (unpack_bits(packed, bits, k * (k - 1) // 2) - lv).float().div_(lv)
    corr = from_upper_triangle(vals, k)
    corr += corr.t().clone()
    s = diag.float().clamp(min=0).sqrt()
    out = corr.mul_(s[:, None] * s[None, :])
    out.diagonal().copy_(diag.float())
    return out
