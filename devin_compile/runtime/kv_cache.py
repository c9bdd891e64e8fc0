"""Paged KV pool and its block allocator.

Layout: one tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``;
layer ``l``'s key cache is ``data[l, 0]`` and value cache ``data[l, 1]``, each
``[num_blocks, block_size, num_kv_heads, head_dim]`` (the paged layout FlashAttention's
``flash_attn_with_kvcache`` takes). A flat slot index is ``block * block_size + offset``.
With ``KVCacheSpec.planes == 1`` (multi-head latent attention) there is one plane per layer,
``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``: each token's compressed
latent and rotary key, and :meth:`PagedKVCache.layer` gives ``(latent_cache, None)``.

Invariants kept by :class:`BlockAllocator`: every block is either free or owned
(reference count >= 1); ``num_free + num_used == num_blocks``; freeing a block that
is not owned is an error. With a :class:`~devin_compile.runtime.prefix_cache.PrefixCache`,
a free block may still be *cached* (registered, content valid): it counts as free, can be
revived by a prefix hit, and is evicted, least recently used first, only once no uncached
free block is left.

KV pruning's compaction edits the pool only through methods here: ``BlockAllocator``'s
``release_tail`` / ``copy_on_write`` / ``unregister`` and ``PagedKVCache``'s
``gather_slots`` / ``scatter_slots`` / ``copy_block``.
"""
from __future__ import annotations

import math
import mmap
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence as Seq

import numpy as np
import torch

