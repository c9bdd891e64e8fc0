"""A small HTTP/1.1 client on asyncio streams, one connection per request (``Connection: close``).

The soak needs what a high-level client hides: sending exactly the bytes it wants (bad JSON, a body
past the server's limit), reading server-sent events as they arrive, and going away mid-answer by
closing the socket. The body is read by ``Content-Length``, chunked transfer coding, or to EOF.
"""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass
class Response:
    status: int
    headers: dict[str, str]  # lower-case names
    reader: asyncio.StreamReader

    async def chunks(self):
        """The body's bytes as they arrive."""
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    return
                data = await self.reader.readexactly(size + 2)
                yield data[:-2]
        elif "content-length" in self.headers:
            yield await self.reader.readexactly(int(self.headers["content-length"]))
        else:
            while data := await self.reader.read(65536):
                yield data

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    async def lines(self):
        """The body's lines (UTF-8, without the line ends) as they arrive."""
        buf = b""
        async for chunk in self.chunks():
            buf += chunk
            *done, buf = buf.split(b"\n")
            for line in done:
                yield line.rstrip(b"\r").decode()
        if buf:
            yield buf.decode()


async def _head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = (await reader.readuntil(b"\r\n")).decode("latin-1")
    status = int(status_line.split(" ", 2)[1])
    headers = {}
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


@asynccontextmanager
async def exchange(url: str, method: str, path: str, body: bytes | None = None):
    """Send one request to the server at ``url`` (``http://host:port``); yields the :class:`Response`
    once its head has arrived. Leaving the block closes the connection, read to the end or not."""
    where = urlsplit(url)
    reader, writer = await asyncio.open_connection(where.hostname, where.port)
    try:
        head = f"{method} {path} HTTP/1.1\r\nHost: {where.netloc}\r\nConnection: close\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        writer.write(head.encode() + b"\r\n" + (body or b""))
        try:
            await writer.drain()
        except ConnectionError:
            pass  # the server answered (e.g. 413 for a body past its limit) and closed before reading it all
        yield Response(*await _head(reader), reader)
    finally:
        writer.close()
        with suppress(OSError):
            await writer.wait_closed()


async def get(url: str, path: str) -> tuple[int, bytes]:
    async with exchange(url, "GET", path) as r:
        return r.status, await r.read()
