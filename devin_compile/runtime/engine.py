"""Engine: requests in, tokens out, one scheduled step at a time.

``add_request`` validates and queues; ``step`` asks the scheduler for a plan, runs it on
the ModelRunner, samples, appends tokens, and finishes requests on EOS / stop tokens /
``max_new_tokens``. ``generate`` drives steps until a batch is done; ``stream`` yields
one request's tokens as they appear. A request that fails (an invalid prompt, a
logits-processor error, a pool it can never fit in) fails alone: the others go on.

With ``enable_prefix_caching`` (the default) full KV blocks are shared between requests
with a common prefix (see :mod:`~devin_compile.runtime.prefix_cache`); after every step
the scheduler registers the blocks the step completed. ``debug_checks=True`` asserts
before every step that no slot it writes lies in a shared or registered block.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence as Seq

import torch

from . import py_arena_cache
from ..config import SchedulerConfig
from ..config import KVPruneConfig
from .kv_cache import BlockAllocator
from .kv_prune import KVPruner, has_kv_prune_nodes, resolve_request
from .model_runner import ModelRunner
from .prefix_cache import PrefixCache
from .sampling import SamplingParams, sample_batch
from .scheduler import Scheduler
from .sequence import Sequence, Status


class RequestError(RuntimeError):
    """A request failed; ``.request_id`` names it and the message says why."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id}: {message}")
        self.request_id = request_id


@dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    new_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    metrics: object = None


@dataclass
class EngineMetrics:
    steps: int = 0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    # KV memory accounting, sampled every SLOT_SAMPLE_EVERY steps: live tokens vs allocated slots
    live_slots_sampled: int = 0
    allocated_slots_sampled: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def mean_live_slot_fraction(self) -> float:
        """Over the run: of the KV slots allocated to requests, the fraction holding live tokens."""
        s = self.allocated_slots_sampled
        return self.live_slots_sampled / s if s else 1.0


SLOT_SAMPLE_EVERY = 8


