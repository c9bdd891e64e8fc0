"""Writing one step's new keys and values into the paged cache (shared by torch backends)."""
from __future__ import annotations

import torch

from ...step import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Scatter k/v [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] at ``meta.slot_mapping``.

    Slots equal to -1 (padded decode entries) never touch a real page. Without a host sync (a
    captured CUDA Graph step): each padded row rewrites the first real row's slot with that row's
    own values, so every write to a slot carries the same data (at least one row is real; with none,
    slot 0 gets row 0).
    """
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    slots = meta.slot_mapping
    if meta.has_padded_slots and slots.numel():
        keep = slots >= 0
        first = keep.to(torch.int8).argmax()  # the first real row
        slots = torch.where(keep, slots, slots[first]).clamp(min=0)
        k = torch.where(keep[:, None, None], k, k[first])
        v = torch.where(keep[:, None, None], v, v[first])
    kc.index_copy_(0, slots, k.to(kc.dtype))
    vc.index_copy_(0, slots, v.to(vc.dtype))


def gather_sequence(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached entries of one sequence: [length, Hkv, D]."""
    bs = cache.shape[1]
    nblocks = (length + bs - 1) // bs
    blocks = block_table[:nblocks].long()
    return cache.index_select(0, blocks).reshape(-1, *cache.shape[2:])[:length]
