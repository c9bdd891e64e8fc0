"""Cache keys that cannot collide across models, KV layouts or value formats.

A KV block's key is ``kv:v<FORMAT_VERSION>:<model fingerprint>:<chained block hash, 32 hex digits>``.
The chained hash (runtime/prefix_cache.py: xxh3_128 over the parent hash and the block's token ids)
names the whole token prefix and is the same in every process; the fingerprint names everything
else the K/V depend on; the version names the value format. Two engines share a cached block only
when all three agree, and the value's own header (:mod:`.tensor_format`) repeats the fingerprint
and version, so a value stored under the wrong key is still rejected.
"""
from __future__ import annotations

import json
import re
from typing import Mapping

import torch
import xxhash

from .tensor_format import FORMAT_VERSION

_HEX128 = re.compile(r"[0-9a-f]{1,32}")


def model_fingerprint(*, weights_digest: str, dtype: torch.dtype | str, quantization: str | None,
                      kv_layout: str, block_size: int, **extra: object) -> str:
    """A 32-hex-digit digest of the facts a KV block depends on.

    ``weights_digest``: names the weights (e.g. :func:`state_dict_digest`, or a file hash);
    ``dtype``: the KV/compute dtype; ``quantization``: the scheme and its settings (``None``: off);
    ``kv_layout``: the per-block layout (e.g. :attr:`.KVBlockCodec.layout`); ``block_size``: tokens
    per block; ``extra``: any further fact (name=value; e.g. ``rope_scaling=...``). Every fact is
    part of the digest, so changing any of them changes every key.
    """
    if not weights_digest:
        raise ValueError("weights_digest must name the weights")
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    facts = {"weights": weights_digest, "dtype": str(dtype), "quantization": quantization or "none",
             "kv_layout": kv_layout, "block_size": block_size, **{k: str(v) for k, v in extra.items()}}
    return xxhash.xxh3_128_hexdigest(json.dumps(facts, sort_keys=True, separators=(",", ":")).encode())


def _hash_hex(chain_hash: int | bytes | str) -> str:
    if isinstance(chain_hash, bool):
        raise TypeError("chain_hash must be an int, bytes or a hex string")
    if isinstance(chain_hash, int):
        if not 0 <= chain_hash < 1 << 128:
            raise ValueError(f"chain_hash must be an unsigned 128-bit int, got {chain_hash}")
        return f"{chain_hash:032x}"
    if isinstance(chain_hash, bytes):
        if len(chain_hash) != 16:
            raise ValueError(f"chain_hash bytes must be 16 long, got {len(chain_hash)}")
        return int.from_bytes(chain_hash, "little").to_bytes(16, "big").hex()
    if isinstance(chain_hash, str) and _HEX128.fullmatch(chain_hash.lower()):
        return chain_hash.lower().rjust(32, "0")
    raise ValueError(f"chain_hash must be an int, 16 bytes or up to 32 hex digits, got {chain_hash!r}")


def kv_block_key(chain_hash: int | bytes | str, fingerprint: str) -> str:
    """The cache key of one KV block: format version + model fingerprint + chained block hash.

    ``chain_hash``: the block's chained hash as the unsigned 128-bit int of
    ``runtime.prefix_cache.block_hash``, its 16 little-endian bytes, or hex digits (all three of
    the same hash give the same key).
    """
    if not fingerprint or ":" in fingerprint:
        raise ValueError(f"fingerprint must be a non-empty string without ':', got {fingerprint!r}")
    return f"kv:v{FORMAT_VERSION}:{fingerprint}:{_hash_hex(chain_hash)}"


def state_dict_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """A 32-hex-digit digest of named tensors (names, dtypes, shapes and bytes; order-independent)."""
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def sampled_state_dict_digest(tensors: Mapping[str, torch.Tensor], *, max_tensors: int = 8,
                              max_elements: int = 1 << 16) -> str:
    """A cheap 32-hex-digit digest of named tensors: every name, dtype and shape, plus the bytes of
    up to ``max_tensors`` tensors spread over the sorted names, each read at ``max_elements``
    evenly strided elements (the whole tensor when smaller). Milliseconds for a large model, where
    :func:`state_dict_digest` reads every byte; it names a checkpoint, not an arbitrary edit of it."""
    h = xxhash.xxh3_128()
    names = sorted(tensors)
    for name in names:
        t = tensors[name]
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
    step = max(1, len(names) // max(1, max_tensors))
    for name in names[::step][:max_tensors]:
        flat = tensors[name].detach().reshape(-1)
        if flat.numel():
            stride = max(1, flat.numel() // max_elements)
            sample = flat[::stride][:max_elements].to("cpu").contiguous()
            h.update(name.encode())
            h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
