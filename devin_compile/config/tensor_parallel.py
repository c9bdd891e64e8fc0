"""Tensor parallelism: which heads a rank holds, and which options and models it accepts.

``optimize(model, tensor_parallel=N)`` splits every decoder layer over N ranks (Megatron style):
rank r holds query heads ``[r·Hq/N, (r+1)·Hq/N)`` and the KV heads those query heads read.
With ``N | Hkv`` each rank holds ``Hkv/N`` KV heads of its own; with ``Hkv | N`` (fewer KV heads
than ranks) each rank holds the one KV head its query heads share, so ``N/Hkv`` ranks keep a
copy of each KV head (replication). Any other pairing would give a rank query heads of two
groups that share a KV head with another rank unevenly; it is refused. :func:`head_shard`
decides it; :func:`check_model` and :func:`check_options` refuse what is not supported, with one
``ValueError`` before capture or any weight moves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Options that do not combine with ``tensor_parallel`` > 1 yet, and why.
_UNSUPPORTED = {
    "kv_prune": "KV pruning edits rank 0's KV pool only",
    "speculative": "the draft model would run on rank 0 only",
    "kv_cache_tiers": "the KV tiers copy blocks of rank 0's KV pool only",
    "compile_decode": "the ahead-compiled decode graph is not tested with collectives yet",
    "verify": "the probe compares against an unsharded graph",
    "quantization": "quantized weights are computed for the unsharded linears",
    "quantized": "quantized weights are computed for the unsharded linears",
    "offload_layers": "offloading is not tested with collectives yet",
}

_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class HeadShard:
    """The global head indices a rank holds: query heads ``q``, KV heads ``kv``."""

    q: range
    kv: range


@dataclass(frozen=True)
class TensorParallelSpec:
    """This process's place in the tensor-parallel group: ``rank`` of ``world_size``, and the process
    group's name (what ``_c10d_functional.all_reduce`` takes in the graph)."""

    world_size: int
    rank: int
    group_name: str

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadShard:
        return head_shard(num_heads, num_kv_heads, self.world_size, self.rank)

    def rows(self, size: int) -> range:
        """This rank's contiguous ``size / world_size`` share of ``range(size)`` (``ValueError`` unless it divides)."""
        if size % self.world_size:
            raise ValueError(f"{size} does not split over tensor_parallel={self.world_size} ranks")
        n = size // self.world_size
        return range(self.rank * n, (self.rank + 1) * n)


def head_shard(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> HeadShard:
    """The query and KV heads rank ``rank`` of ``tp`` holds (see the module docstring)."""
    if num_heads % tp:
        raise ValueError(f"tensor_parallel={tp} does not divide the model's {num_heads} query heads; "
                         f"use a tensor_parallel that divides {num_heads}")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
    per_rank = num_heads // tp
    q = range(rank * per_rank, (rank + 1) * per_rank)
    if num_kv_heads % tp == 0:
        n = num_kv_heads // tp
        return HeadShard(q, range(rank * n, (rank + 1) * n))
    if tp % num_kv_heads == 0:  # fewer KV heads than ranks: each rank keeps the one its queries read
        kv = q.start // (num_heads // num_kv_heads)
        return HeadShard(q, range(kv, kv + 1))
    raise ValueError(f"tensor_parallel={tp} and the model's {num_kv_heads} KV heads: one must divide the other "
                     "(each rank holds whole KV heads, or one KV head that several ranks keep a copy of)")


def check_model(num_heads: int, num_kv_heads: int, tp: int, *, mla: bool, hf_config: Any = None) -> None:
    """A ``ValueError`` unless a model with these heads can be split over ``tp`` ranks."""
    if mla:
        raise ValueError("tensor_parallel > 1 does not support multi-head latent attention (DeepSeek MLA) yet")
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    experts = [k for k in _MOE_KEYS if (getattr(text, k, 0) or 0) > 0]
    if experts:
        raise ValueError(f"tensor_parallel > 1 does not support mixture-of-experts models ({experts[0]}="
                         f"{getattr(text, experts[0])}): expert parallelism is not implemented")
    head_shard(num_heads, num_kv_heads, tp, 0)


def check_options(config: Any) -> None:
    """A ``ValueError`` naming the first option set together with ``tensor_parallel`` > 1 that does not
    combine with it yet (``config``: an ``OptimizeConfig``)."""
    tp = config.tensor_parallel
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel={tp!r} must be an integer >= 1 (the number of ranks)")
    if tp == 1:
        return
    for name, why in _UNSUPPORTED.items():
        if getattr(config, name):
            raise ValueError(f"tensor_parallel={tp} with {name}= is not supported yet: {why}")
