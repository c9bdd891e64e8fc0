"""One request of the plan over HTTP (:mod:`.wire`): sent, read (server-sent events or one JSON body),
timed, and, for a cut-off stream, left after its planned number of content chunks (the connection is
closed, as a client that goes away closes it).

Times are client-side: TTFT from sending to the first chunk with text; inter-token latency between
consecutive chunks with text of a one-choice stream (a chunk carries one token, or a few when the
detokeniser held back part of a character).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from .plan import Item
from .wire import exchange


@dataclass
class Outcome:
    """What came back for one :class:`~.plan.Item`."""

    index: int
    status: int | None = None  # HTTP status (None: no answer)
    texts: dict = field(default_factory=dict)  # choice index -> text
    finish: dict = field(default_factory=dict)  # choice index -> finish_reason
    logprobs: dict = field(default_factory=dict)  # choice index -> the chosen tokens' logprobs
    usage: dict | None = None
    error: str | None = None  # an error body's message, an error event, or a client-side exception
    param: str | None = None  # an error body's param
    done: bool = False  # the whole answer arrived (a stream's [DONE])
    cut: bool = False  # the client left as planned
    ttft: float | None = None
    itl: list = field(default_factory=list)
    e2e: float | None = None


def _absorb(out: Outcome, choices: list, chat: bool) -> bool:
    """Add a body's or chunk's choices to ``out``; whether any text came."""
    got = False
    for c in choices:
        i = c["index"]
        text = (c.get("delta") or c.get("message") or {}).get("content") if chat else c.get("text")
        out.texts[i] = out.texts.get(i, "") + (text or "")
        got = got or bool(text)
        if c.get("finish_reason") is not None:
            out.finish[i] = c["finish_reason"]
        lp = c.get("logprobs")
        if lp:
            chosen = [e["logprob"] for e in lp["content"]] if chat else lp["token_logprobs"]
            out.logprobs.setdefault(i, []).extend(chosen)
    return got


def _error(out: Outcome, raw: bytes | dict) -> None:
    try:
        err = (raw if isinstance(raw, dict) else json.loads(raw))["error"]
        out.error, out.param = err.get("message"), err.get("param")
    except (ValueError, KeyError, TypeError):
        out.error = f"not an OpenAI error body: {raw[:200]!r}"


async def _plain(url: str, item: Item, out: Outcome) -> None:
    async with exchange(url, "POST", item.path, item.payload) as r:
        out.status, raw = r.status, await r.read()
    if r.status != 200:
        _error(out, raw)
        return
    body = json.loads(raw)
    _absorb(out, body["choices"], item.chat)
    out.usage, out.done = body.get("usage"), True


async def _events(url: str, item: Item, out: Outcome, t0: float) -> None:
    async with exchange(url, "POST", item.path, item.payload) as r:
        out.status = r.status
        if r.status != 200:
            _error(out, await r.read())
            return
        if item.cut_after == 0:
            out.cut = True  # leave once the answer has started, before any chunk is read
            return
        chunks, last = 0, None
        async for line in r.lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done = True
                return
            ev = json.loads(line[6:])
            if "error" in ev:
                _error(out, ev)
                continue
            out.usage = ev.get("usage") or out.usage
            if not _absorb(out, ev["choices"], item.chat):
                continue
            now = time.perf_counter()
            if out.ttft is None:
                out.ttft = now - t0
            elif item.n == 1:
                out.itl.append(now - last)
            last, chunks = now, chunks + 1
            if item.cut_after is not None and chunks >= item.cut_after:
                out.cut = True
                return


async def run_item(url: str, item: Item, timeout_s: float) -> Outcome:
    """Send ``item`` to the server at ``url``; never raises (a client-side failure, or no answer within
    ``timeout_s``, is ``error``)."""
    out = Outcome(item.index)
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(_events(url, item, out, t0) if item.stream else _plain(url, item, out), timeout_s)
    except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
            ValueError, KeyError) as e:
        out.error = f"client: {type(e).__name__}: {e}"
    out.e2e = time.perf_counter() - t0
    return out
