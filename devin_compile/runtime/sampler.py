"""A step's sampler: logits processors, then a token per row, with its logprobs when asked.

:func:`apply_processors` runs a request's logits processors over its rows; row ``j`` sees the
request's tokens followed by the first ``j`` proposals of a speculative draft (none for a plain
decode row). A processor that raises fails only its request (:class:`ProcessorError`).
:func:`sample_rows` samples one token per plain row (:func:`~.sampling.sample_batch`) and reads
the logprobs of the requests that asked, from the raw logits, before any processor edits them.
A row whose raw logits hold NaN/inf fails its request alone (:data:`NON_FINITE`). A step whose rows
are all greedy without processors takes :func:`~.greedy_rows.greedy_rows` (argmax and the finite
check in one C pass) where it applies.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence as Seq

import torch

from .greedy_rows import greedy_rows
from .logprobs import TokenLogprob, log_probs, token_logprobs
from .sampling import sample_batch
from .sequence import Sequence


NON_FINITE = ("the model's logits for this request hold NaN/inf (in float16 an overflow: try dtype=bfloat16 "
              "or float32); the request is stopped, the others go on")


class ProcessorError(Exception):
    """A request's logits processor raised; the message says which and why."""


def apply_processors(seq: Sequence, logits: torch.Tensor, draft: Seq[int] = ()) -> torch.Tensor:
    """``seq``'s logits processors applied to each row of ``logits`` [N, V] in place; row ``j``'s
    context is ``seq``'s tokens and then ``draft[:j]``."""
    procs = seq.params.logits_processors
    if not procs:
        return logits
    ids = seq.all_ids
    try:
        for j in range(logits.shape[0]):
            x = logits[j]
            for proc in procs:
                x = proc(ids + list(draft[:j]), x)
            logits[j] = x
    except Exception as e:  # noqa: BLE001  (a user callback failing fails only its request)
        raise ProcessorError(f"logits processor raised {type(e).__name__}: {e}") from None
    return logits


@dataclass
class SampledRows:
    """Per row: the token (None where a processor failed), its TokenLogprob (requests that asked),
    and the error of each failed row."""

    tokens: list[int | None]
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)


def sample_rows(logits: torch.Tensor, seqs: Seq[Sequence]) -> SampledRows:
    """One token for each row of ``logits`` [len(seqs), V], row ``i`` belonging to ``seqs[i]``."""
    if not seqs:
        return SampledRows([])
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    logp = log_probs(logits[want]) if want else None  # before processors edit the rows in place
    if all(s.params.greedy and not s.params.logits_processors for s in seqs):
        fast = greedy_rows(logits)  # one C pass in the logits' dtype (None: keep the torch path)
        if fast is not None:
            best, finite = fast
            errors = {row: NON_FINITE for row, ok in enumerate(finite) if not ok}
            tokens = [None if row in errors else tok for row, tok in enumerate(best)]
            return SampledRows(tokens, _chosen_logprobs(logp, want, seqs, tokens), errors)
    logits = logits.float()
    errors = {row: NON_FINITE for row, ok in enumerate(finite_rows(logits)) if not ok}
    for row, seq in enumerate(seqs):
        if row in errors or not seq.params.logits_processors:
            continue
        try:
            apply_processors(seq, logits[row:row + 1])
        except ProcessorError as e:
            errors[row] = str(e)
    ok = [r for r in range(len(seqs)) if r not in errors]
    kept = logits if len(ok) == len(seqs) else logits[ok]  # (indexing copies every row)
    picked = sample_batch(kept, [seqs[r].params for r in ok], [seqs[r].generator for r in ok])
    tokens: list[int | None] = [None] * len(seqs)
    for r, tok in zip(ok, picked):
        tokens[r] = tok
    return SampledRows(tokens, _chosen_logprobs(logp, want, seqs, tokens), errors)


def finite_rows(logits: torch.Tensor) -> list[bool]:
    """Whether each row of ``logits`` [N, V] is all finite: its max and min are (both propagate NaN), two
    reductions instead of a [N, V] mask (64 rows of a 49k vocabulary: 0.6 ms instead of 4.7 on 2 cores)."""
    return (torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))).tolist()


def _chosen_logprobs(logp: torch.Tensor | None, want: list[int], seqs: Seq[Sequence],
                     tokens: list[int | None]) -> dict[int, TokenLogprob]:
    """Row → TokenLogprob of its sampled token, for the rows ``want`` (``logp``: their
    log-probabilities) that sampled one."""
    ok = [j for j, i in enumerate(want) if tokens[i] is not None]
    if not ok:
        return {}
    rows = [want[j] for j in ok]
    lps = token_logprobs(logp[ok], [tokens[i] for i in rows], [seqs[i].params.logprobs for i in rows])
    return dict(zip(rows, lps))
