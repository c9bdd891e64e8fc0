"""Write-through: registered prefix blocks go to the write-through KV tiers (Redis) at once, off the step.

When the prefix cache registers a full block, :meth:`WriteThrough.submit` copies its K/V of every
layer out of the pool (the block may be reused for other content later) into a host staging buffer
and queues its key; a daemon thread encodes the block (:class:`~devin_compile.cache.KVBlockCodec`)
and stores it in every target tier (Redis: one ``SET``). The step pays only the copy: on CPU one
numpy copy per block, on an accelerator one gather of the blocks and one non-blocking transfer per
block into pinned buffers (the thread waits for the transfer, not the step).

- **Behind the step.** On Linux the thread runs 10 nice levels below the process, so on a busy CPU
  the stepping thread goes first; ``store_cpu_ms`` is the CPU time the thread took.
- **Bounded.** At most ``max_bytes`` of blocks are staged (queued or being stored). A block that
  does not fit is dropped (``dropped``), never waited for; the pool offers it again when it evicts it.
- **Once.** A key queued or stored is remembered (the last ``remember`` keys) and not queued
  again; a store that failed everywhere forgets it (``failed``), so an eviction may offer it again.
  Keys of blocks loaded from a tier are remembered too (:meth:`remember`): a tier has them.
- **Faults.** A target that cannot store (Redis down) drops the set and counts an ``error`` in its
  own stats; nothing raises into the engine. Anything else the thread meets is logged and counted.
- **Shutdown.** :meth:`close` stores what is queued (up to ``timeout_s``; then the rest is
  discarded) and joins the thread; a later :meth:`submit` starts a new one. :meth:`flush` waits
  until the queue is empty.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence as Seq

import numpy as np
import torch

from ..cache import CacheBackend, KVBlockCodec
from .kv_cache import PagedKVCache, host_view
from .prefix_cache import CachedBlock

log = logging.getLogger(__name__)
DEFAULT_MAX_BYTES = 256 << 20
KEEP_BUFFERS = 32  # staging buffers kept for reuse once the queue has drained
WORKER_NICE = 10  # the thread's nice value above the process's (Linux): on a busy CPU the step goes first


def _lower_priority() -> None:
    """Run the calling thread ``WORKER_NICE`` nice levels below the process (Linux: a thread has its own
    nice value), so that on a busy CPU the stepping thread goes first; elsewhere nothing changes."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WORKER_NICE))
    except (AttributeError, OSError):  # not Linux, or not permitted: run at the process's priority
        pass


@dataclass
class _Item:
    key: str
    buffer: torch.Tensor  # host copy of the block: [num_layers, planes, block_size, num_kv_heads, head_dim]
    ready: "torch.cuda.Event | None" = None  # set when the copy from an accelerator is still in flight