from .prefix_cache import CachedBlock, PrefixCache

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def host_view(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array of same-sized ints (numpy has no bfloat16).

    Block copies on the host go through numpy: a few hundred KB per block is under torch's
    parallel grain yet above it per op, and on a busy CPU each threaded copy waits for its
    OpenMP team (milliseconds); numpy copies in the calling thread."""
    return t.view(_SAME_SIZE_INT[t.element_size()]).numpy()


class KVCacheExhaustedError(RuntimeError):
    """The paged pool has no free block for a request."""


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    planes: int = 2  # 2: key and value caches; 1: one latent cache (MLA)

    @property
    def bytes_per_token(self) -> int:
        return self.planes * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

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
        shape = (spec.num_layers, spec.planes, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.data = _zeros(shape, spec.dtype, self.device)
        self._layers = [(self.data[i, 0], self.data[i, 1] if spec.planes > 1 else None)
                        for i in range(spec.num_layers)]

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) of one layer, each [num_blocks, block_size, Hkv, D]."""
        return self._layers[index]

    # -- slot moves (KV pruning's compaction) ---------------------------------
    def slot_ids(self, block_table: list[int], offsets: torch.Tensor) -> torch.Tensor:
        """Flat slot index (``block * block_size + offset``) of each of a sequence's slot ``offsets``."""
        bs = self.block_size
        table = torch.tensor(block_table, dtype=torch.long, device=self.device)
        return table[offsets // bs] * bs + offsets % bs

    def gather_slots(self, layers: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """K and V of slot ``slots[i]`` in layer ``layers[i]``: [N, 2, Hkv, D] (a copy)."""
        return self._flat()[layers, :, slots]

    def scatter_slots(self, layers: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` (from :meth:`gather_slots`) to slot ``slots[i]`` of layer ``layers[i]``."""
        self._flat()[layers, :, slots] = values

    def copy_block(self, src: int, dst: int) -> None:
        """Block ``dst`` gets block ``src``'s K/V in every layer."""
        self.data[:, :, dst] = self.data[:, :, src]

    def _flat(self) -> torch.Tensor:
        d = self.data
        return d.view(d.shape[0], d.shape[1], -1, *d.shape[4:])  # [layers, planes, blocks * block_size, Hkv, D]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool. On CPU it lives in an anonymous mmap, which the kernel hands out
    zero-filled page by page on first touch: ``torch.zeros`` would memset the whole pool up
    front (~1.7 s per GB here) and make every page resident whether or not it is ever used.
    Zeros matter: kernels read padded slots (masked to weight 0), and 0 x NaN garbage is NaN."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes)  # the tensor keeps the mapping alive
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


class BlockAllocator:
    """Free list with reference counts; O(1) allocate, free and revive.

    The free list is one ordered dict of block ids: uncached free blocks at the front,
    cached free blocks behind them in the order they were freed (least recently used
    first). :meth:`allocate` pops from the front, so it takes uncached blocks first and
    then evicts the least recently used cached block (dropping its index entry); it first
    tries the block right after the sequence's last one, when that is free and uncached.
    ``on_evict`` (the KV tiers' ``publish``) gets the entries one :meth:`allocate` evicted,
    before it returns, while the blocks still hold their content.
    """

    def __init__(self, num_blocks: int, prefix_cache: PrefixCache | None = None,
                 on_evict: Callable[[list[CachedBlock]], None] | None = None) -> None:
        self.num_blocks = num_blocks
        self.prefix_cache = prefix_cache
        self.on_evict = on_evict
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.ref_count = [0] * num_blocks
        self._cached_free = 0
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        """Blocks with no owner, cached ones included (they are reusable)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks whose content is still registered in the prefix cache (evictable)."""
        return self._cached_free

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """``n`` blocks, each the one right after the previous (``after`` first: the
        sequence's last block) when that one is free and uncached, else the front of the
        free list. Consecutive blocks let CPU decode read a sequence as one view, no gather."""
        if n > len(self._free):
            raise KVCacheExhaustedError(
                f"KV cache exhausted: need {n} more blocks, {len(self._free)} of {self.num_blocks} free. "
                "Raise kv_cache_memory / num_kv_blocks, or lower max_num_seqs / max_new_tokens."
            )
        out = []
        evicted: list[CachedBlock] = []
        for _ in range(n):
            b = self._take_next(after)
            if b is None:
                b, _ = self._free.popitem(last=False)
                if self._cached_free and b in self.prefix_cache:  # no uncached block left: evict the LRU one
                    evicted.append(self.prefix_cache.entry_of(b))
                    self.prefix_cache.evict(b)
                    self._cached_free -= 1
            self.ref_count[b] = 1
            out.append(b)
            after = b
        self._note_used()
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return out

    def _take_next(self, after: int | None) -> int | None:
        b = None if after is None else after + 1
        if b is None or b >= self.num_blocks or b not in self._free:
            return None
        if self.prefix_cache is not None and b in self.prefix_cache:
            return None  # keep cached content for prefix hits
        del self._free[b]
        return b

    def acquire(self, block: int) -> None:
        """One more owner for ``block``: a prefix hit (or a duplicate folded onto it); revives a free one."""
        if self.ref_count[block] == 0:
            if self.prefix_cache is None or block not in self.prefix_cache:
                raise RuntimeError(f"block {block} is free and not cached: nothing to share")
            del self._free[block]
            self._cached_free -= 1
            self._note_used()
        self.ref_count[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; a block table is freed tail first, so a cached
        chain's head stays cached longer than its tail (it is the part others share)."""
        cache = self.prefix_cache
        for b in reversed(list(blocks)):
            if self.ref_count[b] <= 0:
                raise RuntimeError(f"block {b} freed while not owned (double free)")
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self._free[b] = None
                if cache is not None and b in cache:
                    self._cached_free += 1  # most recently used end
                else:
                    self._free.move_to_end(b, last=False)  # reused first

    def is_free(self, block: int) -> bool:
        return self.ref_count[block] == 0

    def is_shared(self, block: int) -> bool:
        """More than one owner: the block must not be written (copy it first)."""
        return self.ref_count[block] > 1

    def is_registered(self, block: int) -> bool:
        """Registered in the prefix cache (its content is what its hash names)."""
        return self.prefix_cache is not None and block in self.prefix_cache

    def num_freed_by(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` one :meth:`free` would return to the pool (those with no other owner)."""
        return sum(1 for b in blocks if self.ref_count[b] == 1)

    def release_tail(self, blocks: Seq[int]) -> int:
        """Drop one reference to each of a block table's trailing ``blocks``; returns how many became free."""
        freed = self.num_freed_by(blocks)
        self.free(blocks)
        return freed

    def copy_on_write(self, block: int, kv_cache: "PagedKVCache") -> int:
        """A private copy of ``block`` for the owner about to write it: a fresh block with the same
        K/V; the owner's reference to ``block`` is dropped (its other owners, or the prefix cache,
        keep it). ``KVCacheExhaustedError`` when no block is free."""
        (copy,) = self.allocate(1)
        kv_cache.copy_block(block, copy)
        self.free([block])
        return copy

    def unregister(self, block: int) -> None:
        """Drop an owned ``block``'s prefix-cache entry: its owner is about to change its content."""
        if self.ref_count[block] == 0:
            raise RuntimeError(f"block {block} is free: only an owned block can be unregistered")
        self.prefix_cache.evict(block)

    def evict_cached(self) -> int:
        """Drop every cached free block from the prefix cache (e.g. between benchmark runs)."""
        if self.prefix_cache is None:
            return 0
        dropped = [b for b in self._free if b in self.prefix_cache]
        for b in dropped:
            self.prefix_cache.evict(b)
            self._free.move_to_end(b, last=False)
        self._cached_free = 0
        return len(dropped)

    def check_writable(self, block: int) -> None:
        """Assert that ``block`` may be written: one owner and not a registered (shared) block."""
        registered = self.is_registered(block)
        if self.ref_count[block] != 1 or registered:
            where = ", registered in the prefix cache" if registered else ""
            raise AssertionError(f"a step writes block {block} (ref_count {self.ref_count[block]}{where})")

    def _note_used(self) -> None:
        used = self.num_blocks - len(self._free)
        if used > self.peak_used:
            self.peak_used = used
