"""Runner: what the :class:`~devin_compile.runtime.engine.Engine` needs from the thing that
runs a step (:class:`~devin_compile.runtime.model_runner.ModelRunner`, or a test stand-in)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from .kv_cache import PagedKVCache
    from .step_plan import ScheduledSeq


@runtime_checkable
class Runner(Protocol):
    vocab_size: int
    kv_cache: "PagedKVCache"
    backend: Any  # the attention backend (KV pruning asks it whether it reports scores)
    # keys attention read vs keys that exist, over steps whose backend padded batched sequences
    attention_real_keys: int
    attention_padded_keys: int

    @property
    def block_size(self) -> int: ...

    def execute(self, batch: list["ScheduledSeq"], kv_prune: Any = None) -> tuple[torch.Tensor, list[int]]:
        """Run one scheduled step: (logits, row → index into ``batch``) of the sequences that sample;
        a sequence with proposals (``ScheduledSeq.draft``) owns ``1 + len(draft)`` consecutive rows.
        Rows past ``len(owners)`` are the prompt-logprob rows of the items' ``ScheduledSeq.scored``
        positions, in batch order (none unless a request asks for ``prompt_logprobs``)."""
        ...

    def forward_logits(self, token_ids: list[int], block_table: list[int]) -> torch.Tensor:
        """Logits [T, vocab] at every position of one sequence, computed into ``block_table``."""
        ...
