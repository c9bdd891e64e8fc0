"""OutputProcessor: a step's new tokens into requests — append, stop, finish, hand back.

For each :class:`Emission` of a step (a request's sampled token, or the tokens a speculative
verify accepted) it appends the tokens with their logprobs and times, stops at the first one that
ends the request (``"stop"``: an EOS or one of the request's ``stop_token_ids``, unless
``ignore_eos``; ``"length"``: ``max_new_tokens`` reached, or at once for a request that only
scores its prompt, ``max_new_tokens=0``), and builds the
:class:`~.request_output.RequestOutput` of the step. Finishing a request (done, failed or
aborted) releases it through the ``release`` callback (its KV blocks, its proposer's state)
before its status changes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

from .logprobs import TokenLogprob
from .request_output import RequestOutput
from .sequence import Sequence, Status


@dataclass
class Emission:
    """What one step produced for one request."""

    seq: Sequence
    tokens: list[int] | None  # None: it failed, or the step is recomputed next time
    drafted: bool = False  # a speculative verify step (tokens: accepted proposals, then the target's own)
    logprobs: list[TokenLogprob] | None = None  # one per token, for requests that asked


class OutputProcessor:
    def __init__(self, eos_token_ids: Iterable[int], release: Callable[[Sequence], None]) -> None:
        self.eos_token_ids = set(eos_token_ids)
        self.release = release

    def process(self, emitted: list[Emission]) -> list[RequestOutput]:
        """Append each emission's tokens (up to the one that ends its request); one output per emission."""
        now = time.perf_counter()
        return [self._append(e, now) for e in emitted]

    def _append(self, e: Emission, now: float) -> RequestOutput:
        seq, new = e.seq, []
        for j, tok in enumerate(e.tokens or ()):
            seq.output_ids.append(tok)
            if e.logprobs is not None:
                seq.logprobs.append(e.logprobs[j])
            seq.metrics.token_times.append(now)
            if seq.metrics.first_token is None:
                seq.metrics.first_token = now
            new.append(tok)
            reason = self.stop_reason(seq, tok)
            if reason:
                self.finish(seq, Status.FINISHED, reason)
                break
        if e.tokens == [] and not seq.status.done and not seq.params.max_new_tokens:
            self.finish(seq, Status.FINISHED, "length")  # max_new_tokens=0: the prompt is scored, nothing more
        return self.output(seq, new)

    def stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and (tok in self.eos_token_ids or tok in p.stop_token_ids):
            return "stop"
        if len(seq.output_ids) >= p.max_new_tokens:
            return "length"
        return None

    def finish(self, seq: Sequence, status: Status, reason: str, error: str | None = None) -> None:
        """End ``seq``: release what it holds, then record why."""
        self.release(seq)
        seq.status = status
        seq.finish_reason = reason
        seq.error = error
        seq.metrics.finished = time.perf_counter()

    def fail(self, seq: Sequence, error: str) -> RequestOutput:
        """``seq`` fails alone (the others go on); its last output carries ``error``."""
        self.finish(seq, Status.FAILED, "error", error)
        return self.output(seq, [])

    @staticmethod
    def output(seq: Sequence, new: list[int]) -> RequestOutput:
        lps, plps = seq.logprobs, seq.prompt_logprobs
        return RequestOutput(seq.request_id, seq.prompt_ids, list(seq.output_ids), new, seq.status.done,
                             seq.finish_reason, seq.error, seq.metrics,
                             None if lps is None else list(lps), None if lps is None else lps[len(lps) - len(new):],
                             None if plps is None else [None, *plps])
