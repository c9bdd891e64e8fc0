"""Tensor-parallel ranks: the rank group, and one scheduler and sampler for all of them (rank 0's).

Every rank holds its shard of the weights (``shard_tensor_parallel``) and its own KV pool with its
KV heads; the pools have the same number of blocks (:meth:`RankGroup.agree_min`), so one block
table means the same slots everywhere. Only rank 0 has a working engine: its scheduler plans each
step and its sampler picks the tokens. Its runner is a :class:`BroadcastRunner`: before every
forward it broadcasts the forward's inputs (token ids, positions, slot mapping, query and
sequence lengths, block tables, logits rows) to the other ranks, which run the same forward in
:func:`follow` (their all_reduces meet rank 0's) until rank 0 says the call is done.

:func:`on_all_ranks` is how ``OptimizedModel.generate`` / ``__call__`` run: rank 0 runs the call
and then broadcasts its result (or its error), the other ranks follow the forwards meanwhile and
return that result, so every rank returns the same outputs. The messages travel with
``torch.distributed.broadcast_object_list`` over a gloo group (the world group on CPU; a gloo
group beside the NCCL one on CUDA).
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import gc
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from ..capture import ModelInfo
from ..config import OptimizeConfig
from ..config.tensor_parallel import TensorParallelSpec
from .kv_cache import KVCacheSpec, blocks_for_budget
from .model_runner import ModelRunner

T = TypeVar("T")
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class RankGroup:
    """This process's rank in the tensor-parallel group, the group the graphs' collectives use
    (by name) and the gloo group the step messages use."""

    rank: int
    world_size: int
    group_name: str
    messages: Any  # a ProcessGroup (gloo)
    # Rank 0 holds it while it sends a message and runs the forward that follows (so a heartbeat from
    # another thread never lands between a step's collectives)
    lock: threading.RLock = field(default_factory=threading.RLock)
    # Why the group can no longer work (a rank died or hung), once known; the server's /health reports it
    failure: str | None = None

    @property
    def spec(self) -> TensorParallelSpec:
        return TensorParallelSpec(self.world_size, self.rank, self.group_name)

    def broadcast(self, message: Any = None) -> Any:
        """Rank 0's ``message`` on every rank."""
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.messages)
        return box[0]

    def ping(self, blocking: bool = True) -> bool:
        """Rank 0: a round trip through every rank (a message, then an all_reduce they answer), so a rank
        that died or hangs raises here within the group's timeout. Without ``blocking``, False (and no
        ping) while a step holds the group: the step's own collectives show the ranks alive."""
        if not self.lock.acquire(blocking=blocking):
            return False
        try:
            self.broadcast(("ping", None))
            self.agree_min(0)
        finally:
            self.lock.release()
        return True

    def gather_blocks(self, pool: Any, blocks: list[int]) -> list[torch.Tensor] | None:
        """Every rank's K/V of pool ``blocks`` ([layers, planes, len(blocks), block_size, its KV heads,
        head_dim], on the host), in rank order on rank 0; None on the others."""
        part = pool.data[:, :, blocks].to("cpu")
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(part, out, dst=0, group=self.messages)
        return out

    def scatter_blocks(self, pool: Any, blocks: list[int], parts: list[torch.Tensor] | None = None) -> None:
        """Write into pool ``blocks`` of every rank its part (rank 0 gives ``parts``, one per rank, shaped
        like :meth:`gather_blocks`' result)."""
        box = [None]
        dist.scatter_object_list(box, parts if self.rank == 0 else None, src=0, group=self.messages)
        pool.data[:, :, blocks] = box[0].to(pool.data.device)

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.messages)
        return int(t.item())


