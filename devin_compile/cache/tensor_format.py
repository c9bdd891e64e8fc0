"""Tensors as cache values without pickle: a small fixed header and the raw element bytes.

Layout (all integers little-endian)::

    offset  size     field
    0       4        magic b"DVKT"
    4       2        format version (u16) = FORMAT_VERSION
    6       1        dtype code (u8, DTYPE_CODES)
    7       1        ndim (u8, at most 8)
    8       2        fingerprint length F in bytes (u16)
    10      8        payload length N in bytes (u64)
    18      8        xxh3_64 of the payload (u64)
    26      8*ndim   shape (u64 each)
    ..      F        fingerprint (UTF-8): the model/layout the tensor belongs to (keys.model_fingerprint)
    ..      N        payload: the elements in C order, little-endian

Decoding checks every field against what the reader expects (dtype, shape, fingerprint) and the
payload against its length and checksum; any mismatch, a truncated value or an unknown version
raises :class:`RejectedValue`, which :class:`.CacheManager` counts and answers as a miss. Nothing
in a value is ever executed: the payload is copied into a fresh tensor of the expected dtype.
"""
from __future__ import annotations

import struct
import sys
from dataclasses import dataclass

import torch
import xxhash

MAGIC = b"DVKT"
FORMAT_VERSION = 1
MAX_NDIM = 8
_FIXED = struct.Struct("<4sHBBHQQ")  # magic, version, dtype, ndim, fingerprint length, payload length, checksum

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4, torch.int8: 5,
    torch.uint8: 6, torch.int16: 7, torch.int32: 8, torch.int64: 9, torch.bool: 10,
    torch.float8_e4m3fn: 11, torch.float8_e5m2: 12,
}
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class RejectedValue(ValueError):
    """A cached value that is not what the reader expects (and must be recomputed, not used)."""


@dataclass(frozen=True)
class TensorHeader:
    version: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    fingerprint: str
    nbytes: int
    checksum: int
    offset: int  # where the payload starts


def _check_host() -> None:
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        raise RuntimeError("the cache value format is little-endian; this host is not")


def encode_tensor(tensor: torch.Tensor, fingerprint: str) -> bytes:
    """Header + raw bytes of ``tensor`` (any device; copied to host memory)."""
    _check_host()
    if tensor.dtype not in DTYPE_CODES:
        raise TypeError(f"cannot cache tensors of dtype {tensor.dtype}")
    if tensor.dim() > MAX_NDIM:
        raise ValueError(f"cannot cache tensors of more than {MAX_NDIM} dims, got {tensor.dim()}")
    fp = fingerprint.encode()
    if len(fp) > 0xFFFF:
        raise ValueError("fingerprint longer than 65535 bytes")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    payload = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, DTYPE_CODES[tensor.dtype], tensor.dim(), len(fp),
                        len(payload), xxhash.xxh3_64_intdigest(payload))
    return b"".join((fixed, struct.pack(f"<{tensor.dim()}Q", *tensor.shape), fp, payload))


def read_header(data: bytes) -> TensorHeader:
    """The header of an encoded tensor; :class:`RejectedValue` if it is malformed or truncated."""
    if len(data) < _FIXED.size:
        raise RejectedValue(f"truncated: {len(data)} bytes, shorter than the {_FIXED.size}-byte header")
    magic, version, code, ndim, fp_len, nbytes, checksum = _FIXED.unpack_from(data, 0)
    if magic != MAGIC:
        raise RejectedValue(f"not an encoded tensor (magic {magic!r})")
    if version != FORMAT_VERSION:
        raise RejectedValue(f"format version {version}, this reader knows {FORMAT_VERSION}")
    if code not in _DTYPES or ndim > MAX_NDIM:
        raise RejectedValue(f"bad header (dtype code {code}, ndim {ndim})")
    offset = _FIXED.size + 8 * ndim + fp_len
    if len(data) < offset:
        raise RejectedValue("truncated inside the header")
    shape = struct.unpack_from(f"<{ndim}Q", data, _FIXED.size)
    try:
        fingerprint = bytes(data[_FIXED.size + 8 * ndim:offset]).decode()
    except UnicodeDecodeError as exc:
        raise RejectedValue("fingerprint is not UTF-8") from exc
    return TensorHeader(version, _DTYPES[code], tuple(shape), fingerprint, nbytes, checksum, offset)


def decode_tensor(data: bytes, *, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None,
                  fingerprint: str | None = None) -> torch.Tensor:
    """The tensor in ``data``, checked against the expected ``dtype``/``shape``/``fingerprint``
    (each ``None``: any); :class:`RejectedValue` on any mismatch, truncation or corruption."""
    _check_host()
    h = read_header(data)
    if fingerprint is not None and h.fingerprint != fingerprint:
        raise RejectedValue(f"fingerprint {h.fingerprint!r}, expected {fingerprint!r}")
    if dtype is not None and h.dtype != dtype:
        raise RejectedValue(f"dtype {h.dtype}, expected {dtype}")
    if shape is not None and h.shape != tuple(shape):
        raise RejectedValue(f"shape {h.shape}, expected {tuple(shape)}")
    numel = 1
    for d in h.shape:
        numel *= d
    itemsize = torch.empty((), dtype=h.dtype).element_size()
    if h.nbytes != numel * itemsize or len(data) - h.offset != h.nbytes:
        raise RejectedValue(f"payload is {len(data) - h.offset} bytes; header says {h.nbytes}, "
                            f"shape {h.shape} of {h.dtype} needs {numel * itemsize}")
    payload = memoryview(data)[h.offset:]
    if xxhash.xxh3_64_intdigest(payload) != h.checksum:
        raise RejectedValue("payload checksum mismatch")
    if numel == 0:
        return torch.empty(h.shape, dtype=h.dtype)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(h.dtype).reshape(h.shape)


class TensorCodec:
    """Encodes/decodes tensors of one expected dtype, shape and fingerprint (for :class:`.CacheManager`)."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], fingerprint: str) -> None:
        self.dtype, self.shape, self.fingerprint = dtype, tuple(int(d) for d in shape), fingerprint

    def encode(self, tensor: torch.Tensor) -> bytes:
        if tensor.dtype != self.dtype or tuple(tensor.shape) != self.shape:
            raise ValueError(f"expected a {self.dtype} tensor of shape {self.shape}, "
                             f"got {tensor.dtype} {tuple(tensor.shape)}")
        return encode_tensor(tensor, self.fingerprint)

    def decode(self, data: bytes) -> torch.Tensor:
        return decode_tensor(data, dtype=self.dtype, shape=self.shape, fingerprint=self.fingerprint)
