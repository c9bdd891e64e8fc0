"""Paged KV pool and its block allocator.

Layout: one tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``;
layer ``l``'s key cache is ``data[l, 0]`` and value cache ``data[l, 1]``, each
``[num_blocks, block_size, num_kv_heads, head_dim]`` (the paged layout FlashAttention's
``flash_attn_with_kvcache`` takes). A flat slot index is ``block * block_size + offset``.

Invariants kept by :class:`BlockAllocator`: every block is either free or owned
(reference count >= 1); ``num_free + num_used == num_blocks``; freeing a block that
is not owned is an error.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch


class KVCacheExhaustedError(RuntimeError):
    """The paged pool has no free block for a request."""


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


def available_memory(device: torch.device) -> int:
    """Free bytes on ``device`` (CUDA: driver free memory; CPU: MemAvailable)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def blocks_for_budget(spec: KVCacheSpec, device: torch.device, *, num_blocks: int | None,
                      memory_bytes: int | None, memory_fraction: float) -> int:
    """How many blocks the pool gets: explicit count, else a byte budget, else a fraction of free memory."""
    if num_blocks is not None:
        return num_blocks
    budget = memory_bytes if memory_bytes is not None else int(available_memory(device) * memory_fraction)
    n = budget // spec.bytes_per_block
    if n < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes is smaller than one block ({spec.bytes_per_block} bytes); "
            "raise kv_cache_memory / kv_cache_fraction or lower block_size"
        )
    return int(n)


class PagedKVCache:
    """The pool tensors for all layers."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.data = torch.zeros(
            (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim),
            dtype=spec.dtype, device=self.device,
        )
        self._layers = [(self.data[i, 0], self.data[i, 1]) for i in range(spec.num_layers)]

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) of one layer, each [num_blocks, block_size, Hkv, D]."""
        return self._layers[index]


class BlockAllocator:
    """Free list with reference counts; O(1) allocate and free."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.ref_count = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVCacheExhaustedError(
                f"KV cache exhausted: need {n} more blocks, {len(self._free)} of {self.num_blocks} free. "
                "Raise kv_cache_memory / num_kv_blocks, or lower max_num_seqs / max_new_tokens."
            )
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self.ref_count[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_count[b] <= 0:
                raise RuntimeError(f"block {b} freed while not owned (double free)")
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self._free.append(b)