def check_world(tp: int) -> None:
    """Before anything is initialised: a ``ValueError`` unless a group of ``tp`` ranks exists or the
    environment describes one (torchrun's ``env://``: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    else:
        missing = [k for k in _ENV if k not in os.environ]
        if missing:
            raise ValueError(f"tensor_parallel={tp} needs {tp} processes: launch with `torchrun --nproc-per-node {tp}` "
                             f"(env:// rendezvous; {', '.join(missing)} unset) or initialise torch.distributed first")
        world = int(os.environ["WORLD_SIZE"])
    if world != tp:
        raise ValueError(f"tensor_parallel={tp} but the process group has {world} ranks; they must be equal "
                         "(one tensor-parallel group over the whole world)")


def init_rank_group(tp: int, device: torch.device, timeout_s: float | None = None) -> RankGroup:
    """The rank group, initialising ``torch.distributed`` from the environment (gloo on CPU, NCCL on CUDA;
    a collective that waits longer than ``timeout_s`` raises, default torch's) when no process group
    exists, and using the existing one otherwise."""
    check_world(tp)
    if not dist.is_initialized():
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://", timeout=timeout)
        atexit.register(_destroy_own_group)
    world = dist.group.WORLD
    messages = world if dist.get_backend(world) == "gloo" else dist.new_group(backend="gloo")
    group = RankGroup(dist.get_rank(), dist.get_world_size(), world.group_name, messages)
    _RANK_GROUPS.append(weakref.ref(group))
    return group


_RANK_GROUPS: "list[weakref.ref[RankGroup]]" = []  # what _destroy_own_group makes let go of the group


def _destroy_own_group() -> None:
    """At exit, the process group :func:`init_rank_group` created is destroyed and freed while the
    interpreter is whole. Left to interpreter teardown, a gloo worker thread that drops a finished
    message's tensors then needs the GIL and aborts the process ("terminate called without an active
    exception") after its work is done. Freeing the group (no reference left: the rank groups let go
    of it) joins those threads with the GIL released."""
    for group in filter(None, (ref() for ref in _RANK_GROUPS)):
        group.messages = None
        group.failure = group.failure or "the process is exiting (its process group was destroyed)"
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def rank_info(info: ModelInfo, spec: TensorParallelSpec) -> ModelInfo:
    """``info`` as one rank sees it: its query and KV heads (what its KV pool and kernels are built for)."""
    heads = spec.heads(info.num_heads, info.num_kv_heads)
    return dataclasses.replace(info, num_heads=len(heads.q), num_kv_heads=len(heads.kv))


def agree_on_blocks(group: RankGroup, info: ModelInfo, config: OptimizeConfig) -> OptimizeConfig:
    """``config`` with the KV pool's block count fixed to the smallest any rank's budget gives (``info``:
    the rank's own), so that rank 0's block tables are valid on every rank."""
    spec = KVCacheSpec(info.num_layers, dtype=info.dtype, block_size=config.cache.block_size, **info.kv_cache_layout)
    n = blocks_for_budget(spec, info.device, num_blocks=config.cache.num_blocks,
                          memory_bytes=config.cache.memory_bytes, memory_fraction=config.cache.memory_fraction)
    cache = dataclasses.replace(config.cache, num_blocks=group.agree_min(n))
    return dataclasses.replace(config, cache=cache)


class BroadcastRunner:
    """Rank 0's runner: the local :class:`ModelRunner`, with each forward's inputs broadcast to the other
    ranks before it runs. Everything else (the KV pool, the backend, the program) is the local runner's."""

    def __init__(self, local: ModelRunner, group: RankGroup) -> None:
        self.local = local
        self.group = group
        local.before_run = self._send

    def _send(self, args: tuple) -> None:
        self.group.broadcast(("run", args))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)

    @property
    def block_size(self) -> int:
        return self.local.block_size

    def execute(self, batch, kv_prune=None):
        with self.group.lock:
            return self.local.execute(batch, kv_prune)

    def forward_logits(self, token_ids: list[int], block_table: list[int]) -> torch.Tensor:
        with self.group.lock:
            return self.local.forward_logits(token_ids, block_table)


def follow(runner: ModelRunner, group: RankGroup) -> Any:
    """A non-zero rank: run rank 0's broadcast forwards (and answer its pings) until it says the call
    is done; its result."""
    while True:
        kind, payload = group.broadcast()
        if kind == "run":
            runner.run(*payload)
        elif kind == "ping":
            group.agree_min(0)
        elif kind == "kv_gather":  # rank 0's KV tiers store (or load) whole blocks: runtime/kv_tiers_tp.py
            group.gather_blocks(runner.kv_cache, payload)
        elif kind == "kv_scatter":
            group.scatter_blocks(runner.kv_cache, payload)
        elif kind == "done":
            return payload
        elif kind == "error":
            raise RuntimeError(f"rank 0 failed: {payload}")
        else:
            raise RuntimeError(f"unknown tensor-parallel message {kind!r} from rank 0")


def on_all_ranks(group: RankGroup | None, runner: Any, call: Callable[[], T]) -> T:
    """``call()`` on rank 0 (alone without a group), its result on every rank (see the module docstring)."""
    if group is None:
        return call()
    if group.rank != 0:
        return follow(runner, group)
    try:
        result = call()
    except BaseException as e:
        with group.lock:
            group.broadcast(("error", f"{type(e).__name__}: {e}"))
        raise
    with group.lock:
        group.broadcast(("done", result))
    return result
