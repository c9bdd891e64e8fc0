"""Tensor parallelism: which heads a rank holds, and which options and models it accepts.

``optimize(model, tensor_parallel=N)`` splits every decoder layer over N ranks (Megatron style).
Heads go to ranks in whole GQA groups (a KV head and the ``Hq/Hkv`` query heads that read it), so
each rank's ``paged_attention`` keeps the model's group size and no query head reads a KV head
another rank holds:

- ``Hkv >= N``: rank r holds a contiguous run of KV groups, ``Hkv/N`` each; when N does not divide
  Hkv the first ``Hkv mod N`` ranks hold one group more (SmolLM2, 9 query / 3 KV heads at N=2:
  rank 0 query heads 0-5 with KV heads 0-1, rank 1 query heads 6-8 with KV head 2). No head is
  stored twice; the ranks' attention and q/o shares differ by one group.
- ``Hkv < N`` and ``Hkv | N``, ``N | Hq``: rank r holds query heads ``[r·Hq/N, (r+1)·Hq/N)`` and the one
  KV head they share, so ``N/Hkv`` ranks keep a copy of each KV head (replication).

Anything else would cut a group between ranks (a rank with an uneven mix of groups); it is
refused. :func:`head_shard` decides it; :func:`check_model` and :func:`check_options` refuse what
is not supported, with one ``ValueError`` before capture or any weight moves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Options that do not combine with ``tensor_parallel`` > 1 yet, and why.
_UNSUPPORTED = {
    "kv_prune": "KV pruning edits rank 0's KV pool only",
    "compile_decode": "the ahead-compiled decode graph is not tested with collectives yet",
    "verify": "the probe compares against an unsharded graph",
    "offload_layers": "offloading is not tested with collectives yet",
}

_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_SHARED_EXPERT_KEYS = ("shared_expert_intermediate_size", "n_shared_experts")


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

    def vocab_rows(self, size: int) -> tuple[range, int]:
        """This rank's rows of a vocabulary of ``size`` split in shards of ``⌈size / world_size⌉`` rows: the
        real rows it holds (the last ranks' may be fewer, or none) and the shard's length, to which
        its copy is padded with zero rows."""
        per = -(-size // self.world_size)
        start = min(self.rank * per, size)
        return range(start, min(start + per, size)), per


def head_shard(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> HeadShard:
    """The query and KV heads rank ``rank`` of ``tp`` holds (see the module docstring)."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp:  # whole KV groups per rank; the first Hkv % tp ranks take one more
        base, extra = divmod(num_kv_heads, tp)
        start = rank * base + min(rank, extra)
        kv = range(start, start + base + (rank < extra))
        return HeadShard(range(kv.start * group, kv.stop * group), kv)
    if tp % num_kv_heads == 0 and num_heads % tp == 0:  # fewer KV heads than ranks: each rank keeps the one its queries read
        per_rank = num_heads // tp
        q = range(rank * per_rank, (rank + 1) * per_rank)
        kv = q.start // group
        return HeadShard(q, range(kv, kv + 1))
    raise ValueError(f"tensor_parallel={tp} does not split the model's {num_heads} query heads over its {num_kv_heads} "
                     f"KV heads: with more ranks than KV heads, the ranks must divide both (use a tensor_parallel "
                     f"of at most {num_kv_heads}, or a multiple of {num_kv_heads} that divides {num_heads})")


def check_model(num_heads: int, num_kv_heads: int, tp: int, *, mla: bool, hf_config: Any = None) -> None:
    """A ``ValueError`` unless a model with these heads can be split over ``tp`` ranks."""
    if mla:
        raise ValueError("tensor_parallel > 1 does not support multi-head latent attention (DeepSeek MLA) yet")
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    head_shard(num_heads, num_kv_heads, tp, 0)
    if any((getattr(text, k, 0) or 0) > 0 for k in _MOE_KEYS):
        _check_experts(text, tp)


def _check_experts(text: Any, tp: int) -> None:
    """Routed experts split by intermediate features (every expert on every rank): no shared expert
    (its gate linear is not split), and ``tp`` divides the experts' intermediate size."""
    shared = [k for k in _SHARED_EXPERT_KEYS if (getattr(text, k, 0) or 0) > 0]
    if shared:
        raise ValueError(f"tensor_parallel > 1 does not support mixture-of-experts models with shared experts "
                         f"({shared[0]}={getattr(text, shared[0])}) yet; use tensor_parallel=1")
    size = getattr(text, "moe_intermediate_size", None) or getattr(text, "intermediate_size", 0)
    if size % tp:
        raise ValueError(f"tensor_parallel={tp} does not divide the experts' intermediate size {size}: every "
                         f"expert is split over the ranks; use a tensor_parallel that divides {size}")


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
