"""The paged KV pool's settings: block size and how much memory the pool may take."""
from __future__ import annotations

from dataclasses import dataclass

from ..validation import flag, fraction, is_int, positive_int


@dataclass
class CacheConfig:
    """Paged KV pool: block size and how much memory the pool may take.

    ``num_blocks`` wins over ``memory_bytes`` which wins over ``memory_fraction``
    (a fraction of free device memory; on CPU, of available RAM).
    ``enable_prefix_caching`` shares full KV blocks between requests with a common prefix.
    """

    block_size: int = 16
    num_blocks: int | None = None
    memory_bytes: int | None = None
    memory_fraction: float = 0.05
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not is_int(self.block_size) or self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size!r} must be a positive power of two (e.g. 16)")
        positive_int("num_blocks", self.num_blocks, optional=True)
        positive_int("kv_cache_memory", self.memory_bytes, optional=True, hint="bytes")
        fraction("kv_cache_fraction", self.memory_fraction, 0.0, 0.95)
        flag("enable_prefix_caching", self.enable_prefix_caching)
