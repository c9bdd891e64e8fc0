"""One API request's generation: its choices run as engine requests, text events out.

A :class:`Generation` starts one asyncio task per choice (prompt x ``n``); each task
iterates :meth:`AsyncEngine.outputs`, detokenises incrementally with stop strings
(:class:`~devin_compile.text.detokenizer.TextStream`) and puts ``(choice, delta, finish,
logprobs)`` events on one queue, which :meth:`events` yields in arrival order (``logprobs``: the
:class:`~devin_compile.runtime.logprobs.TokenLogprob` of the tokens since the choice's last event,
when the request asked for them, so a stream carries each token's logprob exactly once). Under
``echo`` the choice's first event starts with the prompt's text and its prompt logprobs. A stop
string ends its choice at once (its engine request is aborted, its KV blocks freed). :meth:`close` cancels
whatever still runs: that is how a client that went away, a ``timeout`` or shutdown
aborts the request. Invariant: every engine request a Generation starts is finished or
aborted when ``close`` returns, and its metrics are recorded once.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from ..runtime.request_output import RequestError
from ..runtime.sampling import SamplingParams
from ..text.detokenizer import TextStream
from .protocol import APIError


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    text: TextStream
    finish_reason: str | None = None
    output: object = None  # the last RequestOutput
    first_token: float | None = None
    queued: bool = True
    done: bool = False
    recorded: bool = False
    pending: list = field(default_factory=list)  # TokenLogprobs not yet sent with an event
    text_offset: int = 0  # completions logprobs: characters of token strings sent so far
    echo: str | None = None  # completions echo: the prompt's text, sent before the completion
    prompt_logprobs: list | None = None  # RequestOutput.prompt_logprobs, when the prompt is scored

    @property
    def completion_tokens(self) -> int:
        return len(self.output.output_ids) if self.output is not None else 0

    def echo_entries(self) -> list:
        """The echoed prompt's logprob entries: its first token (an id: no logprob), then each scored token."""
        return [self.prompt_ids[0], *self.prompt_logprobs[1:]]


@dataclass
class Generation:
    server: object  # the Server: .engine (AsyncEngine), .metrics, .queued counter
    request_id: str
    choices: list[Choice]
    n: int = 1  # choices per prompt: choice i answers prompt i // n
    timeout: float | None = None
    received: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self._events: asyncio.Queue = asyncio.Queue()
        self.closed = False
        self._tasks = [asyncio.create_task(self._drive(c)) for c in self.choices]
        self.server.queued += len(self.choices)

    @property
    def engine_ids(self) -> list[str]:
        """The engine request id of each choice."""
        return [self._engine_id(c) for c in self.choices]

    def _engine_id(self, c: Choice) -> str:
        return f"{self.request_id}-{c.index}"

    # -- per choice -------------------------------------------------------------
    async def _drive(self, c: Choice) -> None:
        agen = self.server.engine.outputs(c.prompt_ids, c.params, self._engine_id(c))
        try:
            async for out in agen:
                prefix = ""
                if c.queued:  # the first output
                    self._dequeue(c)
                    prefix = self._echo(c, out)
                c.output = out
                if out.new_logprobs:
                    c.pending.extend(out.new_logprobs)
                if out.new_ids and c.first_token is None:
                    c.first_token = time.perf_counter()
                delta = prefix + c.text.add(out.new_ids)
                if c.text.stopped:
                    self._put(c, delta, "stop")
                    return
                if out.finished:
                    self._put(c, delta + c.text.finish(), out.finish_reason or "stop")
                    return
                if delta:
                    self._put(c, delta, None)
        except (ValueError, RequestError) as e:  # invalid for the engine, or failed mid-way: this choice alone
            status = 400 if isinstance(e, ValueError) else 500
            self._events.put_nowait((c, APIError(status, str(e), type="invalid_request_error" if status == 400
                                                 else "server_error"), None, None))
        except RuntimeError as e:  # the engine thread died
            self._events.put_nowait((c, APIError(500, str(e), type="server_error"), None, None))
        finally:
            if c.queued:
                self._dequeue(c)
            await agen.aclose()  # aborts the engine request unless it finished
            self._record(c)

    @staticmethod
    def _echo(c: Choice, out) -> str:
        """Choice ``c``'s first output: keep its prompt logprobs; under ``echo`` the prompt's text (and
        its logprobs, when asked) lead the choice's first event."""
        c.prompt_logprobs = out.prompt_logprobs
        if c.echo is None:
            return ""
        if c.params.logprobs is not None and c.prompt_logprobs is not None:
            c.pending.extend(c.echo_entries())
        return c.echo

    def _dequeue(self, c: Choice) -> None:
        c.queued = False
        self.server.queued -= 1

    def _put(self, c: Choice, delta: str, finish: str | None) -> None:
        if finish is not None:
            c.finish_reason, c.done = finish, True
        logprobs, c.pending = c.pending, []
        self._events.put_nowait((c, delta, finish, logprobs))

    def _record(self, c: Choice) -> None:
        if c.recorded or self.server.metrics is None:
            return
        c.recorded = True
        ttft = None if c.first_token is None else c.first_token - self.received
        self.server.metrics.sequence_done(len(c.prompt_ids), c.output, ttft, time.perf_counter() - self.received)

    # -- the request ------------------------------------------------------------
    async def events(self):
        """Yield ``(choice, delta, finish_reason, logprobs)`` until every choice is finished; raises the
        first choice's :class:`APIError`, or a 408 one when ``timeout`` runs out."""
        deadline = None if self.timeout is None else self.received + self.timeout
        left = len(self.choices)
        while left:
            if deadline is None:
                c, delta, finish, logprobs = await self._events.get()
            else:
                try:
                    c, delta, finish, logprobs = await asyncio.wait_for(self._events.get(),
                                                                        deadline - time.perf_counter())
                except asyncio.TimeoutError:
                    raise APIError(408, f"the request ran past its timeout of {self.timeout:g} s and was aborted",
                                   param="timeout", type="timeout_error", code="timeout") from None
            if isinstance(delta, APIError):
                raise delta
            yield c, delta, finish, logprobs
            if finish is not None:
                left -= 1

    async def collect(self) -> None:
        """Run to the end (non-streamed): the text is in each choice's ``text.text``."""
        async for _ in self.events():
            pass

    def close(self) -> None:
        """Cancel the choices still running (each aborts its engine request); synchronous, so it is
        safe in a cancelled task's cleanup."""
        self.closed = True
        for t in self._tasks:
            if not t.done():
                t.cancel()

    def usage(self) -> dict:
        prompt = sum(len(c.prompt_ids) for c in self.choices if c.index % self.n == 0)
        completion = sum(c.completion_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
