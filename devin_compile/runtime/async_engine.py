"""AsyncEngine: an asyncio front for :class:`~devin_compile.runtime.engine.Engine`.

Many coroutines submit requests concurrently; one background thread owns the engine
and runs its steps (so a step, which is compute-bound, never blocks the event loop).
Submissions and aborts reach that thread through a queue; each step's outputs go back
to the submitting coroutine's event loop with ``call_soon_threadsafe``. Every request
joins the running batch at the next step (continuous batching), subject to the
scheduler's dynamic-batching settings.

    async with AsyncEngine(opt.engine) as engine:
        out = await engine.generate("Hello", SamplingParams(max_new_tokens=32))
        async for tok in engine.stream([1, 2, 3], SamplingParams(max_new_tokens=8)):
            ...

An invalid request raises ``ValueError`` from ``generate``/``stream`` (nothing is queued);
a request that fails mid-way raises :class:`RequestError`; either way the others go on.
Cancelling the awaiting task aborts its request and frees its KV blocks. A request's record
leaves the engine (:meth:`Engine.forget`) once its last output is handed back or it is aborted,
so a long-running server holds no record of the requests it has answered.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from typing import AsyncIterator, Sequence as Seq

from .engine import Engine, RequestError, RequestOutput
from .sampling import SamplingParams


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._error: BaseException | None = None

    @property
    def error(self) -> BaseException | None:
        """What stopped the step thread (every request then failed with it), or None while healthy."""
        return self._error

    # -- lifecycle --------------------------------------------------------
    async def __aenter__(self) -> "AsyncEngine":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the step thread after the current step (requests still in flight are aborted), then
        let the engine store what its KV tiers' write-through queue holds."""
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        await asyncio.to_thread(self.engine.close)

    def _ensure_thread(self) -> None:
        if self._closed:
            raise RuntimeError("AsyncEngine is closed")
        if self._error is not None:  # the step thread is gone: nothing would ever answer
            raise RuntimeError(f"the engine failed earlier ({type(self._error).__name__}: {self._error}); "
                               "restart it")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="devin-engine", daemon=True)
            self._thread.start()

    # -- request API ------------------------------------------------------
    async def stream(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                     request_id: str | None = None) -> AsyncIterator[int]:
        """Yield the request's new tokens as steps produce them."""
        async for out in self._outputs(prompt, params, request_id):
            for tok in out.new_ids:
                yield tok

    async def generate(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> RequestOutput:
        """Run one request to completion alongside every other in flight."""
        last = None
        async for out in self._outputs(prompt, params, request_id):
            last = out
        return last

    def outputs(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's :class:`RequestOutput` after every step that touched it (its
        ``new_ids``, and ``finish_reason`` / ``metrics`` on the last); closing the iterator
        early (``aclose()``) aborts the request."""
        return self._outputs(prompt, params, request_id)

    def add_step_hook(self, fn) -> None:
        """Call ``fn(StepInfo)`` on the step thread after every engine step that ran a batch
        (:meth:`Engine.add_step_hook`; e.g. the server's per-step trace spans). ``fn`` must be quick."""
        self.engine.add_step_hook(fn)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None, None))
        self._wake.set()

    async def _outputs(self, prompt, params, request_id) -> AsyncIterator[RequestOutput]:
        self._ensure_thread()
        loop = asyncio.get_running_loop()
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        sink: asyncio.Queue = asyncio.Queue()
        self._sinks[rid] = (loop, sink)
        accepted = loop.create_future()
        self._inbox.put(("add", rid, (prompt, params), (loop, accepted)))
        self._wake.set()
        finished = False
        try:
            await accepted  # raises ValueError for an invalid request
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    if item.error:
                        raise RequestError(rid, item.error)
                    return
        finally:
            self._sinks.pop(rid, None)
            if not finished:
                self.abort(rid)  # cancelled or abandoned: free its blocks

    # -- the step thread ----------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._closed:
            self._drain()
            if engine.has_unfinished():
                try:
                    outs = engine.step()
                except BaseException as e:  # noqa: BLE001  (an engine bug: fail every waiting caller)
                    self._fail_all(e)
                    return
                for out in outs:
                    self._deliver(out.request_id, out)
                    if out.finished:
                        engine.forget(out.request_id)
                if not outs:
                    engine.wait_for_admission(0.005)
            else:
                self._wake.wait(0.05)
                self._wake.clear()
        for rid in list(self._sinks):
            engine.forget(rid)  # aborted

    def _drain(self) -> None:
        engine = self.engine
        while True:
            try:
                kind, rid, payload, reply = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                engine.forget(rid)  # aborted
                continue
            prompt, params = payload
            loop, fut = reply
            try:
                engine.add_request(prompt, params, request_id=rid)
            except ValueError as e:
                loop.call_soon_threadsafe(_settle, fut, e)
            else:
                loop.call_soon_threadsafe(_settle, fut, None)

    def _deliver(self, rid: str, item) -> None:
        sink = self._sinks.get(rid)
        if sink is not None:
            loop, q = sink
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _fail_all(self, error: BaseException) -> None:
        self._error = error
        for rid in list(self._sinks):
            self._deliver(rid, RuntimeError(f"engine step failed: {type(error).__name__}: {error}"))


def _settle(fut: asyncio.Future, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
