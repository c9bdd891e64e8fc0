"""Prefix KV blocks that outlive the paged pool: tiers below it (host memory, then Redis).

- **Publish.** When the pool evicts a registered prefix block to reuse it
  (:class:`~devin_compile.runtime.kv_cache.BlockAllocator` calls :meth:`KVTiers.publish` with the
  blocks of one allocation, while their content is still there), its K/V of every layer are
  encoded with :class:`~devin_compile.cache.KVBlockCodec` and stored under
  ``kv_block_key(chain hash, model fingerprint)`` in the first tier; a host tier that evicts passes
  the block down. A Redis tier with ``write_through`` also gets every published block at once (so
  other replicas can load it), and the tier above it then drops its evictions instead of sending
  them twice. Blocks registered by a KV-pruning sequence are never published.
- **Load.** On admission, after the pool's own prefix match, the scheduler asks :meth:`lookup`
  for the next blocks of the chain: each is looked up tier by tier (a hit in a lower tier is
  promoted into the tiers above), and the walk stops at the first block no tier has. The found
  blocks are written into freshly allocated pool blocks (:meth:`write`; on an accelerator in one
  transfer).
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
from ..cache.config import RedisTier, TierConfig, build_backends
from .kv_cache import PagedKVCache
from .prefix_cache import CachedBlock


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _host_view(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array of same-sized ints (numpy has no bfloat16).

    Block copies on the host go through numpy: a few hundred KB per block is under torch's
    parallel grain yet above it per op, and on a busy CPU each threaded copy waits for its
    OpenMP team (milliseconds); numpy copies in the calling thread."""
    return t.view(_SAME_SIZE_INT[t.element_size()]).numpy()


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

    def __init__(self, tiers: Seq[TierConfig], pool: PagedKVCache, fingerprint: str) -> None:
        if not tiers:
            raise ValueError("KVTiers needs at least one tier")
        self.configs = tuple(tiers)
        self.pool = pool
        self.fingerprint = fingerprint
        self.codec = KVBlockCodec.from_spec(pool.spec, fingerprint)
        backends = build_backends(self.configs)
        self.chain = TieredCache(backends)  # each tier's on_evict is the next tier's set
        self.tiers = self.chain.tiers
        last = self.configs[-1]
        self.shared = self.tiers[-1] if isinstance(last, RedisTier) and last.write_through and len(backends) > 1 else None
        if self.shared is not None:
            self.tiers[-2].on_evict = None  # Redis already has every published block
        self.counters = [TierCounters() for _ in self.tiers]
        self.published = 0
        self.published_bytes = 0
        self.skipped_pruned = 0
        self.publish_s = 0.0
        self.loaded_blocks = 0
        self.write_s = 0.0

    @classmethod
    def for_model(cls, tiers: Seq[TierConfig], pool: PagedKVCache, *, weights_digest: str,
                  quantization: str | None = None, **facts: object) -> "KVTiers":
        """Tiers keyed by a fingerprint of the model's weights, dtype, quantization, KV layout and
        block size (and any further ``facts``, e.g. the model config)."""
        layout = KVBlockCodec.from_spec(pool.spec, "layout").layout
        fp = model_fingerprint(weights_digest=weights_digest, dtype=pool.spec.dtype, quantization=quantization,
                               kv_layout=layout, block_size=pool.block_size, kv_pruning="never published", **facts)
        return cls(tiers, pool, fp)

    def key(self, chain_hash: int) -> str:
        return kv_block_key(chain_hash, self.fingerprint)

    # -- publish: the pool evicts registered blocks -------------------------------------------
    def publish(self, entries: Seq[CachedBlock]) -> None:
        """Store the K/V of registered blocks the pool is about to reuse (their content is still there)."""
        keep = [e for e in entries if e.publish]
        self.skipped_pruned += len(entries) - len(keep)
        if not keep:
            return
        t0 = time.perf_counter()
        data = self.pool.data
        if data.device.type == "cpu":  # numpy copies block by block (see _host_view)
            pool = _host_view(data)
            blocks = [torch.from_numpy(np.ascontiguousarray(pool[:, :, e.block])).view(data.dtype) for e in keep]
        else:  # one gather and one transfer to host memory
            idx = torch.tensor([e.block for e in keep], dtype=torch.long, device=data.device)
            blocks = list(data.index_select(2, idx).to("cpu").unbind(2))
        for e, block in zip(keep, blocks):
            value = self.codec.encode(block)
            key = self.key(e.hash)
            self.chain.set(key, value)
            if self.shared is not None:
                self.shared.set(key, value)
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
        if data.device.type == "cpu":  # numpy copies block by block (see _host_view)
            pool = _host_view(data)
            for b, value in zip(blocks, values):
                pool[:, :, b] = _host_view(value)
        else:  # one transfer to the device and one scatter
            stacked = torch.stack(list(values), dim=2).pin_memory().to(data.device, non_blocking=True)
            data.index_copy_(2, torch.tensor(list(blocks), dtype=torch.long, device=data.device), stacked)
        self.loaded_blocks += len(blocks)
        self.write_s += time.perf_counter() - t0

    # -- reporting -----------------------------------------------------------------------------
    def stats(self) -> dict:
        """Per tier: the runtime's hits/misses/rejected/load ms and the backend's bytes/entries/
        evictions/errors; totals for publishing (pool evictions stored) and loading."""
        per_tier = []
        for cfg, tier, c in zip(self.configs, self.tiers, self.counters):
            s = tier.stats()
            per_tier.append({
                "backend": cfg.backend, "hits": c.hits, "misses": c.misses, "rejected": c.rejected,
                "load_ms": c.load_s * 1e3, "loaded_bytes": c.loaded_bytes, "bytes": s.bytes,
                "max_bytes": getattr(tier, "max_bytes", None), "entries": s.entries, "sets": s.sets,
                "evictions": s.evictions, "expirations": s.expirations, "errors": s.errors,
            })
        bs = self.pool.block_size
        return {
            "kv_tiers": per_tier,
            "kv_tier_hits": sum(c.hits for c in self.counters),
            "kv_tier_rejected": sum(c.rejected for c in self.counters),
            "kv_tier_loaded_blocks": self.loaded_blocks, "kv_tier_loaded_tokens": self.loaded_blocks * bs,
            "kv_tier_load_ms": (sum(c.load_s for c in self.counters) + self.write_s) * 1e3,
            "kv_tier_published_blocks": self.published, "kv_tier_published_bytes": self.published_bytes,
            "kv_tier_publish_ms": self.publish_s * 1e3, "kv_tier_skipped_pruned": self.skipped_pruned,
        }

    def clear(self) -> None:
        """Drop every block from every tier (Redis: only keys under this tier's prefix)."""
        self.chain.clear()

    def close(self) -> None:
        self.chain.close()

