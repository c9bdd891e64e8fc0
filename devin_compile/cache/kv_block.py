"""One paged-KV block (K and V of every layer, or MLA's one latent plane) as a cache value.

The paged pool stores ``data[num_layers, planes, num_blocks, block_size, num_kv_heads, head_dim]``
(runtime/kv_cache.py; ``planes`` is 2 for K and V, 1 for a multi-head-latent cache), so block
``b`` of every layer is ``data[:, :, b]``, a tensor of shape
``(num_layers, planes, block_size, num_kv_heads, head_dim)``. :class:`KVBlockCodec` encodes exactly
that tensor with the :mod:`.tensor_format` header (dtype, shape, model fingerprint, version) and
decodes only values with that same header; anything else is a :class:`.RejectedValue`, so a
block from another model, dtype or layout is recomputed, never attended over.

Loading back: ``data[:, :, b].copy_(codec.decode(value))`` (non-blocking from pinned memory is the
caller's choice).
"""
from __future__ import annotations

import torch

from .tensor_format import TensorCodec


class KVBlockCodec(TensorCodec):
    """Encodes/decodes one KV block of all layers, for one model fingerprint and KV layout."""

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, fingerprint: str, planes: int = 2) -> None:
        dims = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                    planes=planes)
        for name, value in dims.items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        super().__init__(dtype, (num_layers, planes, block_size, num_kv_heads, head_dim), fingerprint)
        self.num_layers, self.num_kv_heads, self.head_dim, self.block_size = num_layers, num_kv_heads, head_dim, block_size
        self.planes = planes

    @classmethod
    def from_spec(cls, spec: object, fingerprint: str) -> "KVBlockCodec":
        """From anything with ``num_layers``, ``num_kv_heads``, ``head_dim``, ``block_size``,
        ``dtype`` and optionally ``planes`` (the runtime's ``KVCacheSpec``)."""
        return cls(num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                   block_size=spec.block_size, dtype=spec.dtype, fingerprint=fingerprint,
                   planes=getattr(spec, "planes", 2))

    @property
    def layout(self) -> str:
        """The per-block layout as a string, for :func:`.model_fingerprint`'s ``kv_layout``."""
        return (f"paged[layer,plane,token,head,dim]:P{self.planes}:L{self.num_layers}:B{self.block_size}:"
                f"H{self.num_kv_heads}:D{self.head_dim}:{self.dtype}")

    @property
    def nbytes(self) -> int:
        """Payload bytes of one block (the encoded value adds a header of well under 200 bytes)."""
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n
