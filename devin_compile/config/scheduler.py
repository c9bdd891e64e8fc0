"""Continuous batching limits for one engine step, and how arriving requests join."""
from __future__ import annotations

from dataclasses import dataclass

from ..validation import int_at_least, number_in, one_of, positive_int


@dataclass
class SchedulerConfig:
    """Continuous batching limits for one engine step, and how arriving requests join.

    ``step_mode``: ``"mixed"`` steps decode the running sequences and prefill (chunks of)
    new prompts together; ``"separate"`` steps are either prefill-only (whenever prompt
    work is pending) or decode-only. Dynamic batching: waiting requests are admitted once
    ``min_batch_size`` of them are waiting or the oldest has waited ``max_wait_ms``,
    whichever comes first (defaults: admit at once).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    step_mode: str = "mixed"
    min_batch_size: int = 1
    max_wait_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "min_batch_size"):
            positive_int(name, getattr(self, name))
        one_of("step_mode", self.step_mode, ("mixed", "separate"))
        number_in("max_wait_ms", self.max_wait_ms, 0, hint="milliseconds")
        int_at_least("max_model_len", self.max_model_len, 2, optional=True)
