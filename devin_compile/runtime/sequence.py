"""A request as the runtime tracks it: tokens, KV blocks, status, metrics."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def done(self) -> bool:
        return self in (Status.FINISHED, Status.ABORTED, Status.FAILED)


@dataclass
class RequestMetrics:
    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    tier_hit_tokens: int = 0  # prompt tokens whose K/V were loaded from the KV tiers (runtime/kv_tiers.py)
    # KV pruning (runtime/kv_prune/); zero for requests that do not prune.
    kv_evicted_tokens: int = 0
    kv_freed_blocks: int = 0
    kv_prune_evaluations: int = 0
    kv_live_tokens: int = 0  # KV slots the request holds after its latest pruning step
    spec: object = None  # runtime/speculative/stats.SpecMetrics of a request that speculates

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass(eq=False)  # a request is itself: identity, not its fields (the scheduler's `in` and `remove` on
class Sequence:      # its lists compared every field of every other sequence: ~4k comparisons a 64-row step)
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V were computed (positions 0 .. num_computed - 1)
    state_slot: int = -1  # recurrent layers: the sequence's slot in the state pool (-1: none held)
    # KV pruning: tokens evicted from the cache; the sequence holds num_slots KV slots, and
    # the token at position p >= num_computed goes to slot p - num_evicted.
    num_evicted: int = 0
    kv_prune_config: object = None  # the request's resolved KVPruneConfig (None: no pruning)
    kv_prune_state: object = None  # runtime/kv_prune/scores.PruneState; dropped with the blocks
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"
    error: str | None = None
    generator: torch.Generator | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    spec: object = None  # runtime/speculative/adaptive.SpecState when the request speculates
    spec_lookahead: int = 0  # proposals the next step may verify (set by SpeculativeDecoder.plan)
    # SamplingParams.logprobs set: one runtime/logprobs.TokenLogprob per output token (else None)
    logprobs: list | None = None
    # SamplingParams.prompt_logprobs set: a TokenLogprob for each prompt token after the first, as far as
    # the prefill has scored them (entry j: token j + 1, from the logits at position j); else None
    prompt_logprobs: list | None = None

    def __post_init__(self) -> None:
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = []

    @property
    def prompt_scored(self) -> bool:
        """Every prompt token that needs a logprob has one (always true without prompt_logprobs)."""
        return self.prompt_logprobs is None or len(self.prompt_logprobs) >= len(self.prompt_ids) - 1

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_slots(self) -> int:
        """KV slots in use: computed tokens minus evicted ones."""
        return self.num_computed - self.num_evicted

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def in_prefill(self) -> bool:
        return self.num_uncomputed > 1
