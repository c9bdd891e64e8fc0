"""Writing one step's new keys and values into the paged cache (shared by torch backends)."""
from __future__ import annotations

import torch

from ...step import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Scatter k/v [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] at ``meta.slot_mapping``.

    Slots equal to -1 (padded decode entries) are skipped, so they never touch a real page.
    """
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    slots = meta.slot_mapping
    if meta.has_padded_slots:
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    kc.index_copy_(0, slots, k.to(kc.dtype))
    vc.index_copy_(0, slots, v.to(vc.dtype))


def gather_sequence(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached entries of one sequence: [length, Hkv, D]."""
    bs = cache.shape[1]
    nblocks = (length + bs - 1) // bs
    blocks = block_table[:nblocks].long()
    return cache.index_select(0, blocks).reshape(-1, *cache.shape[2:])[:length]
