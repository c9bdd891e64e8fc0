"""Dynamic KV-cache pruning: attention scores → eviction policy → compaction → freed pages.

Flow of one pure-decode step (the ``decode`` graph, which carries one ``devin::kv_prune``
node after each ``devin::paged_attention``, see ``passes/insert_kv_prune.py``):

1. :meth:`KVPruner.begin` (engine, before the forward) picks the sequences that prune, bumps
   their step counters and decides which of them *evaluate* this step (every
   ``step_interval`` decode steps). It returns a :class:`PruneStep`, installed in the step
   context (``StepContext.kv_prune``); with no pruning sequence it returns None and the ops
   do nothing beyond one attribute check.
2. ``devin::paged_attention`` asks a backend that can (``forward_with_scores``: torch
   reference and Triton on every decode step; CPU SDPA, whose ``scores_every_step`` is
   False, on evaluation steps only) for the attention mass side output; ``devin::kv_prune``
   (layer ``l``) takes it, or on evaluation steps recomputes it from ``q`` and the cache for
   backends that cannot (FlashAttention), and folds it into each sequence's score
   accumulator (:meth:`PruneStep.accumulate`).
3. :meth:`KVPruner.finish` (engine, after the forward) evaluates: policy, then compaction.

**Scores.** For sequence b at layer l the backend gives ``a[h, j]``: the softmax mass of the
step's query on cached slot ``j``, summed over the ``G`` query heads sharing KV head ``h``.
The normalised score of one observation is ``max_h (a[h, j] / G) · n_live``: the largest
per-KV-head mean attention times the number of live slots, so **1.0 means uniform
attention** at any context length. A token's score is the mean over the steps that observed
it (every decode step with a side output from a backend with ``scores_every_step``,
evaluation steps only otherwise).

**Policy.** The first ``sink_tokens`` positions and the last ``recent_tokens`` positions are
never evicted. ``count`` = the mean over layers of the number of other tokens scoring below
``threshold`` (policy ``attention``), raised to meet ``max_tokens`` /
``ceil(max_ratio · positions)`` live tokens, and bounded by what is evictable. Every layer
evicts exactly ``count`` tokens, its own lowest-scoring ones (``streaming``: the oldest;
``random``: a seeded random choice; the first ``recency_layers`` fraction of the layers: the
oldest, whatever the policy), so all layers keep equal slot counts and share one block table.

**Compaction.** Decode attends to every slot below ``seq_len``, so slot order within a
sequence is free: kept tokens from the tail ``[m, n)`` (``m = n - count``) move into the
holes left in ``[0, m)``, per layer (few moves in steady state, no full rewrite). Slots keep
their true rotary positions (baked into K) and new tokens continue from the true position
(``Sequence.num_evicted`` separates slots from positions). Blocks at and past
``ceil(m / block_size)`` go back to the allocator. A block about to be written (a hole or
the next append) that is shared (reference count > 1) is first copied to a fresh block (if no
block is free the evaluation is skipped); one registered in the prefix cache is copied too
while spare blocks last, so its entry keeps serving later hits, else unregistered (its content
no longer matches its hash). The sequence then stops registering blocks. Unchanged blocks
stay shared and registered.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..config import KVPruneConfig

if TYPE_CHECKING:
    from .kv_cache import BlockAllocator, PagedKVCache
    from .scheduler import ScheduledSeq, Scheduler
    from .sequence import Sequence

# -- enabling: decorator / context manager ------------------------------------------------

_ACTIVE: contextvars.ContextVar[KVPruneConfig | None] = contextvars.ContextVar("devin_kv_prune", default=None)


class enable_kv_pruning(contextlib.ContextDecorator):
    """Turn KV pruning on for the calls inside (decorator or ``with`` block).

    ``@devin_compile.enable_kv_pruning(threshold=0.05, step_interval=2)`` on a function that
    generates: requests added inside it prune with these settings (unless their
    ``SamplingParams.kv_prune`` says otherwise), and ``optimize()`` called inside it without
    ``kv_prune=`` compiles the pruning nodes with them. A model optimized without
    ``kv_prune=`` outside the block has no pruning nodes; adding a request to it inside the
    block is a ``ValueError``.
    """

    def __init__(self, **settings: Any) -> None:
        self.config = KVPruneConfig.coerce(dict(settings), "enable_kv_pruning") or KVPruneConfig()
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> KVPruneConfig:
        self._tokens.append(_ACTIVE.set(self.config))
        return self.config

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.reset(self._tokens.pop())


def active_config() -> KVPruneConfig | None:
    """The configuration of the innermost active :class:`enable_kv_pruning`, if any."""
    return _ACTIVE.get()


def has_kv_prune_nodes(program: Any) -> bool:
    """Whether ``program`` (a Program, or None for runners without one) has a decode graph with kv_prune nodes."""
    gm = getattr(program, "graphs", {}).get("decode")
    if gm is None:
        return False
    target = torch.ops.devin.kv_prune.default
    return any(n.op == "call_function" and n.target is target for n in gm.graph.nodes)


def resolve_request(pruner: "KVPruner | None", params: Any) -> KVPruneConfig | None:
    """The pruning configuration of a new request (``ValueError`` if it cannot prune here).

    Order: ``params.kv_prune`` (False: off) > active :func:`enable_kv_pruning` > the engine's
    ``optimize(kv_prune=...)`` configuration when ``enabled``.
    """
    explicit = getattr(params, "kv_prune", None)
    if explicit is False:
        return None
    cfg = KVPruneConfig.coerce(explicit, "SamplingParams.kv_prune") if explicit is not None else active_config()
    if cfg is None and pruner is not None and pruner.default is not None and pruner.default.enabled:
        cfg = pruner.default
    if cfg is not None and pruner is None:
        where = "SamplingParams.kv_prune" if explicit is not None else "enable_kv_pruning"
        raise ValueError(f"{where} asks for KV pruning but this model was optimized without kv_prune=, so its "
                         "decode graph has no devin::kv_prune nodes; optimize(model, kv_prune={...}) (or "
                         "call optimize() inside enable_kv_pruning)")
    return cfg


# -- per-sequence state ---------------------------------------------------------------


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


# -- one step -------------------------------------------------------------------------


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

    @property
    def score_row_ids(self) -> list[int]:
        return [b for b, _ in self.score_rows]

    def accumulate(self, layer: int, scores: dict[int, torch.Tensor], group: int) -> None:
        """Fold one layer's attention mass (batch row → [Hkv, L], summed over the group's query heads)."""
        for b, seq in self.score_rows:
            a = scores.get(b)
            if a is None:
                continue
            st: PruneState = seq.kv_prune_state
            n = a.shape[-1]
            st.ensure(n, seq.num_evicted)
            norm = a.float().amax(dim=0) * (n / group)
            st.score_sum[layer, :n] += norm
            st.obs[layer, :n] += 1
        self.layers_scored += 1

    def accumulate_window(self, layer: int, b: int, seq: "Sequence", score_sum: torch.Tensor,
                          obs: torch.Tensor) -> None:
        """Fold the prefill observation window of one row: summed normalised scores and observation counts [L]."""
        st: PruneState = seq.kv_prune_state
        n = score_sum.shape[-1]
        st.ensure(n, seq.num_evicted)
        st.score_sum[layer, :n] += score_sum
        st.obs[layer, :n] += obs


def pool_by_position(scores: torch.Tensor, positions: torch.Tensor, kernel: int) -> torch.Tensor:
    """Max of each slot's score over itself and the ``kernel - 1`` live tokens before it in position (per layer).

    Forward-looking: the tokens that follow a strongly attended one are kept with it (the span
    an induction/copy head reads next). Slots are not in position order after compaction, so
    sort by position, max-pool, unsort.
    """
    order = positions.argsort(dim=1)
    s = scores.gather(1, order)
    unobserved = torch.isinf(s)  # stay +inf themselves, lend nothing to their neighbours
    padded = torch.nn.functional.pad(s.masked_fill(unobserved, 0.0)[:, None], (kernel - 1, 0))
    pooled = torch.nn.functional.max_pool1d(padded, kernel, stride=1)[:, 0].masked_fill(unobserved, math.inf)
    out = torch.empty_like(scores)
    out.scatter_(1, order, pooled)
    return out


# -- the pruner -----------------------------------------------------------------------


@dataclass
class PruneTotals:
    evaluations: int = 0
    evicted_tokens: int = 0
    freed_blocks: int = 0
    copied_blocks: int = 0  # shared blocks (reference count > 1) copied before compaction wrote to them
    copied_cached_blocks: int = 0  # registered blocks of ours alone copied, so the prefix cache keeps them
    unregistered_blocks: int = 0  # prefix-cache entries dropped because compaction changed them
    skipped_no_space: int = 0  # evaluations skipped: no free block for a copy-on-write


class KVPruner:
    """Owns the policy and compaction; the engine calls :meth:`begin` and :meth:`finish` each step."""

    def __init__(self, default: KVPruneConfig | None, allocator: "BlockAllocator", scheduler: "Scheduler",
                 kv_cache: "PagedKVCache", backend: Any) -> None:
        self.default = default
        self.allocator = allocator
        self.scheduler = scheduler
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
        eval_rows, score_rows = [], []
        for b, seq in rows:
            st: PruneState = seq.kv_prune_state
            st.steps_since_eval += 1
            evaluate = st.steps_since_eval >= st.config.step_interval
            if evaluate:
                eval_rows.append((b, seq))
            if st.config.policy == "attention" and (evaluate or every_step):
                score_rows.append((b, seq))
        return PruneStep(rows, eval_rows, score_rows, side_output=side_capable and bool(score_rows))

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
                live = seq.num_computed - seq.num_evicted
                if seq.kv_prune_state is not None:
                    seq.kv_prune_state.ensure(live, seq.num_evicted)
                seq.metrics.kv_live_tokens = live

    # -- policy ---------------------------------------------------------------------
    def eviction_count(self, seq: "Sequence", protected: torch.Tensor, mean: torch.Tensor | None) -> int:
        cfg: KVPruneConfig = seq.kv_prune_state.config
        n = protected.shape[1]
        evictable = n - int(protected[0].sum())
        if evictable <= 0:
            return 0
        count = 0
        if mean is not None and cfg.threshold > 0:
            below = (mean < cfg.threshold) & ~protected
            count = int(below.sum(dim=1).float().mean().floor())
        cap = math.inf
        if cfg.max_tokens is not None:
            cap = cfg.max_tokens
        if cfg.max_ratio is not None:
            cap = min(cap, math.ceil(cfg.max_ratio * seq.num_computed))
        if cap < n:
            count = max(count, n - int(cap))
        return min(count, evictable)

    def _evaluate(self, seq: "Sequence") -> None:
        st: PruneState = seq.kv_prune_state
        cfg = st.config
        n = seq.num_computed - seq.num_evicted
        st.ensure(n, seq.num_evicted)
        pos = st.positions[:, :n]
        protected = (pos < cfg.sink_tokens) | (pos >= seq.num_computed - cfg.recent_tokens)
        mean = st.mean_scores() if cfg.policy == "attention" else None
        if mean is not None and cfg.pool_kernel > 1:
            mean = pool_by_position(mean, pos, cfg.pool_kernel)
        count = self.eviction_count(seq, protected, mean)
        self.totals.evaluations += 1
        seq.metrics.kv_prune_evaluations += 1
        if count <= 0:
            return
        if cfg.policy == "attention":
            key = mean.clone()
            key[torch.isinf(key)] = 1e30  # never observed: evicted last among the unprotected
        elif cfg.policy == "streaming":
            key = pos.float()
        else:
            key = torch.rand(pos.shape, generator=st.generator).to(pos.device)
        recency = cfg.num_recency_layers(self.num_layers)
        if recency:
            key[:recency] = pos[:recency].float()
        key = key.masked_fill(protected, math.inf)
        idx = torch.topk(key, count, dim=1, largest=False).indices
        evict = torch.zeros_like(protected)
        evict.scatter_(1, idx, True)
        self.compact(seq, evict)

    # -- compaction -----------------------------------------------------------------
    def compact(self, seq: "Sequence", evict: torch.Tensor) -> bool:
        """Drop the slots marked in ``evict`` ([layers, n] bool, the same count per layer) and free pages.

        Returns False (and changes nothing) when a needed copy-on-write finds no free block.
        """
        st: PruneState = seq.kv_prune_state
        alloc, bs = self.allocator, self.block_size
        n = evict.shape[1]
        count = int(evict[0].sum())
        if count == 0:
            return True
        if not bool((evict.sum(dim=1) == count).all()):
            raise RuntimeError("kv_prune: every layer must evict the same number of slots")
        m = n - count
        keep = ~evict
        hole_l, hole_s = (~keep[:, :m]).nonzero(as_tuple=True)  # row-major: by layer, then slot
        tail_l, tail_s = keep[:, m:].nonzero(as_tuple=True)
        tail_s = tail_s + m
        table = list(seq.block_table)
        new_nb = (m + bs - 1) // bs
        written = set((hole_s // bs).unique().tolist())
        if m % bs:
            written.add(m // bs)  # the next token is appended there
        written = sorted(j for j in written if j < new_nb)
        cache = alloc.prefix_cache
        shared = [j for j in written if alloc.ref_count[table[j]] > 1]
        registered = [j for j in written if alloc.ref_count[table[j]] == 1 and cache is not None and table[j] in cache]
        trailing = table[new_nb:]
        spare = alloc.num_free + sum(1 for b in trailing if alloc.ref_count[b] == 1)
        if len(shared) > spare:
            self.totals.skipped_no_space += 1
            return False
        keep_registered = set(registered[:spare - len(shared)])  # copy these too, so their cache entries live on
        data = self.kv_cache.data  # [layers, 2, blocks, bs, Hkv, D]
        flat = data.view(data.shape[0], 2, -1, *data.shape[4:])
        tbl = torch.tensor(table, dtype=torch.long, device=data.device)
        moved = flat[tail_l, :, tbl[tail_s // bs] * bs + tail_s % bs]  # gathered before any block is reused
        freed = sum(1 for b in trailing if alloc.ref_count[b] == 1)  # a shared one only loses our reference
        alloc.free(trailing)
        for j in written:
            b = table[j]
            shared_b = alloc.ref_count[b] > 1
            if shared_b or j in keep_registered:  # shared or cached: copy, never edit in place
                (nb,) = alloc.allocate(1)
                data[:, :, nb] = data[:, :, b]
                alloc.free([b])
                table[j] = nb
                if shared_b:
                    self.totals.copied_blocks += 1
                else:
                    self.totals.copied_cached_blocks += 1
            elif cache is not None and b in cache:  # ours alone, registered, no spare block: its hash no longer holds
                cache.evict(b)
                self.totals.unregistered_blocks += 1
        tbl = torch.tensor(table, dtype=torch.long, device=data.device)
        flat[hole_l, :, tbl[hole_s // bs] * bs + hole_s % bs] = moved
        for a in (st.positions, st.score_sum, st.obs):
            a[hole_l, hole_s] = a[tail_l, tail_s]
        st.n = m
        seq.block_table = table[:new_nb]
        seq.num_evicted += count
        seq.metrics.kv_evicted_tokens += count
        seq.metrics.kv_freed_blocks += freed
        self.totals.evicted_tokens += count
        self.totals.freed_blocks += freed
        self.scheduler.stop_prefix_registration(seq)
        return True

    def stats(self) -> dict:
        t = self.totals
        live = sum(s.num_computed - s.num_evicted for s in self.scheduler.running)
        return {"kv_prune_evaluations": t.evaluations, "kv_prune_evicted_tokens": t.evicted_tokens,
                "kv_prune_freed_blocks": t.freed_blocks, "kv_prune_copied_blocks": t.copied_blocks,
                "kv_prune_copied_cached_blocks": t.copied_cached_blocks,
                "kv_prune_unregistered_blocks": t.unregistered_blocks,
                "kv_prune_skipped_no_space": t.skipped_no_space, "kv_live_tokens": live}

