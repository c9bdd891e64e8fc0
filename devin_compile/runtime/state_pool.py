"""StatePool: fixed-size recurrent-state slots beside the paged KV pool, one slot per running sequence.

Layers that carry state instead of (or beside) a KV cache — a Mamba2 mixer's conv window ``[Cd, K-1]`` and
SSM state ``[H, P, N]`` — need the same amount of it whatever a sequence's length, so they get no blocks:
each recurrent layer holds one tensor per state kind, ``[num_slots, *shape]`` (float32), and a sequence owns
one slot index across all of them. Life of a slot (``runtime/kv_manager.py`` drives it):

- taken when the sequence is admitted (``KVManager.admit``; admission waits while none is free, which
  ``max_num_seqs`` slots make impossible for the scheduler's own cap), zeroed when taken;
- given back when its blocks are: at finish, abort, failure and preemption (a preempted sequence is
  recomputed from its tokens, so its state is rebuilt, never kept);
- ``borrow()`` lends one for a full-sequence forward outside the scheduler (``forward_logits``).

The ops read each sequence's slot from the step context (``step.StateStep``); a sequence with no cached
tokens before a step starts from zeros whatever its slot holds, so a stale slot is never read.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch


class StatePool:
    """``num_slots`` slots of the states of every recurrent layer (``shapes[i]``: layer i's state shapes)."""

    def __init__(self, shapes: Sequence[Sequence[tuple[int, ...]]], num_slots: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got num_slots={num_slots}")
        self.num_slots = num_slots
        self._layers = [tuple(torch.zeros((num_slots, *s), dtype=dtype, device=device) for s in layer)
                        for layer in shapes]
        self._free = list(range(num_slots - 1, -1, -1))  # pop() takes the lowest slot first
        self._owners: dict[int, str] = {}

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        return self._layers[i]

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for layer in self._layers for t in layer)

    def owners(self) -> dict[int, str]:
        """slot → the request holding it (a copy)."""
        return dict(self._owners)

    def allocate(self, owner: str) -> int:
        """A zeroed slot for ``owner``; ``RuntimeError`` when none is free (admission checks first)."""
        if not self._free:
            raise RuntimeError(f"the recurrent state pool's {self.num_slots} slots are all taken "
                               f"(first owners: {sorted(self._owners.values())[:4]}); a sequence is admitted only "
                               "with a free slot")
        slot = self._free.pop()
        for layer in self._layers:
            for t in layer:
                t[slot].zero_()
        self._owners[slot] = owner
        return slot

    def read(self, slot: int) -> list[torch.Tensor]:
        """A copy of ``slot``'s states, every layer's in order (speculation's snapshot)."""
        return [t[slot].clone() for layer in self._layers for t in layer]

    def write(self, slot: int, states: list[torch.Tensor]) -> None:
        """Put back what :meth:`read` returned."""
        for t, s in zip((t for layer in self._layers for t in layer), states):
            t[slot].copy_(s)

    def free(self, slot: int) -> None:
        if slot not in self._owners:
            raise ValueError(f"state slot {slot} is not allocated (freed twice?)")
        del self._owners[slot]
        self._free.append(slot)

    @contextlib.contextmanager
    def borrow(self, owner: str = "<borrowed>") -> Iterator[int]:
        """A slot for the ``with`` block (a full-sequence forward), given back after."""
        slot = self.allocate(owner)
        try:
            yield slot
        finally:
            self.free(slot)
