"""Automatic prefix caching: a content-addressed index of full, computed KV blocks.

A block of ``block_size`` tokens whose K/V are all computed is *full*. Full blocks are
registered here under a chained hash, so a later request whose prompt starts with the
same tokens reuses them (reference count + 1) instead of recomputing them. Only full
blocks are ever registered or matched, and a sequence only appends into its last,
non-full block, so a shared block is never written.

Hash (stable: the same in every process and on every machine; no Python ``hash()``)::

    h[-1] = 0
    h[j]  = xxh3_128(encode(h[j-1], tokens[j * B:(j + 1) * B]))      (seed 0, as an unsigned 128-bit int)
    encode(parent, block) = parent as 16 bytes, unsigned little-endian
                            ++ each token id as 4 bytes, unsigned little-endian (uint32)

Every field has a fixed width, so the encoding is unambiguous. ``h[j]`` names the whole
prefix ``tokens[:(j + 1) * B]``, so it can key a shared (cross-process) cache later; such
a cache must also namespace keys by everything else K/V depend on (model weights, KV
dtype, block size).

Trust, locally: a hash hit is used only if the entry's stored token ids equal the block's
*and* its parent link (the id of the entry matched for the previous block; :data:`ROOT`
for block 0) equals the entry this sequence matched one block earlier. By induction a
matched run then holds exactly this prefix's K/V even if the hash collides; comparing
only the block's own tokens would not be enough (two prefixes that differ early and
collide could share a later block with the same tokens).

Entry ids are never reused. Parents never die before their children: every sequence
holding a child also holds its parent (block tables are chain prefixes; an identical
block computed twice is deduplicated onto the registered one), and block tables are
freed tail first, so least-recently-used eviction always takes a child before its parent.

This module is the index only; :class:`~devin_compile.runtime.kv_cache.BlockAllocator`
keeps cached blocks whose reference count drops to 0 on an LRU list and evicts from it.
"""
from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass, field
from typing import Sequence as Seq

import xxhash

ROOT_HASH = 0  # the parent hash of block 0
ROOT = 0  # the parent entry id of block 0 (real entry ids start at 1)


def encode_block(parent: int, tokens: Seq[int]) -> bytes:
    """The canonical bytes hashed for one block (see the module docstring)."""
    return parent.to_bytes(16, "little") + struct.pack(f"<{len(tokens)}I", *tokens)


def block_hash(parent: int, tokens: Seq[int]) -> int:
    """Chained hash of a full block: xxh3_128 over :func:`encode_block`, an unsigned 128-bit int."""
    return xxhash.xxh3_128_intdigest(encode_block(parent, tokens))


def chain_hashes(tokens: Seq[int], block_size: int) -> list[int]:
    """The chained hashes of every full block of ``tokens``."""
    out: list[int] = []
    h = ROOT_HASH
    for j in range(len(tokens) // block_size):
        h = block_hash(h, tokens[j * block_size:(j + 1) * block_size])
        out.append(h)
    return out


@dataclass(frozen=True)
class CachedBlock:
    """One registered block: where it lives and what prefix its K/V hold."""

    block: int
    hash: int
    parent: int  # id of the previous block's entry; ROOT for block 0
    tokens: tuple[int, ...]
    id: int
    publish: bool = True  # may go to the KV tiers when evicted (False: registered by a KV-pruning sequence)


class PrefixChain:
    """One sequence's walk along the cache: block hashes and the entries it is known to equal.

    ``hashes`` depend only on the token ids (which only grow), so they survive preemption;
    ``entries[j]`` is the id of the registered entry holding this sequence's block ``j``
    (``block_table[j]`` is that entry's block), for ``j < len(entries)``.
    """

    __slots__ = ("hashes", "entries", "broken")

    def __init__(self) -> None:
        self.hashes: list[int] = []
        self.entries: list[int] = []
        self.broken = False  # a block could not be registered (hash taken by other content): stop

    def reset(self) -> None:
        """The sequence lost its blocks (preemption): keep the hashes, forget the entries."""
        self.entries = []
        self.broken = False


@dataclass
class PrefixCacheStats:
    query_tokens: int = 0  # tokens of admitted sequences (prompt + known output) at admission
    hit_tokens: int = 0  # of those, served from the cache
    evictions: int = 0  # cached blocks taken back for other content
    rejected: int = 0  # hash hits not trusted (tokens or parent differ: a collision)
    deduplicated: int = 0  # blocks computed twice, folded onto the registered copy


@dataclass
class PrefixCache:
    """hash → :class:`CachedBlock` for full, computed blocks (referenced or not)."""

    block_size: int
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        self._by_hash: dict[int, CachedBlock] = {}
        self._by_block: dict[int, CachedBlock] = {}
        self._ids = itertools.count(ROOT + 1)

    def __len__(self) -> int:
        return len(self._by_block)

    def __contains__(self, block: int) -> bool:
        return block in self._by_block

    def entry_of(self, block: int) -> CachedBlock | None:
        return self._by_block.get(block)

    def get(self, h: int) -> CachedBlock | None:
        return self._by_hash.get(h)

    def hash_blocks(self, chain: PrefixChain, tokens: Seq[int], n: int) -> None:
        """Extend ``chain.hashes`` to the first ``n`` full blocks of ``tokens``."""
        bs = self.block_size
        hashes = chain.hashes
        while len(hashes) < n:
            j = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else ROOT_HASH, tokens[j * bs:(j + 1) * bs]))

    def trusted(self, entry: CachedBlock, parent: int, tokens: Seq[int]) -> bool:
        """Whether ``entry`` (a hash hit) really holds ``tokens`` after the prefix of entry ``parent``."""
        return entry.parent == parent and entry.tokens == tuple(tokens)

    def match(self, chain: PrefixChain, tokens: Seq[int], max_blocks: int) -> tuple[list[int], list[int]]:
        """The longest trusted run of cached blocks for ``tokens``' first ``max_blocks`` full blocks.

        Returns (blocks, entry ids); takes no references (the caller does, on admission).
        """
        self.hash_blocks(chain, tokens, max_blocks)
        bs = self.block_size
        blocks: list[int] = []
        ids: list[int] = []
        parent = ROOT
        for j in range(max_blocks):
            e = self._by_hash.get(chain.hashes[j])
            if e is None:
                break
            if not self.trusted(e, parent, tokens[j * bs:(j + 1) * bs]):
                self.stats.rejected += 1
                break
            blocks.append(e.block)
            ids.append(e.id)
            parent = e.id
        return blocks, ids

    def insert(self, block: int, h: int, parent: int, tokens: Seq[int], publish: bool = True) -> CachedBlock:
        if h in self._by_hash or block in self._by_block:
            raise RuntimeError(f"block {block} / hash {h:#x} is already registered")
        e = CachedBlock(block, h, parent, tuple(tokens), next(self._ids), publish)
        self._by_hash[h] = e
        self._by_block[block] = e
        return e

    def evict(self, block: int) -> None:
        """Forget ``block`` (the allocator is reusing it for other content)."""
        e = self._by_block.pop(block)
        del self._by_hash[e.hash]
        self.stats.evictions += 1