class Engine:
    def __init__(self, runner: ModelRunner, config: SchedulerConfig, *, max_model_len: int,
                 eos_token_ids: Seq[int] = (), tokenizer=None, enable_prefix_caching: bool = True,
                 debug_checks: bool = False, kv_prune=None) -> None:
        # CPython < 3.13 maps and unmaps a frame-stack chunk per call across a chunk boundary;
        # a decode loop can sit on one (see runtime/py_arena_cache.py).
        py_arena_cache.install()
        self.runner = runner
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.tokenizer = tokenizer
        self.debug_checks = debug_checks
        self.prefix_cache = PrefixCache(runner.block_size) if enable_prefix_caching else None
        self.allocator = BlockAllocator(runner.kv_cache.num_blocks, self.prefix_cache)
        self.scheduler = Scheduler(config, self.allocator, runner.block_size)
        # KV pruning (runtime/kv_prune.py): only when the decode graph has devin::kv_prune nodes.
        self.pruner = (KVPruner(KVPruneConfig.coerce(kv_prune), self.allocator, self.scheduler, runner.kv_cache,
                                runner.backend) if has_kv_prune_nodes(getattr(runner, "program", None)) else None)
        self.requests: dict[str, Sequence] = {}
        self.metrics = EngineMetrics()
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
        seq = Sequence(rid, ids, params, generator=params.make_generator(),
                       kv_prune_config=resolve_request(self.pruner, params))
        self.requests[rid] = seq
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is None or seq.status.done:
            return
        self.scheduler.release(seq)
        self._finish(seq, Status.ABORTED, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- stepping ---------------------------------------------------------
    def step(self) -> list[RequestOutput]:
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
        prune_step = self.pruner.begin(plan.scheduled) if self.pruner is not None else None
        if prune_step is None:
            logits, owners = self.runner.execute(plan.scheduled)
        else:
            logits, owners = self.runner.execute(plan.scheduled, prune_step)
        for item in plan.scheduled:
            item.seq.num_computed += item.num_tokens
            self.scheduler.commit(item.seq)
        if prune_step is not None:
            self.pruner.finish(prune_step)
        sampled = [plan.scheduled[i].seq for i in owners]
        with torch.inference_mode():
            tokens = self._sample(logits, sampled)
        dt = time.perf_counter() - t0
        self.metrics.steps += 1
        if self.metrics.steps % SLOT_SAMPLE_EVERY == 1:
            live, allocated = self._slot_usage()
            self.metrics.live_slots_sampled += live
            self.metrics.allocated_slots_sampled += allocated
        if is_decode:
            self.metrics.decode_time += dt
            self.metrics.decode_tokens += plan.num_tokens
        else:
            self.metrics.prefill_time += dt
            self.metrics.prefill_tokens += plan.num_tokens
        now = time.perf_counter()
        for seq, tok in zip(sampled, tokens):
            if tok is None:  # failed in sampling (e.g. a logits processor raised)
                outputs[seq.request_id] = self._output(seq, [])
                continue
            seq.output_ids.append(tok)
            seq.metrics.token_times.append(now)
            if seq.metrics.first_token is None:
                seq.metrics.first_token = now
            reason = self._stop_reason(seq, tok)
            if reason:
                self.scheduler.release(seq)
                self._finish(seq, Status.FINISHED, reason)
            outputs[seq.request_id] = self._output(seq, [tok])
        return list(outputs.values())

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
        seq.status = status
        seq.finish_reason = reason
        seq.error = error
        seq.metrics.finished = time.perf_counter()

    def _output(self, seq: Sequence, new: list[int]) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.prompt_ids, list(seq.output_ids), new, seq.status.done,
                             seq.finish_reason, seq.error, seq.metrics)

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
    def generate(self, prompts: Seq[str | Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run a batch to completion; results in prompt order (failed requests carry ``error``)."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.add_request(p, sp))
        except ValueError:
            for rid in ids:  # an invalid prompt rejects the whole batch: leave nothing queued
                self.abort(rid)
            raise
        while any(not self.requests[r].status.done for r in ids):
            if not self.step():
                self.wait_for_admission()
        return [self._output(self.requests[r], []) for r in ids]

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

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (e.g. so a benchmark repeat prefills cold);
        returns how many were dropped. Blocks held by running requests stay registered."""
        return self.allocator.evict_cached()

    def _slot_usage(self) -> tuple[int, int]:
        """(slots holding live tokens, slots in blocks held by requests); a shared block counts once."""
        bs = self.runner.block_size
        filled: dict[int, int] = {}
        for s in self.scheduler.running:
            for j, b in enumerate(s.block_table):
                n = max(0, min(bs, s.num_computed - s.num_evicted - j * bs))
                filled[b] = max(filled.get(b, 0), n)
        return sum(filled.values()), len(filled) * bs

    def kv_stats(self) -> dict:
        """Pool occupancy and prefix-cache counters.

        ``blocks_free`` includes ``blocks_cached_free`` (cached, unreferenced, evictable);
        ``blocks_cached`` counts every registered block, referenced or not.
        """
        a = self.allocator
        live, slots = self._slot_usage()
        padded_keys = getattr(self.runner, "attention_padded_keys", 0)  # test runners may not count
        stats = {
            "blocks_total": a.num_blocks, "blocks_used": a.num_used, "blocks_free": a.num_free,
            "blocks_used_peak": a.peak_used,
            "bytes_per_token": self.runner.kv_cache.spec.bytes_per_token,
            "pool_bytes": a.num_blocks * self.runner.block_size * self.runner.kv_cache.spec.bytes_per_token,
            "live_slot_fraction": (live / slots) if slots else 1.0,
            "mean_live_slot_fraction": self.metrics.mean_live_slot_fraction,
            # length-aware grouping of batched decode attention: fraction of the keys read that were padding
            "attention_padding_waste": (1 - getattr(self.runner, "attention_real_keys", 0) / padded_keys)
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
        return stats
