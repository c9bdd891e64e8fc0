"""RankTiers: the KV tiers of a tensor-parallel engine hold whole blocks (every KV head).

Each rank's pool holds only its KV heads, but the tiers below rank 0's scheduler store a block as one
process would: all heads, keyed and encoded exactly as with ``tensor_parallel=1`` (the same
:class:`~.kv_tiers.KVTiers` fingerprint), so replicas of any tensor-parallel size share a Redis tier.

- storing (eviction, write-through): rank 0 tells the ranks to send it those blocks
  (:meth:`~.distributed.RankGroup.gather_blocks`), puts each rank's heads in place in a small staging
  pool of whole blocks, and hands the staged blocks to the inner :class:`KVTiers`;
- loading: the inner tiers write the found blocks into the staging pool; rank 0 sends every rank
  its heads of them (:meth:`~.distributed.RankGroup.scatter_blocks`) into the pool blocks the
  scheduler allocated;
- a KV head that several ranks keep (replication) is taken from the first; every rank gets its copy.

Each exchange holds the group's lock (no heartbeat between its messages); at most ``staging_blocks``
blocks move at once. Lookups, stats, flush and close are the inner tiers'.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence as Seq

import torch

from ..capture import ModelInfo
from .distributed import RankGroup
from .kv_cache import KVCacheSpec, PagedKVCache
from .kv_tiers import KVTiers
from .prefix_cache import CachedBlock


class RankTiers:
    def __init__(self, inner_for: Callable[[PagedKVCache], KVTiers], pool: PagedKVCache, full: PagedKVCache,
                 group: RankGroup, kv_heads: Seq[range]) -> None:
        """``inner_for(staging pool)``: the KVTiers over whole blocks; ``pool``: rank 0's own pool;
        ``full``: the staging pool (every KV head); ``kv_heads``: each rank's KV heads (global indices)."""
        self.pool = pool
        self.staging = full
        self.group = group
        self.kv_heads = list(kv_heads)
        self.inner = inner_for(full)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def register(self, entries: Seq[CachedBlock]) -> None:
        if self.inner.writer is not None:  # only write-through tiers take blocks as they are registered
            self._staged([e for e in entries if e.publish], self.inner.register)

    def publish(self, entries: Seq[CachedBlock]) -> None:
        keep = [e for e in entries if e.publish]
        self.inner.skipped_pruned += len(entries) - len(keep)
        self._staged(keep, self.inner.publish)

    def lookup(self, hashes: Seq[int]) -> list[torch.Tensor]:
        return self.inner.lookup(hashes)

    def write(self, blocks: Seq[int], values: Seq[torch.Tensor]) -> None:
        """The looked-up whole blocks ``values`` into pool ``blocks`` of every rank (its heads)."""
        n = self.staging.num_blocks
        for i in range(0, len(blocks), n):
            chunk = list(blocks[i:i + n])
            self.inner.write(list(range(len(chunk))), values[i:i + n])
            staged = self.staging.data[:, :, :len(chunk)].to("cpu")
            parts = [staged[:, :, :, :, h.start:h.stop].contiguous() for h in self.kv_heads]
            with self.group.lock:
                self.group.broadcast(("kv_scatter", chunk))
                self.group.scatter_blocks(self.pool, chunk, parts)

    def _staged(self, entries: list[CachedBlock], store: Callable[[list[CachedBlock]], None]) -> None:
        """``store`` the whole-block K/V of ``entries``, gathered from every rank into the staging pool."""
        n = self.staging.num_blocks
        for i in range(0, len(entries), n):
            chunk = entries[i:i + n]
            blocks = [e.block for e in chunk]
            with self.group.lock:
                self.group.broadcast(("kv_gather", blocks))
                parts = self.group.gather_blocks(self.pool, blocks)
            data = self.staging.data
            for heads, part in zip(self.kv_heads, parts):
                data[:, :, :len(chunk), :, heads.start:heads.stop] = part.to(data.device)
            store([dataclasses.replace(e, block=j) for j, e in enumerate(chunk)])


def rank_tiers_for(group: RankGroup, info: ModelInfo, staging_blocks: int = 16):
    """``build_engine``'s ``kv_tiers_for`` under tensor parallelism (``info``: the whole model's): rank 0's
    tiers are a :class:`RankTiers`; the other ranks have none (rank 0 moves their blocks)."""
    from .build import kv_tiers_over

    def build(config, pool: PagedKVCache, identity) -> RankTiers | None:
        if group.rank != 0 or not config.kv_cache_tiers:
            return None
        spec = KVCacheSpec(info.num_layers, dtype=info.dtype, block_size=config.cache.block_size,
                           **info.kv_cache_layout)
        heads = [dataclasses.replace(group.spec, rank=r).heads(info.num_heads, info.num_kv_heads).kv
                 for r in range(group.world_size)]
        return RankTiers(lambda full: kv_tiers_over(config, full, identity), pool,
                         PagedKVCache(spec, staging_blocks, pool.device), group, heads)

    return build
