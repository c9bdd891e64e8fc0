"""How one step's packed sequences split for a recurrent layer: decode rows (one token over a stored state,
batched) and prefill rows (a chunk per sequence, from its stored state or from zeros)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass
class StepRows:
    """Planned once per step (``AttentionMetadata.scratch``) and shared by every recurrent op of the step."""

    starts: list[int]  # token offset of each sequence (and the total at the end)
    decode: list[int]  # sequences run as one recurrent step (one token over a context, with a slot)
    rows: torch.Tensor | None  # their token rows (None: the step is exactly its decode rows, in order)
    slots: torch.Tensor  # their state slots
    prefill: list[tuple[int, int, int, bool]]  # the other sequences: (start, end, slot, fresh)

    @staticmethod
    def plan(query_lens: list[int], context_lens: list[int], slots: list[int], device) -> "StepRows":
        """``slots[b]`` -1: a padded row (zero state, nothing written); ``context_lens[b]`` 0: a fresh sequence."""
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        dec = [b for b, (n, c, s) in enumerate(zip(query_lens, context_lens, slots)) if n == 1 and c > 0 and s >= 0]
        whole = len(dec) == len(query_lens)
        rows = None if whole else torch.tensor([starts[b] for b in dec], dtype=torch.long, device=device)
        done = set(dec)
        prefill = [(starts[b], starts[b + 1], s, c == 0 or s < 0)
                   for b, (n, c, s) in enumerate(zip(query_lens, context_lens, slots)) if b not in done and n > 0]
        return StepRows(starts, dec, rows, torch.tensor([slots[b] for b in dec], dtype=torch.long, device=device),
                        prefill)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """The decode rows of a [T, ...] step tensor."""
        return t if self.rows is None else t[self.rows]

    def chunks(self, state: torch.Tensor) -> Iterator[tuple[slice, int, torch.Tensor]]:
        """Each prefill sequence's (token slice, slot, float32 starting state: zeros when fresh)."""
        for a, e, s, fresh in self.prefill:
            yield slice(a, e), s, torch.zeros_like(state[0], dtype=torch.float32) if fresh else state[s].float()

    def place(self, out: torch.Tensor, decode_out: torch.Tensor) -> torch.Tensor:
        """The step's output with the decode rows' values in place (``decode_out`` itself when the step is
        exactly its decode rows)."""
        if self.rows is None:
            return decode_out
        out[self.rows] = decode_out
        return out

    def put(self, state: torch.Tensor, decode_states: torch.Tensor | None) -> None:
        """Write the decode rows' new states back."""
        if self.decode:
            state[self.slots] = decode_states.to(state.dtype)
