"""Dynamic KV-cache pruning while decoding: when, which tokens, how many."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..validation import flag, fraction, from_mapping, int_at_least, number_in, one_of, positive_int


@dataclass
class KVPruneConfig:
    """Dynamic KV-cache pruning while decoding (see :mod:`devin_compile.runtime.kv_prune`).

    Every ``step_interval`` decode steps a sequence's tokens whose normalised attention score
    (mean over the observed steps of ``attention mass x live tokens``, so 1.0 = uniform) is
    below ``threshold`` are evicted, never the first ``sink_tokens`` nor the last
    ``recent_tokens``; ``max_tokens`` / ``max_ratio`` (of the sequence's positions) cap the
    live tokens. ``policy``: ``"attention"`` (scores), ``"streaming"`` (evict the oldest
    non-sink tokens: StreamingLLM) or ``"random"`` (a baseline; ``seed``). ``recency_layers``:
    the fraction of the attention layers, counted from the first, that evict their oldest
    evictable tokens whatever the policy (default 0.5: on SmolLM2, scores chose worse than
    recency in the early layers and better in the late ones; 0 = the policy in every layer).
    ``enabled=False`` compiles the pruning nodes but leaves pruning off until a request
    (``SamplingParams(kv_prune=...)``) or :func:`devin_compile.enable_kv_pruning` turns it on.
    """

    threshold: float = 0.05
    step_interval: int = 2
    sink_tokens: int = 4
    recent_tokens: int = 64
    max_tokens: int | None = None
    max_ratio: float | None = None
    policy: str = "attention"
    seed: int = 0
    prefill_window: int = 0  # > 0: SnapKV-style, the prompt's last N queries score it and it is pruned once at once
    pool_kernel: int = 32  # > 1: a token's score is the max over it and the kernel-1 tokens before it (keeps spans)
    recency_layers: float = 0.5  # fraction of layers (first ones) that evict by recency instead of by the policy
    enabled: bool = True

    POLICIES = ("attention", "streaming", "random")

    def __post_init__(self) -> None:
        number_in("kv_prune.threshold", self.threshold, 0.0, 1.0, hi_open=True,
                  hint="a fraction of uniform attention; 0 evicts nothing unless a cap is set")
        positive_int("kv_prune.step_interval", self.step_interval, hint="decode steps between evaluations")
        for name in ("sink_tokens", "recent_tokens", "seed", "prefill_window"):
            int_at_least(f"kv_prune.{name}", getattr(self, name), 0)
        positive_int("kv_prune.max_tokens", self.max_tokens, optional=True)
        protected = self.sink_tokens + self.recent_tokens
        if self.max_tokens is not None and self.max_tokens < max(protected, 1):
            raise ValueError(
                f"kv_prune.max_tokens={self.max_tokens} is smaller than sink_tokens + recent_tokens = {protected}: "
                "the cap could only be met by evicting every token; raise max_tokens or lower the windows")
        fraction("kv_prune.max_ratio", self.max_ratio, optional=True, hint="live tokens / positions")
        positive_int("kv_prune.pool_kernel", self.pool_kernel, hint="1: no pooling")
        number_in("kv_prune.recency_layers", self.recency_layers, 0.0, 1.0,
                  hint="the fraction of attention layers, from the first, that evict their oldest tokens")
        one_of("kv_prune.policy", self.policy, self.POLICIES)
        if self.policy != "attention" and not self.has_cap:
            raise ValueError(f"kv_prune.policy={self.policy!r} ignores scores, so it needs a cap: set max_tokens or "
                             "max_ratio")
        flag("kv_prune.enabled", self.enabled)

    @property
    def has_cap(self) -> bool:
        return self.max_tokens is not None or self.max_ratio is not None

    def num_recency_layers(self, num_layers: int) -> int:
        """How many of ``num_layers`` layers (the first ones) evict by recency."""
        return round(self.recency_layers * num_layers)

    @classmethod
    def coerce(cls, value: Any, what: str = "kv_prune") -> "KVPruneConfig | None":
        """None/False → None (off); True → defaults; a dict or KVPruneConfig → validated config."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return from_mapping(cls, value, what)
        raise ValueError(f"{what}={value!r} must be a dict of settings (e.g. {{'threshold': 0.05}}), "
                         "a KVPruneConfig, True or None")
