"""Engine: requests in, tokens out, one scheduled step at a time.

``add_request`` validates and queues; ``step`` asks the scheduler for a plan, runs it on
the runner (a :class:`~devin_compile.runtime.runner_protocol.Runner`, normally the
ModelRunner), samples, appends tokens, and finishes requests on EOS / stop tokens /
``max_new_tokens``. ``generate`` drives steps until a batch is done; ``stream`` yields
one request's tokens as they appear; ``forward_logits`` is a full-sequence forward. A
request that fails (an invalid prompt, a logits-processor error, a pool it can never fit
in) fails alone: the others go on.

With ``enable_prefix_caching`` (the default) full KV blocks are shared between requests
with a common prefix (see :mod:`~devin_compile.runtime.prefix_cache`); after every step
the scheduler registers the blocks the step completed. ``debug_checks=True`` asserts
before every step that no slot it writes lies in a shared or registered block.
``kv_tiers`` (:class:`~devin_compile.runtime.kv_tiers.KVTiers`) keeps evicted prefix blocks below the pool.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Iterator, Sequence as Seq

import torch

from . import py_arena_cache
from ..config import SchedulerConfig
from ..config import KVPruneConfig
from .engine_metrics import SLOT_SAMPLE_EVERY, EngineMetrics, slot_usage
from .kv_cache import BlockAllocator
from .kv_prune import KVPruner, resolve_request
from .kv_tiers import KVTiers
from .logprobs import TokenLogprob, log_probs, token_logprobs
from .prefix_cache import PrefixCache
from .request_output import RequestError, RequestOutput
from .runner_protocol import Runner
from .sampling import SamplingParams, sample_batch
from .scheduler import Scheduler
from .speculative import SpeculativeDecoder
from .sequence import Sequence, Status
from .step_info import StepInfo

log = logging.getLogger(__name__)


class Engine:
    """Requests in, tokens out over ``runner``.

    ``kv_prune`` is the model's KV-pruning setting, resolved once by ``optimize()``: None
    when the decode graph has no ``devin::kv_prune`` nodes (no request may prune), else the
    configuration the nodes were compiled with (requests prune with it by default when it is
    ``enabled``; see :func:`~devin_compile.runtime.kv_prune.resolve_request`).
    """

    def __init__(self, runner: Runner, config: SchedulerConfig, *, max_model_len: int,
                 eos_token_ids: Seq[int] = (), tokenizer=None, enable_prefix_caching: bool = True,
                 debug_checks: bool = False, kv_prune: KVPruneConfig | None = None,
                 kv_tiers: KVTiers | None = None, speculative: SpeculativeDecoder | None = None) -> None:
        if kv_prune is not None and not isinstance(kv_prune, KVPruneConfig):
            raise TypeError(f"Engine(kv_prune=) takes a KVPruneConfig or None (resolved by optimize()), "
                            f"got {type(kv_prune).__name__}")
        # CPython < 3.13 maps and unmaps a frame-stack chunk per call across a chunk boundary;
        # a decode loop can sit on one (see runtime/py_arena_cache.py).
        py_arena_cache.install()
        self.runner = runner
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.tokenizer = tokenizer
        self.debug_checks = debug_checks
        if kv_tiers is not None and (not enable_prefix_caching or kv_tiers.pool is not runner.kv_cache):
            raise ValueError("kv_tiers need prefix caching on and must be built over this runner's KV pool")
        self.kv_tiers = kv_tiers
        self.prefix_cache = PrefixCache(runner.block_size) if enable_prefix_caching else None
        self.allocator = BlockAllocator(runner.kv_cache.num_blocks, self.prefix_cache,
                                        on_evict=kv_tiers.publish if kv_tiers is not None else None)
        self.scheduler = Scheduler(config, self.allocator, runner.block_size, kv_tiers)
        self.kv_prune = kv_prune
        self.pruner = (KVPruner(kv_prune, self.allocator, self.scheduler, runner.kv_cache, runner.backend)
                       if kv_prune is not None else None)
        self.spec = speculative
        self.requests: dict[str, Sequence] = {}
        self.metrics = EngineMetrics()
        self.step_hooks: list = []
        self._ids = itertools.count()

    # -- request API ------------------------------------------------------
    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; raises ``ValueError`` (and changes nothing) if it is invalid."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = self._encode(prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests and not self.requests[rid].status.done:
            raise ValueError(f"request id {rid!r} is already in flight")
        total = len(ids) + params.max_new_tokens
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"request {rid}: prompt has {len(ids)} tokens but the model's context is {self.max_model_len}; "
                "shorten the prompt"
            )
        if total > self.max_model_len:
            raise ValueError(
                f"request {rid}: prompt ({len(ids)}) + max_new_tokens ({params.max_new_tokens}) = {total} tokens "
                f"exceeds the model's context of {self.max_model_len}; lower max_new_tokens or shorten the prompt"
            )
        pool_tokens = self.allocator.num_blocks * self.runner.block_size
        if total > pool_tokens:
            raise ValueError(
                f"request {rid}: needs {total} KV slots but the whole KV pool holds {pool_tokens}; "
                "raise kv_cache_memory / num_kv_blocks or lower max_new_tokens"
            )
        try:
            kv_prune = self.check_params(params)
        except ValueError as e:
            raise ValueError(f"request {rid}: {e}") from None
        seq = Sequence(rid, ids, params, generator=params.make_generator(), kv_prune_config=kv_prune)
        if self.spec is not None:
            seq.spec = self.spec.admit(seq)
            if seq.spec is not None:
                seq.metrics.spec = seq.spec.metrics
        self.requests[rid] = seq
        self.scheduler.add(seq)
        return rid

    def check_params(self, params: SamplingParams) -> KVPruneConfig | None:
        """``ValueError`` unless this engine can run a request with ``params`` (KV pruning, speculation
        it does not have); returns the request's resolved KV-pruning setting."""
        if params.speculative not in (None, False) and (self.spec is None or self.spec.proposer is None):
            raise ValueError("SamplingParams.speculative is set but this model has no speculative decoding; pass "
                             "speculative={'method': 'ngram'} (or draft/head) to optimize()")
        return resolve_request(self.kv_prune, params)

    def abort(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is None or seq.status.done:
            return
        self.scheduler.release(seq)
        self._finish(seq, Status.ABORTED, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def add_step_hook(self, fn) -> None:
        """Call ``fn(StepInfo)`` after every step that ran a batch (on the stepping thread; see
        :mod:`~devin_compile.runtime.step_info`). Without hooks no StepInfo is built. A hook that
        raises is logged and removed (the step's requests go on)."""
        self.step_hooks.append(fn)

    # -- stepping ---------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        spec = self.spec
        if spec is not None:
            spec.plan(self.scheduler.running, self.max_model_len)
        plan = self.scheduler.schedule()
        outputs: dict[str, RequestOutput] = {}
        for seq, message in plan.failed:
            self.scheduler.release(seq)
            self._finish(seq, Status.FAILED, "error", message)
            outputs[seq.request_id] = self._output(seq, [])
        self.metrics.preemptions += len(plan.preempted)
        if not plan.scheduled:
            return list(outputs.values())
        now = time.perf_counter()
        for item in plan.scheduled:
            if item.seq.metrics.first_scheduled is None:
                item.seq.metrics.first_scheduled = now
        is_decode = all(item.num_tokens == 1 for item in plan.scheduled)
        if self.debug_checks:
            self.scheduler.check_writes(plan)
        t0 = time.perf_counter()
        if spec is not None:
            spec.propose(plan.scheduled)
        t_fwd = time.perf_counter()
        prune_step = self.pruner.begin(plan.scheduled) if self.pruner is not None else None
        logits, owners = self.runner.execute(plan.scheduled, prune_step)
        t_fwd = time.perf_counter() - t_fwd
        for item in plan.scheduled:
            item.seq.num_computed += item.num_tokens
            if not item.draft:
                self.scheduler.commit(item.seq)  # a drafted sequence registers after verification
        if prune_step is not None:
            self.pruner.finish(prune_step)
        plain_rows, drafted = [], []
        for i, (first, count) in _row_groups(owners):
            item = plan.scheduled[i]
            if item.draft:
                drafted.append((item, first, count))
            else:
                plain_rows.append((first, item.seq))
        # (sequence, tokens to append or None, drafted?, their TokenLogprobs or None)
        emitted: list[tuple[Sequence, list[int] | None, bool, list[TokenLogprob] | None]] = []
        with torch.inference_mode():
            rows = logits if not drafted else logits[[r for r, _ in plain_rows]]
            seqs = [s for _, s in plain_rows]
            want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
            logp = log_probs(rows[want]) if want else None  # before processors edit the rows in place
            plain = self._sample(rows, seqs)
            lps = _row_logprobs(logp, want, seqs, plain)
            emitted.extend((s, None if tok is None else [tok], False, lps.get(i))
                           for i, (s, tok) in enumerate(zip(seqs, plain)))
            if drafted:
                spec.totals.verify_s += t_fwd
            for item, first, count in drafted:
                item.seq.spec.metrics.verify_s += t_fwd
                k = item.seq.params.logprobs
                logp = log_probs(logits[first:first + count]) if k is not None else None
                toks = self._verify(item, logits[first:first + count])
                if prune_step is not None:  # KV pruning scores and counts the verified rows only
                    prune_step.commit(item.seq, None if toks is None else len(toks) - 1)
                # token j of a verify step comes from row j (accepted proposals, then the target's own)
                lps = token_logprobs(logp, toks, [k] * len(toks)) if toks and logp is not None else None
                emitted.append((item.seq, toks, True, lps))
        dt = time.perf_counter() - t0
        self.metrics.steps += 1
        if self.metrics.steps % SLOT_SAMPLE_EVERY == 1:
            live, allocated = self._slot_usage()
            self.metrics.live_slots_sampled += live
            self.metrics.allocated_slots_sampled += allocated
        if is_decode:
            self.metrics.decode_time += dt
            self.metrics.decode_tokens += sum(len(t) for _, t, _, _ in emitted if t)
        else:
            self.metrics.prefill_time += dt
            self.metrics.prefill_tokens += plan.num_tokens
        now = time.perf_counter()
        for seq, toks, was_drafted, lps in emitted:
            if not toks:  # failed (e.g. a logits processor raised) or recomputed next step
                outputs[seq.request_id] = self._output(seq, [])
                continue
            new = []
            for j, tok in enumerate(toks):
                seq.output_ids.append(tok)
                if lps is not None:
                    seq.logprobs.append(lps[j])
                seq.metrics.token_times.append(now)
                if seq.metrics.first_token is None:
                    seq.metrics.first_token = now
                new.append(tok)
                reason = self._stop_reason(seq, tok)
                if reason:
                    self.scheduler.release(seq)
                    self._finish(seq, Status.FINISHED, reason)
                    break
            if was_drafted:
                self.scheduler.commit(seq)  # verified tokens only: the rollback already dropped the rest
            outputs[seq.request_id] = self._output(seq, new)
        if self.step_hooks:
            self._call_hooks(plan.scheduled, emitted, started)
        return list(outputs.values())

    def _call_hooks(self, scheduled, emitted, started: float) -> None:
        info = StepInfo(
            index=self.metrics.steps, start=started, end=time.perf_counter(),
            request_ids=tuple(it.seq.request_id for it in scheduled),
            request_tokens=tuple(it.num_tokens + len(it.draft) for it in scheduled),
            prefill_tokens=sum(it.num_tokens for it in scheduled if it.num_tokens > 1),
            decode_tokens=sum(1 for it in scheduled if it.num_tokens == 1),
            drafted_tokens=sum(len(it.draft) for it in scheduled),
            accepted_tokens=sum(len(t) - 1 for _, t, d, _ in emitted if d and t))
        for fn in list(self.step_hooks):
            try:
                fn(info)
            except Exception:  # noqa: BLE001  (a hook failing must not fail the requests: it is dropped)
                log.exception("step hook %r raised; it is removed", fn)
                self.step_hooks.remove(fn)

    def _verify(self, item, logits: torch.Tensor) -> list[int] | None:
        """Speculation: the tokens a drafted sequence emits, after rolling its KV back to them.
        Non-finite logits: the step is undone (recomputed next step), at most ``recompute_depth``
        times in a row, then the request fails alone."""
        seq = item.seq
        start = seq.num_computed - item.num_tokens
        try:
            tokens = self.spec.verify(item, logits, self._process_draft_rows)
        except _ProcessorError as e:
            self.scheduler.release(seq)
            self._finish(seq, Status.FAILED, "error", str(e))
            return None
        if tokens is None:
            self.scheduler.rollback(seq, start)
            seq.spec.metrics.recomputes += 1
            self.spec.totals.recomputes += 1
            seq.spec.recomputes_in_row += 1
            if seq.spec.recomputes_in_row > self.spec.config.recompute_depth:
                self.scheduler.release(seq)
                self._finish(seq, Status.FAILED, "error",
                             f"verify logits were not finite (NaN/inf) in {seq.spec.recomputes_in_row} recomputes "
                             "in a row; the model produces non-finite values for this input")
            return None
        self.scheduler.rollback(seq, seq.num_computed + len(tokens) - 1)
        return tokens

    @staticmethod
    def _process_draft_rows(seq: Sequence, draft: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Apply the request's logits processors to each verify row, with the proposals before it as context."""
        if not seq.params.logits_processors:
            return logits
        ids = seq.all_ids
        try:
            for j in range(logits.shape[0]):
                x = logits[j]
                for proc in seq.params.logits_processors:
                    x = proc(ids + draft[:j], x)
                logits[j] = x
        except Exception as e:  # noqa: BLE001  (a user callback failing fails only its request)
            raise _ProcessorError(f"logits processor raised {type(e).__name__}: {e}") from None
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int | None]:
        if not seqs:
            return []
        logits = logits.float()
        ok: list[int] = []
        for row, seq in enumerate(seqs):
            if seq.params.logits_processors:
                try:
                    x = logits[row]
                    for proc in seq.params.logits_processors:
                        x = proc(seq.all_ids, x)
                    logits[row] = x
                except Exception as e:  # noqa: BLE001  (a user callback failing fails only its request)
                    self.scheduler.release(seq)
                    self._finish(seq, Status.FAILED, "error", f"logits processor raised {type(e).__name__}: {e}")
                    continue
            ok.append(row)
        picked = sample_batch(logits[ok], [seqs[r].params for r in ok], [seqs[r].generator for r in ok])
        out: list[int | None] = [None] * len(seqs)
        for r, tok in zip(ok, picked):
            out[r] = tok
        return out

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and (tok in self.eos_token_ids or tok in p.stop_token_ids):
            return "stop"
        if len(seq.output_ids) >= p.max_new_tokens:
            return "length"
        return None

    def _finish(self, seq: Sequence, status: Status, reason: str, error: str | None = None) -> None:
        if self.spec is not None:
            self.spec.release(seq)
        seq.status = status
        seq.finish_reason = reason
        seq.error = error
        seq.metrics.finished = time.perf_counter()

    def _output(self, seq: Sequence, new: list[int]) -> RequestOutput:
        lps = seq.logprobs
        return RequestOutput(seq.request_id, seq.prompt_ids, list(seq.output_ids), new, seq.status.done,
                             seq.finish_reason, seq.error, seq.metrics,
                             None if lps is None else list(lps), None if lps is None else lps[len(lps) - len(new):])

    def _encode(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: pass tokenizer= to optimize()")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, torch.Tensor):
            ids = prompt.flatten().tolist()
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        vocab = self.runner.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        return ids

    # -- drivers ----------------------------------------------------------
    def generate(self, prompts: Seq[str | Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, raise_on_error: bool = False) -> list[RequestOutput]:
        """Run a batch to completion; results in prompt order.

        An invalid prompt rejects the whole batch (``ValueError`` naming it, ``prompt i: ...``;
        nothing stays queued). A request that fails mid-way carries ``error`` in its result, or,
        with ``raise_on_error``, makes the batch raise :class:`RequestError` with every result
        in ``.results``.
        """
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.add_request(p, sp))
        except ValueError as e:
            for rid in ids:  # an invalid prompt rejects the whole batch: leave nothing queued
                self.abort(rid)
            raise ValueError(f"prompt {len(ids)}: {e}") from None
        while any(not self.requests[r].status.done for r in ids):
            if not self.step():
                self.wait_for_admission()
        results = [self._output(self.requests[r], []) for r in ids]
        failed = [r for r in results if r.error]
        if raise_on_error and failed:
            raise RequestError(failed[0].request_id, "; ".join(f"{r.request_id}: {r.error}" for r in failed),
                               results)
        return results

    def forward_logits(self, prompt: str | Seq[int]) -> torch.Tensor:
        """Logits at every position of one token sequence [T, vocab] (a full-sequence forward:
        no request, no sampling); its KV blocks are borrowed from the pool for the call
        (``KVCacheExhaustedError`` if none are free). ``ValueError`` for an invalid sequence."""
        ids = self._encode(prompt)
        blocks = self.allocator.allocate(self.scheduler.blocks_needed(len(ids)))
        try:
            return self.runner.forward_logits(ids, blocks)
        finally:
            self.allocator.free(blocks)

    def wait_for_admission(self, limit_s: float = 0.05) -> None:
        """Nothing ran this step because dynamic batching holds the waiting requests back:
        sleep until the oldest one's ``max_wait_ms`` runs out (at most ``limit_s``)."""
        sched = self.scheduler
        if sched.waiting and not sched.running and not sched.admission_open():
            time.sleep(max(0.0, min(limit_s, sched.admission_deadline() - time.perf_counter())))

    def stream(self, request_id: str) -> Iterator[int]:
        """Yield ``request_id``'s new tokens as steps produce them (drives the engine)."""
        seq = self.requests[request_id]
        sent = 0
        while True:
            while sent < len(seq.output_ids):
                yield seq.output_ids[sent]
                sent += 1
            if seq.status.done:
                if seq.status is Status.FAILED:
                    raise RequestError(request_id, seq.error or "failed")
                return
            if not self.step():
                self.wait_for_admission()

    def set_proposer(self, proposer, config=None) -> None:
        """Hot swap the speculative proposer (a :class:`~devin_compile.runtime.speculative.Proposer`, or
        None: off): requests admitted from now on use it; those in flight finish on the one they have."""
        if self.spec is None:
            if proposer is None:
                return
            if config is None:
                raise ValueError("this engine has no speculation yet: give the SpeculativeConfig with the proposer")
            self.spec = SpeculativeDecoder(config, proposer)
            return
        self.spec.set_proposer(proposer, config)

    def spec_stats(self) -> dict:
        """Speculation totals and a per-request table (request id = trace id); {} without speculation."""
        if self.spec is None:
            return {}
        return self.spec.stats(list(self.requests.values()))

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (e.g. so a benchmark repeat prefills cold);
        returns how many were dropped (not published: the KV tiers keep only what they had).
        Blocks held by running requests stay registered."""
        return self.allocator.evict_cached()

    def _slot_usage(self) -> tuple[int, int]:
        """(slots holding live tokens, slots in blocks held by requests); a shared block counts once."""
        return slot_usage(self.scheduler.running, self.runner.block_size)

    def kv_stats(self) -> dict:
        """Pool occupancy, prefix-cache counters, and the KV tiers' (``kv_tiers``: one dict per tier).

        ``blocks_free`` includes ``blocks_cached_free`` (cached, unreferenced, evictable);
        ``blocks_cached`` counts every registered block, referenced or not.
        """
        a = self.allocator
        live, slots = self._slot_usage()
        padded_keys = self.runner.attention_padded_keys
        stats = {
            "blocks_total": a.num_blocks, "blocks_used": a.num_used, "blocks_free": a.num_free,
            "blocks_used_peak": a.peak_used,
            "bytes_per_token": self.runner.kv_cache.spec.bytes_per_token,
            "pool_bytes": a.num_blocks * self.runner.block_size * self.runner.kv_cache.spec.bytes_per_token,
            "live_slot_fraction": (live / slots) if slots else 1.0,
            "mean_live_slot_fraction": self.metrics.mean_live_slot_fraction,
            # length-aware grouping of batched decode attention: fraction of the keys read that were padding
            "attention_padding_waste": (1 - self.runner.attention_real_keys / padded_keys)
            if padded_keys else 0.0,
            "prefix_caching": self.prefix_cache is not None,
            "blocks_cached": 0, "blocks_cached_free": 0,
            "prefix_query_tokens": 0, "prefix_hit_tokens": 0, "prefix_hit_rate": 0.0,
            "prefix_evictions": 0, "prefix_rejected": 0, "prefix_deduplicated": 0,
        }
        if self.prefix_cache is not None:
            ps = self.prefix_cache.stats
            stats.update({
                "blocks_cached": len(self.prefix_cache), "blocks_cached_free": a.num_cached_free,
                "prefix_query_tokens": ps.query_tokens, "prefix_hit_tokens": ps.hit_tokens,
                "prefix_hit_rate": (ps.hit_tokens / ps.query_tokens) if ps.query_tokens else 0.0,
                "prefix_evictions": ps.evictions, "prefix_rejected": ps.rejected,
                "prefix_deduplicated": ps.deduplicated,
            })
        if self.pruner is not None:
            stats.update(self.pruner.stats())
        if self.kv_tiers is not None:
            stats.update(self.kv_tiers.stats())
        return stats


class _ProcessorError(Exception):
    pass


def _row_logprobs(logp: torch.Tensor | None, want: list[int], seqs: list[Sequence],
                  picked: list[int | None]) -> dict[int, list[TokenLogprob]]:
    """Row → [TokenLogprob of its sampled token], for the rows ``want`` (``logp``: their log-probabilities)
    that sampled one."""
    ok = [j for j, i in enumerate(want) if picked[i] is not None]
    if not ok:
        return {}
    rows = [want[j] for j in ok]
    lps = token_logprobs(logp[ok], [picked[i] for i in rows], [seqs[i].params.logprobs for i in rows])
    return {i: [lp] for i, lp in zip(rows, lps)}


def _row_groups(owners: list[int]) -> Iterator[tuple[int, tuple[int, int]]]:
    """(batch index, (first row, row count)) for each run of equal owners (a drafted sequence owns several)."""
    i = 0
    while i < len(owners):
        j = i
        while j + 1 < len(owners) and owners[j + 1] == owners[i]:
            j += 1
        yield owners[i], (i, j - i + 1)
        i = j + 1
