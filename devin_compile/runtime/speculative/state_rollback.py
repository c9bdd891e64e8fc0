"""Speculative decoding over recurrent layers: the state rolled back by one snapshot and a recompute.

A verify step runs ``[last token, d1..dk]`` through the target, so each recurrent layer's state in the sequence's
slot (``runtime/state_pool.py``) ends after ``dk``. K/V of rejected proposals is dropped by moving
``num_computed`` back; a recurrent state cannot be cut that way. The way chosen here: **one snapshot per drafted
sequence per step** (its slot's states before the forward, taken in :meth:`StateRollback.take`), and when a
proposal is rejected (or the step is undone for non-finite logits) the slot is restored from it and the sequence's
KV rolled back to where the step began (:meth:`StateRollback.settle`): the next step recomputes the kept tokens
(``last, d1..dj`` and the target's own token) as a short chunk, which rewrites the same K/V and advances the state
exactly. When every proposal is accepted the state after ``dk`` is already the right one: nothing is redone. One
snapshot per proposal position would avoid the recompute but needs the ops to write a state per token; a verify
step with rejections costs one extra short chunk instead.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..kv_manager import KVManager
    from ..state_pool import StatePool
    from ..step_plan import ScheduledSeq


class StateRollback:
    def __init__(self, pool: "StatePool") -> None:
        self.pool = pool
        self._snaps: dict[str, list[torch.Tensor]] = {}
        self.restored = 0  # verify steps whose states were restored (a rejection or an undone step)

    def take(self, items: list["ScheduledSeq"]) -> None:
        """Snapshot the slots of this step's drafted sequences (the previous step's snapshots are dropped)."""
        self._snaps = {it.seq.request_id: self.pool.read(it.seq.state_slot) for it in items
                       if it.draft and it.seq.state_slot >= 0}

    def settle(self, item: "ScheduledSeq", tokens: list[int] | None, kv: "KVManager") -> None:
        """After verification: ``tokens`` kept (None: the step is undone). Unless every proposal was accepted,
        restore the slot and roll the KV back to the step's start, so the kept tokens are recomputed."""
        snap = self._snaps.pop(item.seq.request_id, None)
        if snap is None or (tokens is not None and len(tokens) - 1 == len(item.draft)):
            return
        seq = item.seq
        self.pool.write(seq.state_slot, snap)
        self.restored += 1
        if tokens is not None:  # an undone step's KV was rolled back to its start already
            kv.rollback(seq, seq.num_computed - item.num_tokens - len(tokens) + 1)
