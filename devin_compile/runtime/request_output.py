"""What the engine hands back per request: :class:`RequestOutput`, and :class:`RequestError`."""
from __future__ import annotations

from dataclasses import dataclass


class RequestError(RuntimeError):
    """A request failed; ``.request_id`` names it and the message says why. Raised by a batch
    (``generate(..., raise_on_error=True)``), ``.results`` holds every request's output."""

    def __init__(self, request_id: str, message: str, results: list["RequestOutput"] | None = None) -> None:
        super().__init__(f"request {request_id}: {message}")
        self.request_id = request_id
        self.results = results


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
    # SamplingParams.logprobs set: runtime/logprobs.TokenLogprob of every output token / of new_ids
    logprobs: list | None = None
    new_logprobs: list | None = None
    # SamplingParams.prompt_logprobs set: None for the first prompt token, then a TokenLogprob for each
    # prompt token as far as the prefill has scored them (all of them from the first output on)
    prompt_logprobs: list | None = None