class WriteThrough:
    """A bounded queue of registered blocks and one thread storing them into ``targets``."""

    def __init__(self, targets: Seq[CacheBackend], pool: PagedKVCache, codec: KVBlockCodec,
                 key: Callable[[int], str], *, max_bytes: int = DEFAULT_MAX_BYTES, remember: int = 1 << 16) -> None:
        if not targets:
            raise ValueError("WriteThrough needs at least one target tier")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"write_through max_bytes={max_bytes!r} must be a positive integer")
        self.targets, self.pool, self.codec, self.key = list(targets), pool, codec, key
        self.capacity = max(1, max_bytes // codec.nbytes)  # blocks staged at once
        self.remember_max = remember
        self._known: OrderedDict[str, None] = OrderedDict()
        self._free: list[torch.Tensor] = []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Condition()
        self._staged = 0  # buffers out of the free list: queued or being stored
        self._thread: threading.Thread | None = None
        self._discard = False
        self.published = self.dropped = self.failed = self.discarded = self.published_bytes = 0
        self.stage_s = self.store_s = self.store_cpu_s = 0.0

    # -- the engine's side -----------------------------------------------------------------
    def submit(self, entries: Seq[CachedBlock]) -> None:
        """Queue registered blocks not queued or stored before (their K/V are copied now)."""
        t0 = time.perf_counter()
        todo: list[tuple[str, int, torch.Tensor]] = []
        for e in entries:
            key = self.key(e.hash)
            with self._lock:
                if key in self._known:
                    continue
                if self._staged >= self.capacity:
                    self.dropped += 1
                    continue
                self._staged += 1
                self._known[key] = None
                self._trim_known()
                buffer = self._free.pop() if self._free else None
            todo.append((key, e.block, buffer if buffer is not None else self._new_buffer()))
        if todo:
            try:
                ready = self._stage(todo)
            except Exception:  # noqa: BLE001  (publishing must never fail the step)
                log.exception("KV write-through could not copy %d blocks out of the pool; not published", len(todo))
                for key, _, buffer in todo:
                    self._done(_Item(key, buffer), stored=False)
                return
            self._ensure_thread()
            for key, _, buffer in todo:
                self._queue.put(_Item(key, buffer, ready))
        self.stage_s += time.perf_counter() - t0

    def remember(self, key: str) -> None:
        """``key``'s block is in a tier already (it was loaded from one): never queue it."""
        with self._lock:
            self._known[key] = None
            self._known.move_to_end(key)
            self._trim_known()

    def forget(self) -> None:
        """The tiers were cleared: no key is known to be stored any more."""
        with self._lock:
            self._known.clear()

    def known(self, key: str) -> bool:
        with self._lock:
            return key in self._known

    def _new_buffer(self) -> torch.Tensor:
        pin = self.pool.data.device.type == "cuda"
        return torch.empty(self.codec.shape, dtype=self.codec.dtype, pin_memory=pin)

    def _stage(self, todo: list[tuple[str, int, torch.Tensor]]) -> "torch.cuda.Event | None":
        """Copy each block's K/V into its buffer; an accelerator's copies finish when the event fires."""
        data = self.pool.data
        if data.device.type == "cpu":  # numpy copies in this thread (see host_view)
            pool = host_view(data)
            for _, block, buffer in todo:
                np.copyto(host_view(buffer), pool[:, :, block])
            return None
        idx = torch.tensor([block for _, block, _ in todo], dtype=torch.long, device=data.device)
        gathered = data.index_select(2, idx)  # one gather on the device, then one transfer per block
        cuda = data.device.type == "cuda"
        if not cuda:  # another accelerator: one transfer, waited for here
            gathered = gathered.cpu()
        for i, (_, _, buffer) in enumerate(todo):
            buffer.copy_(gathered[:, :, i], non_blocking=cuda)
        if not cuda:
            return None
        ready = torch.cuda.Event()  # the thread waits for it, not the step
        ready.record()
        return ready

    def _trim_known(self) -> None:
        while len(self._known) > self.remember_max:
            self._known.popitem(last=False)

    # -- the thread's side -----------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._discard = False
            self._thread = threading.Thread(target=self._run, name="devin-kv-write-through", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        _lower_priority()
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                if self._discard:
                    self._done(item, stored=None)
                    continue
                t0, c0 = time.perf_counter(), time.thread_time()
                stored = self._store(item)
                self.store_s += time.perf_counter() - t0
                self.store_cpu_s += time.thread_time() - c0
                self._done(item, stored)
            except Exception:  # noqa: BLE001  (the thread must outlive any one block)
                log.exception("KV write-through of %s failed; the block is not published", item.key)
                self._done(item, stored=False)

    def _store(self, item: _Item) -> bool:
        if item.ready is not None:
            item.ready.synchronize()
        value = self.codec.encode(item.buffer)
        stored = [t.set(item.key, value) for t in self.targets]  # backends count their own faults
        if any(stored):
            self.published_bytes += len(value)
        return any(stored)

    def _done(self, item: _Item, stored: bool | None) -> None:
        """``stored``: True (published), False (failed: forget the key), None (discarded at close)."""
        with self._lock:
            self._staged -= 1
            if len(self._free) < KEEP_BUFFERS:
                self._free.append(item.buffer)
            if stored:
                self.published += 1
            else:
                self._known.pop(item.key, None)
                if stored is None:
                    self.discarded += 1
                else:
                    self.failed += 1
            self._lock.notify_all()

    # -- flush, close, stats -----------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued block is stored (or failed); False if ``timeout_s`` ran out first."""
        with self._lock:
            return self._lock.wait_for(lambda: self._staged == 0, timeout_s)

    def close(self, *, drain: bool = True, timeout_s: float = 10.0) -> None:
        """Stop the thread: store what is queued first (``drain``; at most ``timeout_s``), else discard it."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self._discard = not drain
        self._queue.put(None)
        thread.join(timeout_s)
        if thread.is_alive():
            log.warning("KV write-through did not drain in %.3g s; discarding %d queued blocks", timeout_s,
                        self.queue_depth)
            self._discard = True
            thread.join(timeout_s)
        self._thread = None

    @property
    def queue_depth(self) -> int:
        """Blocks queued or being stored."""
        with self._lock:
            return self._staged

    def stats(self) -> dict:
        depth = self.queue_depth
        return {"kv_tier_write_through_published": self.published, "kv_tier_write_through_dropped": self.dropped,
                "kv_tier_write_through_failed": self.failed, "kv_tier_write_through_discarded": self.discarded,
                "kv_tier_write_through_queue_depth": depth,
                "kv_tier_write_through_queue_bytes": depth * self.codec.nbytes,
                "kv_tier_write_through_published_bytes": self.published_bytes,
                "kv_tier_write_through_stage_ms": self.stage_s * 1e3,
                "kv_tier_write_through_store_ms": self.store_s * 1e3,
                "kv_tier_write_through_store_cpu_ms": self.store_cpu_s * 1e3}
