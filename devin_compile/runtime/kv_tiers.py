"""Prefix KV blocks that outlive the paged pool: tiers below it (host memory, then Redis).

- **Write-through.** When the prefix cache registers a full block (:meth:`KVTiers.register`), the
  tiers with ``write_through`` (Redis by default) get it at once, through a bounded queue and a
  background thread (:mod:`.kv_write_through`): another replica can load a prefix as soon as this one
  has computed it, while this one still holds it. The step pays one copy of the block; a full queue
  drops blocks rather than slow it down.
- **Publish on eviction.** When the pool evicts a registered prefix block to reuse it
  (:class:`~devin_compile.runtime.kv_cache.BlockAllocator` calls :meth:`KVTiers.publish` with the
  blocks of one allocation, while their content is still there), its K/V of every layer are
  encoded with :class:`~devin_compile.cache.KVBlockCodec` and stored under
  ``kv_block_key(chain hash, model fingerprint)`` in the first tier not written through (the host
  tier); a host tier that evicts passes the block down, except into a write-through tier (which has
  it already). A block the write-through tiers never got (dropped, or a failed store) is queued for
  them again. Blocks registered by a KV-pruning sequence are never published.
- **Load.** On admission, after the pool's own prefix match, the scheduler asks :meth:`lookup`
  for the next blocks of the chain: each is looked up tier by tier (a hit in a lower tier is
  promoted into the tiers above), and the walk stops at the first block no tier has. The found
  blocks are written into freshly allocated pool blocks (:meth:`write`; on an accelerator in one
  transfer); they are not written through again.
- **Checks.** A value whose header does not match (another fingerprint, dtype, shape or format
  version, truncated or corrupted) is counted as ``rejected`` for its tier, dropped from it, and
  the walk stops there: the block is recomputed, never attended over.
- **Faults.** The cache backends never raise on a store fault: Redis down, slow or restarted
  answers misses and drops sets (counted in the tier's ``errors``), and requests compute what they
  cannot load.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence as Seq

import numpy as np
import torch

from ..cache import KVBlockCodec, RejectedValue, TieredCache, kv_block_key, model_fingerprint
from ..cache.config import TierConfig, build_backends
from .kv_cache import PagedKVCache, host_view
from .kv_write_through import DEFAULT_MAX_BYTES, WriteThrough
from .prefix_cache import CachedBlock


@dataclass
class TierCounters:
    """What the runtime saw of one tier: gets answered (decoded) or not, values rejected, time."""

    hits: int = 0
    misses: int = 0
    rejected: int = 0
    loaded_bytes: int = 0
    load_s: float = 0.0


class KVTiers:
    """Tiers of :mod:`devin_compile.cache` backends under one paged pool, for one model fingerprint."""

    def __init__(self, tiers: Seq[TierConfig], pool: PagedKVCache, fingerprint: str, *,
                 write_queue_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if not tiers:
            raise ValueError("KVTiers needs at least one tier")
        self.configs = tuple(tiers)
        self.pool = pool
        self.fingerprint = fingerprint
        self.codec = KVBlockCodec.from_spec(pool.spec, fingerprint)
        backends = build_backends(self.configs)
        self.chain = TieredCache(backends)  # each tier's on_evict is the next tier's set
        self.tiers = self.chain.tiers
        through = [t for t, c in zip(self.tiers, self.configs) if c.write_through]
        for i, lower in enumerate(self.configs[1:]):
            if lower.write_through:  # it has every registered block already
                self.tiers[i].on_evict = None
        # evicted blocks go to the first tier that is not written through (None: every tier is)
        self.evict_into = next((t for t, c in zip(self.tiers, self.configs) if not c.write_through), None)
        self.writer = WriteThrough(through, pool, self.codec, self.key, max_bytes=write_queue_bytes) if through else None
        self.counters = [TierCounters() for _ in self.tiers]
        self.published = 0
        self.published_bytes = 0
        self.skipped_pruned = 0
        self.publish_s = 0.0
        self.loaded_blocks = 0
        self.write_s = 0.0

    @classmethod
    def for_model(cls, tiers: Seq[TierConfig], pool: PagedKVCache, *, weights_digest: str,
                  quantization: str | None = None, write_queue_bytes: int = DEFAULT_MAX_BYTES,
                  **facts: object) -> "KVTiers":
        """Tiers keyed by a fingerprint of the model's weights, dtype, quantization, KV layout and
        block size (and any further ``facts``, e.g. the model config)."""
        layout = KVBlockCodec.from_spec(pool.spec, "layout").layout
        fp = model_fingerprint(weights_digest=weights_digest, dtype=pool.spec.dtype, quantization=quantization,
                               kv_layout=layout, block_size=pool.block_size, kv_pruning="never published", **facts)
        return cls(tiers, pool, fp, write_queue_bytes=write_queue_bytes)

    def key(self, chain_hash: int) -> str:
        return kv_block_key(chain_hash, self.fingerprint)

    # -- publish: blocks registered (write-through) and blocks the pool evicts -----------------
    def register(self, entries: Seq[CachedBlock]) -> None:
        """Blocks the prefix cache just registered: queue them for the write-through tiers."""
        if self.writer is not None:
            self.writer.submit([e for e in entries if e.publish])

    def publish(self, entries: Seq[CachedBlock]) -> None:
        """Store the K/V of registered blocks the pool is about to reuse (their content is still there)
        into the first tier not written through; queue for the write-through tiers any block they
        never got (dropped when the queue was full, or a failed store)."""
        keep = [e for e in entries if e.publish]
        self.skipped_pruned += len(entries) - len(keep)
        if self.writer is not None:
            self.writer.submit(keep)  # blocks it already queued or stored are skipped
        if not keep or self.evict_into is None:
            return
        t0 = time.perf_counter()
        data = self.pool.data
        if data.device.type == "cpu":  # numpy copies block by block (see host_view)
            pool = host_view(data)
            blocks = [torch.from_numpy(np.ascontiguousarray(pool[:, :, e.block])).view(data.dtype) for e in keep]
        else:  # one gather and one transfer to host memory
            idx = torch.tensor([e.block for e in keep], dtype=torch.long, device=data.device)
            blocks = list(data.index_select(2, idx).to("cpu").unbind(2))
        for e, block in zip(keep, blocks):
            value = self.codec.encode(block)
            self.evict_into.set(self.key(e.hash), value)
            self.published += 1
            self.published_bytes += len(value)
        self.publish_s += time.perf_counter() - t0

    # -- load: a new request continues its chain from the tiers ------------------------------
    def lookup(self, hashes: Seq[int]) -> list[torch.Tensor]:
        """K/V of the longest run of ``hashes`` (consecutive chain blocks) that the tiers hold."""
        out: list[torch.Tensor] = []
        for h in hashes:
            block = self._get(self.key(h))
            if block is None:
                break
            out.append(block)
        return out

    def _get(self, key: str) -> torch.Tensor | None:
        for i, tier in enumerate(self.tiers):
            c = self.counters[i]
            t0 = time.perf_counter()
            value = tier.get(key)
            if value is None:
                c.misses += 1
                c.load_s += time.perf_counter() - t0
                continue
            try:
                block = self.codec.decode(value)
            except RejectedValue:
                c.rejected += 1
                c.load_s += time.perf_counter() - t0
                tier.invalidate(key)
                return None  # recomputed, never attended over
            c.hits += 1
            c.loaded_bytes += len(value)
            c.load_s += time.perf_counter() - t0
            if self.writer is not None:
                self.writer.remember(key)  # a tier has it: loading it is not a reason to publish it
            for upper in self.tiers[:i]:  # promote: the next lookup is served by the fastest tier
                upper.set(key, value)
            return block
        return None

    def write(self, blocks: Seq[int], values: Seq[torch.Tensor]) -> None:
        """Copy looked-up K/V into pool ``blocks`` (freshly allocated, owned by the caller)."""
        if not blocks:
            return
        t0 = time.perf_counter()
        data = self.pool.data
        if data.device.type == "cpu":  # numpy copies block by block (see host_view)
            pool = host_view(data)
            for b, value in zip(blocks, values):
                pool[:, :, b] = host_view(value)
        else:  # one transfer to the device and one scatter
            stacked = torch.stack(list(values), dim=2).pin_memory().to(data.device, non_blocking=True)
            data.index_copy_(2, torch.tensor(list(blocks), dtype=torch.long, device=data.device), stacked)
        self.loaded_blocks += len(blocks)
        self.write_s += time.perf_counter() - t0

    # -- reporting, flush, close ----------------------------------------------------------------
    def stats(self) -> dict:
        """Per tier: the runtime's hits/misses/rejected/load ms and the backend's bytes/entries/
        evictions/errors; totals for loading and publishing (``kv_tier_published_*``: blocks stored
        on eviction plus blocks written through; ``kv_tier_publish_ms``: the stepping thread's time,
        eviction stores and write-through copies) and the write-through queue's counters."""
        per_tier = []
        for cfg, tier, c in zip(self.configs, self.tiers, self.counters):
            s = tier.stats()
            per_tier.append({
                "backend": cfg.backend, "write_through": cfg.write_through, "hits": c.hits, "misses": c.misses,
                "rejected": c.rejected, "load_ms": c.load_s * 1e3, "loaded_bytes": c.loaded_bytes, "bytes": s.bytes,
                "max_bytes": getattr(tier, "max_bytes", None), "entries": s.entries, "sets": s.sets,
                "evictions": s.evictions, "expirations": s.expirations, "errors": s.errors,
            })
        bs, w = self.pool.block_size, self.writer
        stats = {
            "kv_tiers": per_tier,
            "kv_tier_hits": sum(c.hits for c in self.counters),
            "kv_tier_rejected": sum(c.rejected for c in self.counters),
            "kv_tier_loaded_blocks": self.loaded_blocks, "kv_tier_loaded_tokens": self.loaded_blocks * bs,
            "kv_tier_load_ms": (sum(c.load_s for c in self.counters) + self.write_s) * 1e3,
            "kv_tier_published_blocks": self.published + (w.published if w else 0),
            "kv_tier_published_bytes": self.published_bytes + (w.published_bytes if w else 0),
            "kv_tier_publish_ms": (self.publish_s + (w.stage_s if w else 0.0)) * 1e3,
            "kv_tier_skipped_pruned": self.skipped_pruned,
        }
        if w is not None:
            stats.update(w.stats())
        return stats

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until the write-through queue is empty; False if ``timeout_s`` ran out first."""
        return self.writer is None or self.writer.flush(timeout_s)

    def clear(self) -> None:
        """Drop every block from every tier (Redis: only keys under this tier's prefix)."""
        if self.writer is not None:
            self.writer.flush(10.0)
            self.writer.forget()
        self.chain.clear()

    def drain(self, timeout_s: float = 10.0) -> None:
        """Store what the write-through queue holds (at most ``timeout_s``; the rest is discarded) and
        stop its thread; the tiers stay usable (the next registered block starts it again)."""
        if self.writer is not None:
            self.writer.close(timeout_s=timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """:meth:`drain`, then close the backends (their connections); the tiers are not used after."""
        self.drain(timeout_s)
        self.chain.close()
