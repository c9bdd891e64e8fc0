"""Engine: requests in, tokens out, one scheduled step at a time.

``add_request`` checks (:mod:`.admission`) and queues; ``step`` tells one step's story: the
scheduler plans it (:mod:`.scheduler`, blocks from :mod:`.kv_manager`), the runner executes it,
plain rows are sampled (:mod:`.sampler`) and drafted rows verified (:mod:`.speculative`), and the
output processor appends the tokens and finishes requests (:mod:`.output_processor`).
``generate`` drives steps until a batch is done; ``stream`` yields one request's tokens as they
appear; ``forward_logits`` is a full-sequence forward. A request that fails (an invalid prompt, a
logits-processor error, a pool it can never fit in) fails alone: the others go on.

``debug_checks=True`` asserts before every step that no slot it writes lies in a shared or
registered block.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Iterator, Sequence as Seq

import torch

from ..config import KVPruneConfig, SchedulerConfig
from . import arena_reuse
from .admission import AdmissionCheck, AdmittedRequest, RequestRejected, check_params_type
from .engine_metrics import EngineMetrics, slot_usage
from .kv_manager import KVManager
from .kv_prune import KVPruner
from .kv_tiers import KVTiers
from .logprobs import log_probs, token_logprobs
from .output_processor import Emission, OutputProcessor
from .prompt_logprobs import score_prompts
from .request_output import RequestError, RequestOutput
from .runner_protocol import Runner
from .sampler import sample_rows
from .sampling import SamplingParams
from .scheduler import Scheduler
from .step_plan import ScheduledSeq
from .sequence import Sequence, Status
from .speculative import SpeculativeDecoder
from .step_info import StepInfo

log = logging.getLogger(__name__)


class Engine:
    """Requests in, tokens out over ``runner``.

    ``kv_prune`` is the model's KV-pruning setting, resolved once by ``optimize()``: None
    when the decode graph has no ``devin::kv_prune`` nodes (no request may prune), else the
    configuration the nodes were compiled with (requests prune with it by default when it is
    ``enabled``; see :func:`~devin_compile.runtime.kv_prune.resolve_request`). ``kv_tiers``
    keeps evicted prefix blocks below the pool (it needs prefix caching).
    """

    def __init__(self, runner: Runner, config: SchedulerConfig, *, max_model_len: int,
                 eos_token_ids: Seq[int] = (), tokenizer=None, enable_prefix_caching: bool = True,
                 debug_checks: bool = False, kv_prune: KVPruneConfig | None = None,
                 kv_tiers: KVTiers | None = None, speculative: SpeculativeDecoder | None = None) -> None:
        if kv_prune is not None and not isinstance(kv_prune, KVPruneConfig):
            raise TypeError(f"Engine(kv_prune=) takes a KVPruneConfig or None (resolved by optimize()), "
                            f"got {type(kv_prune).__name__}")
        if kv_tiers is not None and kv_tiers.pool is not runner.kv_cache:
            raise ValueError("kv_tiers need prefix caching on and must be built over this runner's KV pool")
        states = getattr(runner, "state_pool", None)
        if states is not None:
            _check_recurrent(enable_prefix_caching, kv_prune, kv_tiers)
            if speculative is not None:
                speculative.track_states(states)
        arena_reuse.install()  # CPython < 3.13: keep op calls off the frame-stack chunk boundary
        self.runner = runner
        self.config = config
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.debug_checks = debug_checks
        self.kv = KVManager(runner.kv_cache.num_blocks, runner.block_size, prefix_caching=enable_prefix_caching,
                            tiers=kv_tiers, states=states)
        self.scheduler = Scheduler(config, self.kv)
        self.admission = AdmissionCheck(max_model_len, self.kv.pool_tokens, runner.vocab_size, tokenizer, kv_prune)
        self.outputs = OutputProcessor(eos_token_ids, self._release)
        self.kv_prune = kv_prune
        self.pruner = KVPruner(kv_prune, self.kv, runner.kv_cache, runner.backend) if kv_prune is not None else None
        self.spec = speculative
        self.requests: dict[str, Sequence] = {}
        self.metrics = EngineMetrics()
        self.step_hooks: list = []
        self._ids = itertools.count()

    # -- request API ------------------------------------------------------
    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; raises :class:`RequestRejected` (a ``ValueError`` naming the input at
        fault) and changes nothing if it is invalid."""
        params = params or SamplingParams()
        check_params_type(params)
        ids = self.admission.encode(prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests and not self.requests[rid].status.done:
            raise RequestRejected(f"request id {rid!r} is already in flight", "request_id")
        try:
            kv_prune = self.admission.check_ids(ids, params, can_speculate=self._can_speculate)
        except RequestRejected as e:
            raise e.prefixed(f"request {rid}: ") from None
        seq = Sequence(rid, ids, params, generator=params.make_generator(), kv_prune_config=kv_prune)
        if self.spec is not None:
            seq.spec = self.spec.admit(seq)
            if seq.spec is not None:
                seq.metrics.spec = seq.spec.metrics
        self.requests[rid] = seq
        self.scheduler.add(seq)
        return rid

    def check_request(self, prompt: str | Seq[int], params: SamplingParams) -> AdmittedRequest:
        """:class:`RequestRejected` unless this engine can run ``prompt`` with ``params`` (tokens,
        lengths, KV pruning and speculation it has); nothing is queued."""
        return self.admission.check(prompt, params, can_speculate=self._can_speculate)

    @property
    def _can_speculate(self) -> bool:
        return self.spec is not None and self.spec.proposer is not None

    def abort(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is None or seq.status.done:
            return
        self.outputs.finish(seq, Status.ABORTED, "abort")

    def forget(self, request_id: str) -> None:
        """Drop a request's record from ``requests`` (one still in flight is aborted first; an unknown id
        is ignored). In-process callers read ``requests[rid]`` after a request ends until they forget it;
        a long-running front (:class:`~.async_engine.AsyncEngine`) forgets each request once its last
        output is handed back, so a server keeps no record of the requests it has answered."""
        if request_id in self.requests:
            self.abort(request_id)
            del self.requests[request_id]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def add_step_hook(self, fn) -> None:
        """Call ``fn(StepInfo)`` after every step that ran a batch (on the stepping thread; see
        :mod:`~devin_compile.runtime.step_info`). Without hooks no StepInfo is built. A hook that
        raises is logged and removed (the step's requests go on)."""
        self.step_hooks.append(fn)

    # -- stepping ---------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan one step, run it, sample or verify its rows, append the tokens; the step's outputs."""
        started = time.perf_counter()
        if self.spec is not None:
            self.spec.plan(self.scheduler.running, self.max_model_len)
        plan = self.scheduler.schedule()
        outputs = [self.outputs.fail(seq, message) for seq, message in plan.failed]
        self.metrics.preemptions += len(plan.preempted)
        if not plan.scheduled:
            return outputs
        if self.debug_checks:
            self.kv.check_writes(plan.scheduled)
        t0 = time.perf_counter()
        if self.spec is not None:
            self.spec.propose(plan.scheduled)
        logits, owners, prune_step, forward_s = self._forward(plan.scheduled)
        emitted = self._sample(plan.scheduled, logits, owners, prune_step, forward_s)
        decode = plan.is_decode
        tokens = sum(len(e.tokens) for e in emitted if e.tokens) if decode else plan.num_tokens
        self.metrics.record_step(decode, time.perf_counter() - t0, tokens, self._slot_usage)
        outputs += self.outputs.process(emitted)
        for e in emitted:
            if e.drafted and e.tokens:
                self.kv.commit(e.seq)  # verified tokens only: the rollback already dropped the rest
        if self.step_hooks:
            self._call_hooks(StepInfo.of(self.metrics.steps, started, time.perf_counter(), plan.scheduled, emitted))
        return outputs

    def _forward(self, scheduled: list[ScheduledSeq]):
        """Run the batch: (logits, the batch index owning each row, the pruning step, forward seconds).
        Prompt logprobs are scored; computed tokens are committed (a drafted sequence's only after
        verification)."""
        prune_step = self.pruner.begin(scheduled) if self.pruner is not None else None
        t0 = time.perf_counter()
        logits, owners = self.runner.execute(scheduled, prune_step)
        forward_s = time.perf_counter() - t0
        with torch.inference_mode():
            score_prompts(scheduled, logits[len(owners):])  # rows past the sampling ones: prompt logprobs
        logits = logits[:len(owners)]
        for item in scheduled:
            item.seq.num_computed += item.num_tokens
            if not item.draft:
                self.kv.commit(item.seq)
        if prune_step is not None:
            self.pruner.finish(prune_step)
        return logits, owners, prune_step, forward_s

    def _sample(self, scheduled: list[ScheduledSeq], logits: torch.Tensor, owners: list[int], prune_step,
                forward_s: float) -> list[Emission]:
        """A token for every plain row; the accepted tokens of every drafted sequence."""
        plain, drafted = _split_rows(scheduled, owners)
        scored = [seq for _, seq in plain if not seq.params.max_new_tokens]  # prompt scored: nothing to sample
        if scored:
            plain = [(r, seq) for r, seq in plain if seq.params.max_new_tokens]
        with torch.inference_mode():
            rows = logits if not (drafted or scored) else logits[[r for r, _ in plain]]
            emitted = self._sample_plain(rows, [seq for _, seq in plain]) + [Emission(seq, []) for seq in scored]
            if drafted:
                self.spec.record_verify_time([item for item, _, _ in drafted], forward_s)
            for item, first, count in drafted:
                emitted.append(self._verify(item, logits[first:first + count], prune_step))
        return emitted

    def _sample_plain(self, rows: torch.Tensor, seqs: list[Sequence]) -> list[Emission]:
        sampled = sample_rows(rows, seqs)
        for i, error in sampled.errors.items():
            self.outputs.finish(seqs[i], Status.FAILED, "error", error)
        return [Emission(seq, None if tok is None else [tok], False,
                         [sampled.logprobs[i]] if i in sampled.logprobs else None)
                for i, (seq, tok) in enumerate(zip(seqs, sampled.tokens))]

    def _verify(self, item: ScheduledSeq, rows: torch.Tensor, prune_step) -> Emission:
        seq, k = item.seq, item.seq.params.logprobs
        logp = log_probs(rows) if k is not None else None  # before processors edit the rows
        tokens, error = self.spec.verify(item, rows, self.kv)
        if error is not None:
            self.outputs.finish(seq, Status.FAILED, "error", error)
        if prune_step is not None:  # KV pruning scores and counts the verified rows only
            prune_step.commit(seq, None if tokens is None else len(tokens) - 1)
        # token j of a verify step comes from row j (accepted proposals, then the target's own)
        lps = token_logprobs(logp, tokens, [k] * len(tokens)) if tokens and logp is not None else None
        return Emission(seq, tokens, True, lps)

    def _release(self, seq: Sequence) -> None:
        """What a finishing request holds goes back: its queue place, KV blocks, proposer state."""
        self.scheduler.release(seq)
        if self.spec is not None:
            self.spec.release(seq)

    def _call_hooks(self, info: StepInfo) -> None:
        for fn in list(self.step_hooks):
            try:
                fn(info)
            except Exception:  # noqa: BLE001  (a hook failing must not fail the requests: it is dropped)
                log.exception("step hook %r raised; it is removed", fn)
                self.step_hooks.remove(fn)

    # -- drivers ----------------------------------------------------------
    def generate(self, prompts: Seq[str | Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, raise_on_error: bool = False) -> list[RequestOutput]:
        """Run a batch to completion; results in prompt order.

        An invalid prompt rejects the whole batch (:class:`RequestRejected` naming it, ``prompt i:
        ...``; nothing stays queued). A request that fails mid-way carries ``error`` in its result,
        or, with ``raise_on_error``, makes the batch raise :class:`RequestError` with every result
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
        except RequestRejected as e:
            for rid in ids:  # an invalid prompt rejects the whole batch: leave nothing queued
                self.abort(rid)
            raise e.prefixed(f"prompt {len(ids)}: ") from None
        while any(not self.requests[r].status.done for r in ids):
            if not self.step():
                self.wait_for_admission()
        results = [self.outputs.output(self.requests[r], []) for r in ids]
        failed = [r for r in results if r.error]
        if raise_on_error and failed:
            raise RequestError(failed[0].request_id, "; ".join(f"{r.request_id}: {r.error}" for r in failed),
                               results)
        return results

    def forward_logits(self, prompt: str | Seq[int]) -> torch.Tensor:
        """Logits at every position of one token sequence [T, vocab] (a full-sequence forward:
        no request, no sampling); its KV blocks are borrowed from the pool for the call
        (``KVCacheExhaustedError`` if none are free). ``ValueError`` for an invalid sequence."""
        ids = self.admission.encode(prompt)
        with self.kv.borrow(len(ids)) as blocks:
            return self.runner.forward_logits(ids, blocks)

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

    # -- speculation, caches, stats -------------------------------------------
    def set_proposer(self, proposer, config=None) -> None:
        """Hot swap the speculative proposer (a :class:`~devin_compile.runtime.speculative.Proposer`, or
        None: off): requests admitted from now on use it; those in flight finish on the one they have."""
        if self.spec is None:
            if proposer is None:
                return
            if config is None:
                raise ValueError("this engine has no speculation yet: give the SpeculativeConfig with the proposer")
            self.spec = SpeculativeDecoder(config, proposer)
            if self.kv.states is not None:
                self.spec.track_states(self.kv.states)
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
        return self.kv.evict_cached()

    def close(self, timeout_s: float = 10.0) -> None:
        """Store what the KV tiers' write-through queue holds (at most ``timeout_s``) and stop its
        thread; the engine stays usable (a later registered block starts it again)."""
        self.kv.close(timeout_s)

    def _slot_usage(self) -> tuple[int, int]:
        """(slots holding live tokens, slots in blocks held by requests); a shared block counts once."""
        return slot_usage(self.scheduler.running, self.runner.block_size)

    def kv_stats(self) -> dict:
        """Pool occupancy, prefix-cache counters, pruning and the KV tiers' (one dict per tier).

        ``blocks_free`` includes ``blocks_cached_free`` (cached, unreferenced, evictable);
        ``blocks_cached`` counts every registered block, referenced or not.
        """
        live, slots = self._slot_usage()
        padded_keys = self.runner.attention_padded_keys
        bytes_per_token = self.runner.kv_cache.spec.bytes_per_token
        stats = {
            **self.kv.stats(),
            "bytes_per_token": bytes_per_token, "pool_bytes": self.kv.pool_tokens * bytes_per_token,
            "live_slot_fraction": (live / slots) if slots else 1.0,
            "mean_live_slot_fraction": self.metrics.mean_live_slot_fraction,
            # length-aware grouping of batched decode attention: fraction of the keys read that were padding
            "attention_padding_waste": (1 - self.runner.attention_real_keys / padded_keys) if padded_keys else 0.0,
        }
        if self.pruner is not None:
            stats.update(self.pruner.stats(self.scheduler.running))
        return stats


def _check_recurrent(prefix_caching: bool, kv_prune, kv_tiers) -> None:
    """What a model with recurrent layers (a state pool) cannot run with: one clear error each. Their state
    after a prefix is not in any KV block (no prefix caching or KV tiers, no snapshots kept), and pruning K/V
    does not prune a recurrent state. (Speculation rolls the state back: speculative/state_rollback.py.)"""
    refused = [(prefix_caching, "prefix caching", "enable_prefix_caching=False (optimize() turns it off itself)"),
               (kv_tiers is not None, "kv_cache_tiers", "drop kv_cache_tiers="),
               (kv_prune is not None, "KV pruning", "drop kv_prune=")]
    for on, what, way_out in refused:
        if on:
            raise ValueError(f"{what} cannot serve a model with recurrent layers (Mamba, gated DeltaNet and RG-LRU "
                             f"layers keep a per-sequence state that KV blocks do not hold); {way_out}")


def _split_rows(scheduled: list[ScheduledSeq], owners: list[int]):
    """(plain rows as (row, sequence), drafted sequences as (item, first row, row count)): each run of
    equal ``owners`` is one batch entry's rows (a drafted sequence owns several)."""
    plain, drafted = [], []
    i = 0
    while i < len(owners):
        j = i
        while j + 1 < len(owners) and owners[j + 1] == owners[i]:
            j += 1
        item = scheduled[owners[i]]
        if item.draft:
            drafted.append((item, i, j - i + 1))
        else:
            plain.append((i, item.seq))
        i = j + 1
    return plain, drafted
