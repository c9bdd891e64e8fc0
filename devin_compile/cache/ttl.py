"""In-process cache whose entries expire a fixed time after they are set (and LRU by bytes).

Each entry lives ``ttl_s`` seconds from its ``set`` (or the ``ttl_s`` passed to that ``set``),
measured on ``clock`` (injectable; :func:`time.monotonic` by default). It is gone from the instant
``clock`` reaches its deadline. A forward jump of ``clock`` expires everything it passes; a backward
jump counts as no elapsed time (see :mod:`.clock`): nothing comes back, and the time an entry had
left is still left once the clock moves forward again. Reading an entry does not extend its life.
Under byte pressure the least recently used live entry is evicted, as in :class:`.LRUCache`.
"""
from __future__ import annotations

import time
from typing import Callable

from .base import EvictCallback, check_ttl
from .lru import LRUCache


class TTLCache(LRUCache):
    """:class:`.LRUCache` whose entries expire ``ttl_s`` seconds after they are set."""

    def __init__(self, max_bytes: int, ttl_s: float, *, clock: Callable[[], float] = time.monotonic,
                 on_evict: EvictCallback | None = None) -> None:
        if ttl_s is None:
            raise ValueError("TTLCache needs ttl_s (seconds); use LRUCache for entries without a TTL")
        super().__init__(max_bytes, on_evict=on_evict, clock=clock)
        self.default_ttl_s = check_ttl(ttl_s)
