"""SpeculativeDecoder: the engine's handle on speculation.

Per step the engine calls :meth:`plan` before scheduling (how many proposals each decoding
sequence may make: the scheduler reserves their KV slots), :meth:`propose` after it (the
pinned proposer of each sequence fills ``ScheduledSeq.draft``), and :meth:`verify` on each
drafted sequence's ``1 + len(draft)`` logits rows after the forward: it accepts or rejects the
proposals and rolls the sequence's KV back to the tokens it keeps (the engine appends them), and a
recurrent model's states with it (``state_rollback.py``: one snapshot, recompute after a rejection).

Which requests speculate: every request by default while a proposer is set, except those with
``SamplingParams(speculative=False)``. A request that prunes its KV proposes at most
``step_interval - steps_since_eval - 2`` tokens, so a verify step never reaches a pruning
evaluation (evaluations run on plain decode steps, as without speculation) and only verified
rows are scored (:meth:`~devin_compile.runtime.kv_prune.scores.PruneStep.commit`): its greedy
output is the one it has without speculation. A request's
``speculative={...}`` overrides ``num_tokens`` (capped by nothing but ``max_verify_tokens``),
``acceptance_threshold`` and ``adaptive``. :meth:`set_proposer` swaps the proposer for new
requests; a request in flight keeps the one it was admitted with.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ...config import SpeculativeConfig, SpeculativeRequest
from ..sampler import ProcessorError, apply_processors
from ..sampling import sampling_probs
from .acceptance import accept_greedy, accept_sampled
from .adaptive import SpecState
from .proposer import DraftRequest, Proposer
from .state_rollback import StateRollback
from .stats import SpecMetrics

if TYPE_CHECKING:
    from ..kv_manager import KVManager
    from ..step_plan import ScheduledSeq
    from ..sequence import Sequence


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None) -> None:
        self.config = config
        self.proposer = proposer
        self.totals = SpecMetrics(proposer="all")
        self.swaps = 0
        self.turned_down_steps = 0  # steps where max_verify_tokens capped the proposals
        self.rollback: StateRollback | None = None  # recurrent layers' states (state_rollback.py)

    def track_states(self, pool) -> None:
        """The target has recurrent layers whose states live in ``pool``: roll them back with the KV."""
        self.rollback = StateRollback(pool)

    def set_proposer(self, proposer: Proposer | None, config: SpeculativeConfig | None = None) -> None:
        """Hot swap: requests admitted from now on use ``proposer`` (None: they do not speculate)."""
        self.proposer = proposer
        if config is not None:
            self.config = config
        self.swaps += 1

    def admit(self, seq: "Sequence") -> SpecState | None:
        """The request's speculation state, or None when it does not speculate."""
        req = seq.params.speculative
        if self.proposer is None or req is False:
            return None
        cfg = self.config
        req = req if isinstance(req, SpeculativeRequest) else SpeculativeRequest()
        state = SpecState(self.proposer,
                          max_tokens=req.num_tokens if req.num_tokens is not None else cfg.num_tokens,
                          threshold=(req.acceptance_threshold if req.acceptance_threshold is not None
                                     else cfg.acceptance_threshold),
                          adaptive=req.adaptive if req.adaptive is not None else cfg.adaptive)
        return state

    def plan(self, running: list["Sequence"], max_model_len: int) -> None:
        """Set ``seq.spec_lookahead`` (proposals the scheduler reserves KV for) of each running sequence."""
        decoding = [s for s in running if s.spec is not None and not s.in_prefill]
        for s in running:
            s.spec_lookahead = 0
        if not decoding:
            return
        cap = self.config.max_verify_tokens // len(running) - 1
        capped = False
        for s in decoding:
            want = s.spec.wanted()
            room = min(s.params.max_new_tokens - len(s.output_ids) - 1, max_model_len - s.num_tokens)
            k = max(0, min(want, cap, room, _prune_room(s)))
            capped |= want > cap
            s.spec_lookahead = k
        self.turned_down_steps += capped

    def propose(self, scheduled: list["ScheduledSeq"]) -> None:
        """Fill ``draft`` (and ``draft_probs``) of the scheduled items that reserved proposals."""
        groups: dict[int, tuple[Proposer, list["ScheduledSeq"]]] = {}
        for item in scheduled:
            if item.lookahead > 0 and item.num_tokens == item.seq.num_uncomputed:
                p = item.seq.spec.proposer
                groups.setdefault(id(p), (p, []))[1].append(item)
        for proposer, items in groups.values():
            t0 = time.perf_counter()
            drafts = proposer.propose([DraftRequest(it.seq, it.lookahead, it.seq.spec.threshold) for it in items])
            dt = time.perf_counter() - t0
            self.totals.draft_s += dt
            for it, d in zip(items, drafts):
                it.draft = list(d.tokens[:it.lookahead])
                it.draft_probs = d.probs[:len(it.draft)] if d.probs is not None else None
                it.seq.spec.metrics.draft_s += dt  # a batched proposer call counts for each of its requests
        if self.rollback is not None:
            self.rollback.take(scheduled)

    def record_verify_time(self, items: list["ScheduledSeq"], seconds: float) -> None:
        """A step's forward verified ``items``: it counts once in the totals and for each of them."""
        self.totals.verify_s += seconds
        for item in items:
            item.seq.spec.metrics.verify_s += seconds

    def verify(self, item: "ScheduledSeq", logits: torch.Tensor,
               kv: "KVManager") -> tuple[list[int] | None, str | None]:
        """:meth:`_accept`, then the recurrent states (if any) rolled back with the KV."""
        tokens, error = self._accept(item, logits, kv)
        if self.rollback is not None:
            self.rollback.settle(item, tokens, kv)
        return tokens, error

    def _accept(self, item: "ScheduledSeq", logits: torch.Tensor,
                kv: "KVManager") -> tuple[list[int] | None, str | None]:
        """Tokens a drafted sequence emits from its ``1 + len(draft)`` target logits rows, after rolling
        its KV back to them: ``(tokens, None)``. Non-finite logits undo the step (``(None, None)``: it
        is recomputed next step), at most ``recompute_depth`` times in a row; then, or when a logits
        processor raises, ``(None, error)``: the request fails alone."""
        seq, draft = item.seq, item.draft
        logits = logits.float()
        if not bool(torch.isfinite(logits).all()):
            return None, self._recompute(item, kv)
        try:
            logits = apply_processors(seq, logits, draft)
        except ProcessorError as e:
            return None, str(e)
        if seq.params.greedy:
            tokens = accept_greedy(torch.argmax(logits, dim=-1).tolist(), draft)
        else:
            tokens = accept_sampled(sampling_probs(logits, seq.params), draft, item.draft_probs, seq.generator)
        accepted = len(tokens) - 1
        for m in (seq.spec.metrics, self.totals):
            m.record(len(draft), accepted, len(tokens))
        seq.spec.update(len(draft), accepted)
        seq.spec.recomputes_in_row = 0
        kv.rollback(seq, seq.num_computed + len(tokens) - 1)
        return tokens, None

    def _recompute(self, item: "ScheduledSeq", kv: "KVManager") -> str | None:
        """Undo a verify step whose logits were not finite; the error once it happened too often in a row."""
        seq = item.seq
        kv.rollback(seq, seq.num_computed - item.num_tokens)
        seq.spec.metrics.recomputes += 1
        self.totals.recomputes += 1
        seq.spec.recomputes_in_row += 1
        if seq.spec.recomputes_in_row > self.config.recompute_depth:
            return (f"verify logits were not finite (NaN/inf) in {seq.spec.recomputes_in_row} recomputes "
                    "in a row; the model produces non-finite values for this input")
        return None

    def release(self, seq: "Sequence") -> None:
        if seq.spec is not None:
            seq.spec.proposer.release(seq)

    def stats(self, requests: list["Sequence"]) -> dict:
        """Totals, and one row per request that speculated (request id = trace id)."""
        table = []
        for s in requests:
            if s.spec is None:
                continue
            m = s.spec.metrics
            end = s.metrics.finished or time.perf_counter()
            table.append({"request_id": s.request_id, "trace_id": s.request_id, **m.as_dict(),
                          "latency_ms": (end - s.metrics.arrival) * 1e3})
        return {"method": self.config.method, "proposer": getattr(self.proposer, "name", None),
                "swaps": self.swaps, "turned_down_steps": self.turned_down_steps,
                **{k: v for k, v in self.totals.as_dict().items() if k != "proposer"}, "requests": table}


def _prune_room(seq: "Sequence") -> int:
    """Proposals a pruning sequence may make: its verified tokens must stay short of the next
    evaluation (one more plain step reaches it), so pruning sees the same queries as without speculation."""
    cfg = seq.kv_prune_config
    if cfg is None:
        return 1 << 30
    since = seq.kv_prune_state.steps_since_eval if seq.kv_prune_state is not None else 0
    return cfg.step_interval - since - 2
