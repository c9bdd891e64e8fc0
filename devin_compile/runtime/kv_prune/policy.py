"""The eviction policy: how many tokens a sequence drops now, and which ones in each layer.

The first ``sink_tokens`` positions and the last ``recent_tokens`` positions are never
evicted. ``count`` = the mean over layers of the number of other tokens scoring below
``threshold`` (policy ``attention``), raised to meet ``max_tokens`` /
``ceil(max_ratio · positions)`` live tokens, and bounded by what is evictable. Every layer
evicts exactly ``count`` tokens, its own lowest-scoring ones (``streaming``: the oldest;
``random``: a seeded random choice; the first ``recency_layers`` fraction of the layers: the
oldest, whatever the policy), so all layers keep equal slot counts and share one block table.
"""
from __future__ import annotations

import math

import torch

from ...config import KVPruneConfig
from .scores import PruneState


def pool_by_position(scores: torch.Tensor, positions: torch.Tensor, kernel: int) -> torch.Tensor:
    """Max of each slot's score over itself and the ``kernel - 1`` live tokens before it in position (per layer).

    Forward-looking: the tokens that follow a strongly attended one are kept with it (the span
    an induction/copy head reads next). Slots are not in position order after compaction, so
    sort by position, max-pool, unsort.
    """
    order = positions.argsort(dim=1)
    s = scores.gather(1, order)
    unobserved = torch.isinf(s)  # stay +inf themselves, lend nothing to their neighbours
    padded = torch.nn.functional.pad(s.masked_fill(unobserved, 0.0)[:, None], (kernel - 1, 0))
    pooled = torch.nn.functional.max_pool1d(padded, kernel, stride=1)[:, 0].masked_fill(unobserved, math.inf)
    out = torch.empty_like(scores)
    out.scatter_(1, order, pooled)
    return out


def eviction_count(cfg: KVPruneConfig, num_positions: int, protected: torch.Tensor,
                   mean: torch.Tensor | None) -> int:
    """Tokens every layer evicts now: below ``threshold`` (mean over layers), raised to meet the caps."""
    n = protected.shape[1]
    evictable = n - int(protected[0].sum())
    if evictable <= 0:
        return 0
    count = 0
    if mean is not None and cfg.threshold > 0:
        below = (mean < cfg.threshold) & ~protected
        count = int(below.sum(dim=1).float().mean().floor())
    cap = math.inf
    if cfg.max_tokens is not None:
        cap = cfg.max_tokens
    if cfg.max_ratio is not None:
        cap = min(cap, math.ceil(cfg.max_ratio * num_positions))
    if cap < n:
        count = max(count, n - int(cap))
    return min(count, evictable)


def choose_evictions(st: PruneState, num_positions: int, num_layers: int) -> torch.Tensor | None:
    """[layers, n] bool: the slots each layer evicts (the same count per layer); None: evict nothing.

    ``st`` tracks the sequence's ``n`` live slots; ``num_positions`` is its computed token count.
    """
    cfg = st.config
    n = st.n
    pos = st.positions[:, :n]
    protected = (pos < cfg.sink_tokens) | (pos >= num_positions - cfg.recent_tokens)
    mean = st.mean_scores() if cfg.policy == "attention" else None
    if mean is not None and cfg.pool_kernel > 1:
        mean = pool_by_position(mean, pos, cfg.pool_kernel)
    count = eviction_count(cfg, num_positions, protected, mean)
    if count <= 0:
        return None
    if cfg.policy == "attention":
        key = mean.clone()
        key[torch.isinf(key)] = 1e30  # never observed: evicted last among the unprotected
    elif cfg.policy == "streaming":
        key = pos.float()
    else:
        key = torch.rand(pos.shape, generator=st.generator).to(pos.device)
    recency = cfg.num_recency_layers(num_layers)
    if recency:
        key[:recency] = pos[:recency].float()
    key = key.masked_fill(protected, math.inf)
    idx = torch.topk(key, count, dim=1, largest=False).indices
    evict = torch.zeros_like(protected)
    evict.scatter_(1, idx, True)
    return evict
