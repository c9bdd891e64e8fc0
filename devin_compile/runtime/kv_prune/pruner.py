"""KVPruner: the engine's handle on KV pruning; :meth:`~KVPruner.begin` before a step's
forward, :meth:`~KVPruner.finish` after it (policy, then compaction)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...config import KVPruneConfig
from .compaction import compact
from .policy import choose_evictions
from .scores import PruneState, PruneStep
from .stats import PruneTotals

if TYPE_CHECKING:
    from ..kv_cache import PagedKVCache
    from ..kv_manager import KVManager
    from ..step_plan import ScheduledSeq
    from ..sequence import Sequence


class KVPruner:
    """Owns the policy and compaction; the engine calls :meth:`begin` and :meth:`finish` each step.

    ``default``: the model's ``optimize(kv_prune=...)`` configuration (requests prune with it
    when it is ``enabled`` and they say nothing else; see :func:`.switch.resolve_request`).
    """

    def __init__(self, default: KVPruneConfig, kv: "KVManager", kv_cache: "PagedKVCache", backend: Any) -> None:
        self.default = default
        self.kv = kv
        self.kv_cache = kv_cache
        self.backend = backend
        self.num_layers = kv_cache.spec.num_layers
        self.block_size = kv_cache.block_size
        self.totals = PruneTotals()
        self._seeds = 0

    def _new_state(self, seq: "Sequence") -> PruneState:
        cfg = seq.kv_prune_config
        seq.kv_prune_state = PruneState(cfg, self.num_layers, self.kv_cache.device, cfg.seed + self._seeds)
        self._seeds += 1
        return seq.kv_prune_state

    def _begin_prefill(self, scheduled: list["ScheduledSeq"]) -> PruneStep | None:
        """Prefill-graph step: sequences whose prompt completes now and that have an observation window."""
        rows = []
        for b, item in enumerate(scheduled):
            seq = item.seq
            cfg = seq.kv_prune_config
            if (cfg is None or cfg.prefill_window <= 0 or seq.kv_prune_state is not None
                    or seq.num_computed + item.num_tokens != seq.num_tokens):
                continue
            self._new_state(seq)
            rows.append((b, seq))
        if not rows:
            return None
        return PruneStep(rows, rows, rows, side_output=False, phase="prefill")

    def begin(self, scheduled: list["ScheduledSeq"]) -> PruneStep | None:
        """Plan a step (None: no sequence prunes or scores in it, so the kv_prune nodes return at once)."""
        if not all(it.num_tokens == 1 and it.seq.num_computed + 1 == it.seq.num_tokens for it in scheduled):
            return self._begin_prefill(scheduled)
        rows = []
        for b, item in enumerate(scheduled):
            seq = item.seq
            cfg = seq.kv_prune_config
            if cfg is None:
                continue
            if seq.kv_prune_state is None:
                self._new_state(seq)
            rows.append((b, seq))
        if not rows:
            return None
        side_capable = hasattr(self.backend, "forward_with_scores")
        every_step = side_capable and getattr(self.backend, "scores_every_step", True)
        eval_rows, score_rows, deferred, speculating = [], [], {}, set()
        first_draft_row, nxt = [], len(scheduled)  # proposals' rows follow the batch's, in order (ModelRunner.execute)
        for item in scheduled:
            first_draft_row.append(nxt)
            nxt += len(item.draft)
        for b, seq in rows:
            st: PruneState = seq.kv_prune_state
            draft = scheduled[b].draft
            if draft:  # verified tokens count (and score) after acceptance: PruneStep.commit
                speculating.add(id(seq))
                if st.config.policy == "attention" and every_step:
                    first = first_draft_row[b]
                    verify_rows = [b, *range(first, first + len(draft))]
                    deferred.update((row, j) for j, row in enumerate(verify_rows))
                    score_rows.extend((r, seq) for r in verify_rows)
                continue
            st.steps_since_eval += 1
            evaluate = st.steps_since_eval >= st.config.step_interval
            if evaluate:
                eval_rows.append((b, seq))
            if st.config.policy == "attention" and (evaluate or every_step):
                score_rows.append((b, seq))
        return PruneStep(rows, eval_rows, score_rows, side_output=side_capable and bool(score_rows),
                         deferred=deferred, speculating=speculating)

    def finish(self, step: PruneStep | None) -> None:
        """After the forward (``num_computed`` updated): evaluate the sequences due, update metrics."""
        if step is None:
            return
        with torch.inference_mode():  # the score buffers were made inside the forward's inference mode
            for _, seq in step.eval_rows:
                seq.kv_prune_state.steps_since_eval = 0
                if not seq.status.done:
                    self._evaluate(seq)
            for _, seq in step.rows:
                if seq.kv_prune_state is not None:
                    seq.kv_prune_state.ensure(seq.num_slots, seq.num_evicted)
                seq.metrics.kv_live_tokens = seq.num_slots

    def _evaluate(self, seq: "Sequence") -> None:
        st: PruneState = seq.kv_prune_state
        st.ensure(seq.num_slots, seq.num_evicted)
        evict = choose_evictions(st, seq.num_computed, self.num_layers)
        self.totals.evaluations += 1
        seq.metrics.kv_prune_evaluations += 1
        if evict is not None:
            self.compact(seq, evict)

    def compact(self, seq: "Sequence", evict: torch.Tensor) -> bool:
        """Drop the slots marked in ``evict`` ([layers, n] bool) and free pages (see :mod:`.compaction`);
        the sequence stops registering prefix blocks. False (nothing changed): no block for a copy."""
        if not compact(seq, evict, self.kv.allocator, self.kv_cache, self.totals):
            return False
        if bool(evict[0].any()):
            self.kv.stop_registration(seq)
        return True

    def stats(self, running: list["Sequence"]) -> dict:
        """Pruning counters, with the KV slots the ``running`` sequences hold now."""
        return self.totals.as_stats(sum(s.num_slots for s in running))
