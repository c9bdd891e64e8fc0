"""Per-sequence attention scores (:class:`PruneState`) and one step's plan (:class:`PruneStep`).

**Scores.** For sequence b at layer l the backend gives ``a[h, j]``: the softmax mass of the
step's query on cached slot ``j``, summed over the ``G`` query heads sharing KV head ``h``.
The normalised score of one observation is ``max_h (a[h, j] / G) · n_live``: the largest
per-KV-head mean attention times the number of live slots, so **1.0 means uniform
attention** at any context length. A token's score is the mean over the steps that observed
it (every decode step with a side output from a backend with ``scores_every_step``,
evaluation steps only otherwise).

**Speculation.** A verify step's rows of a pruning sequence (its base row and one per
proposal) are *deferred*: their mass waits in :attr:`PruneStep.pending` until acceptance is
known, then :meth:`PruneStep.commit` folds the rows whose input token was verified (the
base row and the accepted proposals' rows: exactly the queries plain decoding would have
made) and drops the rest, so no unverified token is ever scored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ...config import KVPruneConfig

if TYPE_CHECKING:
    from ..sequence import Sequence


class PruneState:
    """One sequence's pruning state: per layer and slot, the token's position and score sums."""

    def __init__(self, config: KVPruneConfig, num_layers: int, device: torch.device, seed: int) -> None:
        self.config = config
        self.n = 0  # slots tracked
        self.positions = torch.empty((num_layers, 0), dtype=torch.long, device=device)
        self.score_sum = torch.empty((num_layers, 0), dtype=torch.float32, device=device)
        self.obs = torch.empty((num_layers, 0), dtype=torch.float32, device=device)
        self.steps_since_eval = 0
        self.generator = torch.Generator(device="cpu").manual_seed(seed) if config.policy == "random" else None

    def ensure(self, n: int, num_evicted: int) -> None:
        """Track slots up to ``n``; new slots were appended in order, so slot s holds position s + evicted."""
        if n <= self.n:
            return
        cap = self.positions.shape[1]
        if n > cap:
            new_cap = max(n, 2 * cap, 64)
            L = self.positions.shape[0]
            for name, dtype in (("positions", torch.long), ("score_sum", torch.float32), ("obs", torch.float32)):
                old = getattr(self, name)
                grown = torch.zeros((L, new_cap), dtype=dtype, device=old.device)
                grown[:, :self.n] = old[:, :self.n]
                setattr(self, name, grown)
        self.positions[:, self.n:n] = torch.arange(self.n, n, device=self.positions.device) + num_evicted
        self.score_sum[:, self.n:n] = 0
        self.obs[:, self.n:n] = 0
        self.n = n

    def mean_scores(self) -> torch.Tensor:
        """[layers, n] mean normalised score; +inf where a slot was never observed."""
        obs = self.obs[:, :self.n]
        return torch.where(obs > 0, self.score_sum[:, :self.n] / obs.clamp_min(1), torch.full_like(obs, math.inf))

    def move_slots(self, dst_layers: torch.Tensor, dst_slots: torch.Tensor, src_layers: torch.Tensor,
                   src_slots: torch.Tensor, n: int) -> None:
        """Follow a compaction: slot (src_layers, src_slots) now lives at (dst_layers, dst_slots); keep ``n``."""
        for a in (self.positions, self.score_sum, self.obs):
            a[dst_layers, dst_slots] = a[src_layers, src_slots]
        self.n = n


@dataclass
class PruneStep:
    """What the ops of one decode step read from ``StepContext.kv_prune``.

    ``rows``: (batch row, sequence) of the sequences that prune; ``score_rows``: those that
    take scores this step; ``side_output``: whether backends that can should produce the
    attention-mass side output; ``recompute``: rows whose scores the ``kv_prune`` node
    recomputes when a layer has no side output (evaluation steps only).
    """

    rows: list[tuple[int, "Sequence"]]
    eval_rows: list[tuple[int, "Sequence"]]
    score_rows: list[tuple[int, "Sequence"]]
    side_output: bool
    phase: str = "decode"  # "prefill": score_rows finish their prompt; score their last prefill_window queries
    side: dict[int, dict] = field(default_factory=dict)  # layer → {batch row: [Hkv, L] mass}
    layers_scored: int = 0
    deferred: dict[int, int] = field(default_factory=dict)  # verify row → its index among its sequence's rows
    pending: dict[int, list] = field(default_factory=dict)  # id(seq) → [(layer, row index, normalised mass)]
    speculating: set[int] = field(default_factory=set)  # id(seq) of the pruning sequences verifying proposals

    @property
    def score_row_ids(self) -> list[int]:
        return [b for b, _ in self.score_rows]

    def accumulate(self, layer: int, scores: dict[int, torch.Tensor], group: int) -> None:
        """Fold one layer's attention mass (batch row → [Hkv, L], summed over the group's query heads)."""
        for b, seq in self.score_rows:
            a = scores.get(b)
            if a is None:
                continue
            n = a.shape[-1]
            norm = a.float().amax(dim=0) * (n / group)
            if b in self.deferred:
                self.pending.setdefault(id(seq), []).append((layer, self.deferred[b], norm))
                continue
            self._fold(seq, layer, norm)
        self.layers_scored += 1

    @staticmethod
    def _fold(seq: "Sequence", layer: int, norm: torch.Tensor) -> None:
        st: PruneState = seq.kv_prune_state
        n = norm.shape[-1]
        st.ensure(n, seq.num_evicted)
        st.score_sum[layer, :n] += norm
        st.obs[layer, :n] += 1

    def commit(self, seq: "Sequence", accepted: int | None) -> None:
        """Speculation: fold the deferred rows ``0..accepted`` of ``seq`` (None: the step was undone,
        fold nothing) and count the verified tokens as decode steps towards the next evaluation."""
        pending = self.pending.pop(id(seq), [])
        if id(seq) not in self.speculating or accepted is None:
            return
        for layer, j, norm in pending:
            if j <= accepted:
                self._fold(seq, layer, norm)
        seq.kv_prune_state.steps_since_eval += 1 + accepted

    def accumulate_window(self, layer: int, b: int, seq: "Sequence", score_sum: torch.Tensor,
                          obs: torch.Tensor) -> None:
        """Fold the prefill observation window of one row: summed normalised scores and observation counts [L]."""
        st: PruneState = seq.kv_prune_state
        n = score_sum.shape[-1]
        st.ensure(n, seq.num_evicted)
        st.score_sum[layer, :n] += score_sum
        st.obs[layer, :n] += obs
