"""Prompt logprobs (``SamplingParams.prompt_logprobs``): how likely each prompt token was under the
prompt before it, read from the prefill's own logits.

A request that asks gets, besides the row it samples from, a logits row at every prompt position
``p < len(prompt) - 1`` its prefill computes (``ScheduledSeq.scored``); ``log_softmax`` of row ``p``
scores prompt token ``p + 1`` (:func:`score_prompts` appends a
:class:`~devin_compile.runtime.logprobs.TokenLogprob` with its rank and top alternatives to
``Sequence.prompt_logprobs``). The first prompt token has no logprob (``None`` in
``RequestOutput.prompt_logprobs``, as vLLM and OpenAI's ``echo`` answer).

Chunked prefill scores each chunk's positions as it runs, so the result equals one whole-prompt
step. The prefix cache would skip positions (a hit's K/V is reused, its logits never computed):
a request whose prompt is not scored yet takes no prefix hits past the positions it has scored
(:meth:`~devin_compile.runtime.kv_manager.KVManager.plan_admission`), so its prompt is recomputed
and the answer never depends on the cache; its blocks are still registered for others. A
recompute after a preemption scores nothing twice. Requests that do not ask cost nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .logprobs import log_probs, token_logprobs

if TYPE_CHECKING:
    from .step_plan import ScheduledSeq

ROWS_AT_ONCE = 256  # log_softmax over this many rows at a time (a [rows, vocab] float32 copy each)


def score_prompts(scheduled: list["ScheduledSeq"], rows: torch.Tensor) -> None:
    """Append the prompt logprobs of this step's ``scored`` positions: ``rows`` are their logits,
    item by item in batch order (what the runner returns after the sampling rows)."""
    offset = 0
    for item in scheduled:
        positions = item.scored
        if not positions:
            continue
        seq = item.seq
        k = seq.params.prompt_logprobs
        for first in range(0, len(positions), ROWS_AT_ONCE):
            chunk = positions[first:first + ROWS_AT_ONCE]
            logp = log_probs(rows[offset + first:offset + first + len(chunk)])
            targets = [seq.prompt_ids[p + 1] for p in chunk]
            seq.prompt_logprobs.extend(token_logprobs(logp, targets, [k] * len(chunk)))
        offset += len(positions)
    if offset != rows.shape[0]:
        raise RuntimeError(f"the runner returned {rows.shape[0]} prompt-logprob rows for {offset} scored positions")
