"""The HTTP side of ``minisgl bench serve``: one streamed request per connection, parsed as bytes arrive.

The client speaks HTTP/1.1 through an asyncio protocol (no HTTP library), so that
its cost per streamed chunk stays small next to what a fast server sends: a chunk
is found, timestamped and classified with a few byte searches; only the rare
chunks that carry usage or an error are parsed as JSON. Every chunk that arrives
in one socket read shares that read's timestamp.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, cast
from urllib.parse import urlsplit

_DATA = b"data:"
_DONE = b"[DONE]"
_QUOTE = 0x22  # '"'
_SPACE = 0x20
_USAGE_FIELD = b'"completion_tokens"'  # in every usage object
_ERROR_KEY = b'"error"'


@dataclass
class RequestResult:
    """What one streamed request did; times are ``time.perf_counter()`` seconds."""

    start: float
    max_tokens: int = 0
    drawn_input_tokens: int = 0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    """Arrival time of each chunk that carried output text."""
    usage_output_tokens: int | None = None
    usage_input_tokens: int | None = None
    usage_cached_tokens: int | None = None
    """``usage.prompt_tokens_details.cached_tokens``: prompt tokens the server took from its prefix cache."""
    turn: int = 0
    """The request's turn in its conversation (0: the first)."""
    error: str | None = None
    reads: int = 0
    """Socket reads of the response (fewer than chunks when several chunks arrive together)."""
    text_payloads: list[bytes] | None = None
    """The raw JSON of each text chunk, kept only when the caller needs the answer's text."""

    def answer(self, chat: bool) -> str:
        """The streamed answer's text (needs ``text_payloads``)."""
        parts = []
        for payload in self.text_payloads or ():
            try:
                first = (json.loads(payload).get("choices") or [{}])[0]
                parts.append(((first.get("delta") or {}).get("content") if chat else first.get("text")) or "")
            except (ValueError, AttributeError, IndexError):
                continue  # counted as a text chunk already; its text is not worth failing the conversation
        return "".join(parts)


@dataclass(frozen=True)
class Target:
    """Where the server is: ``http(s)://host:port[/prefix]`` (a trailing ``/v1`` is accepted and dropped)."""

    host: str
    port: int
    tls: bool
    prefix: str
    api_key: str | None = None

    @classmethod
    def from_url(cls, url: str, api_key: str | None = None) -> Target:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--base-url must look like http://HOST:PORT, got '{url}'")
        tls = parts.scheme == "https"
        prefix = parts.path.rstrip("/").removesuffix("/v1")
        return cls(parts.hostname, parts.port or (443 if tls else 80), tls, prefix, api_key)

    @property
    def url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{self.host}:{self.port}{self.prefix}"

    def request(self, method: str, path: str, body: bytes = b"") -> bytes:
        """The whole HTTP/1.1 request; the connection closes after the response."""
        head = [
            f"{method} {self.prefix}{path} HTTP/1.1",
            f"Host: {self.host}:{self.port}",
            "Accept: text/event-stream, application/json",
            "Connection: close",
            f"Content-Length: {len(body)}",
        ]
        if body:
            head.append("Content-Type: application/json")
        if self.api_key:
            head.append(f"Authorization: Bearer {self.api_key}")
        return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class _SseSink:
    """Consumes the body of a 200 streaming response: one ``data:`` line per event."""

    def __init__(self, result: RequestResult, text_key: bytes, keep_text: bool):
        self.result = result
        self.text_key = text_key
        self.tail = b""
        self.done = False
        if keep_text:
            result.text_payloads = []

    def feed(self, data: bytes, now: float) -> bool:
        """Take the next body bytes; True when the stream is over ([DONE] or an error event)."""
        if self.tail:
            data = self.tail + data
        lines = data.split(b"\n")
        self.tail = lines.pop()
        key = self.text_key
        skip = len(key)
        for line in lines:
            if not line.startswith(_DATA):
                continue  # blank separators, comments, event names
            payload = line[5:].strip()
            # Only chunks with a usage object or an error are worth parsing; every chunk of
            # some servers carries "usage": null, so look for a field inside the object.
            if _USAGE_FIELD in payload or _ERROR_KEY in payload:
                if self._parse(payload, now):
                    return True
                continue
            if payload == _DONE:
                self.done = True
                return True
            # A text chunk: the key, then a non-empty string ('"content":"x' or '"content": "x').
            i = payload.find(key)
            if i >= 0:
                i += skip
                if payload[i + 1] == _SPACE:
                    i += 1
                if payload[i + 1] == _QUOTE and payload[i + 2] != _QUOTE:
                    self.result.chunk_times.append(now)
                    if self.result.text_payloads is not None:
                        self.result.text_payloads.append(payload)
        return False

    def _parse(self, payload: bytes, now: float) -> bool:
        """A chunk with usage or an error: parse it in full. True if it ends the stream."""
        try:
            event = json.loads(payload)
        except ValueError:
            self.result.error = f"unparseable stream event: {payload[:200]!r}"
            return True
        if not isinstance(event, dict):
            return False
        if event.get("error"):
            self.result.error = "error event: " + _error_message(event)
            return True
        usage = event.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                self.result.usage_output_tokens = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                self.result.usage_input_tokens = usage["prompt_tokens"]
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                self.result.usage_cached_tokens = details["cached_tokens"]
        for choice in event.get("choices") or ():
            text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
            if text:
                self.result.chunk_times.append(now)
                if self.result.text_payloads is not None:
                    self.result.text_payloads.append(payload)
                break
        return False


def _error_message(obj: Any) -> str:
    """The human-readable part of an OpenAI-style error body."""
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


class _Response(asyncio.Protocol):
    """One request, one response: parses the head, then the chunked (or plain) body as it arrives."""

    def __init__(self, request: bytes, result: RequestResult, sink: _SseSink | None, done: asyncio.Future[None]):
        self.request = request
        self.result = result
        self.sink = sink  # None: collect the body (a JSON answer, or an error)
        self.done = done
        self.transport: asyncio.BaseTransport | None = None
        self.head: bytes | None = b""  # None once the head is parsed
        self.status = 0
        self.chunked = False
        self.length: int | None = None  # content-length left, for a non-chunked body
        self.buf = b""
        self.left = 0  # bytes left in the current chunk
        self.body = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        cast(asyncio.WriteTransport, transport).write(self.request)  # uvloop's transports are not asyncio's classes

    def data_received(self, data: bytes) -> None:
        now = perf_counter()
        if self.done.done():
            return
        self.result.reads += 1
        try:
            if self.head is not None:
                data = self._read_head(data)
                if not data:
                    return
            if self.chunked:
                self._dechunk(data, now)
            else:
                if self.length is not None:
                    data = data[: self.length]
                    self.length -= len(data)
                self._deliver(data, now)
                if self.length == 0:
                    self._body_end(now)
        except Exception as exc:  # a response this parser cannot read fails its request, never the run
            self._finish(now, f"unreadable response: {type(exc).__name__}: {exc}")

    def _read_head(self, data: bytes) -> bytes:
        assert self.head is not None
        head = self.head + data
        end = head.find(b"\r\n\r\n")
        if end < 0:
            self.head = head
            return b""
        self.head = None
        lines = head[:end].decode("latin-1").split("\r\n")
        try:
            self.status = int(lines[0].split()[1])
        except (IndexError, ValueError):
            self._finish(perf_counter(), f"malformed HTTP status line: {lines[0][:100]!r}")
            return b""
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "transfer-encoding" and "chunked" in value.lower():
                self.chunked = True
            elif name == "content-length":
                self.length = int(value.strip())
        if self.status != 200:
            self.sink = None
        if not self.chunked and self.length == 0:
            self._body_end(perf_counter())
        return head[end + 4 :]

    def _dechunk(self, data: bytes, now: float) -> None:
        if not self.buf and not self.left:
            # The common case: a read holds exactly one whole chunk (one event).
            eol = data.find(b"\r\n")
            if 0 < eol < 16 and data.endswith(b"\r\n") and b";" not in data[:eol]:
                start = eol + 2
                size = int(data[:eol], 16)
                if size and start + size + 2 == len(data):
                    self._deliver(data[start:-2], now)
                    return
        buf = self.buf + data if self.buf else data
        pos, n = 0, len(buf)
        parts: list[bytes] = []
        while pos < n:
            if self.left == 0:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                if eol == pos:  # the CRLF that closes a chunk's data
                    pos += 2
                    continue
                size = int(buf[pos:eol].split(b";", 1)[0], 16)
                pos = eol + 2
                if size == 0:
                    self.buf = b""
                    self._deliver(b"".join(parts), now)
                    self._body_end(now)
                    return
                self.left = size
            take = min(self.left, n - pos)
            parts.append(buf[pos : pos + take])
            pos += take
            self.left -= take
        self.buf = buf[pos:]
        if parts:
            self._deliver(parts[0] if len(parts) == 1 else b"".join(parts), now)

    def _deliver(self, data: bytes, now: float) -> None:
        if self.done.done() or not data:
            return
        if self.sink is None:
            if len(self.body) < 1 << 24:
                self.body += data
        elif self.sink.feed(data, now):
            self._finish(now, self.result.error)

    def _body_end(self, now: float) -> None:
        if self.done.done():
            return
        if self.status != 200:
            self._finish(now, f"HTTP {self.status}: {_body_error(bytes(self.body))}")
        elif self.sink is not None and not self.sink.done:
            self._finish(now, "the stream ended without [DONE]")
        else:
            self._finish(now, None)

    def eof_received(self) -> bool | None:
        if not self.chunked and self.length is None and self.head is None:
            self._body_end(perf_counter())  # a body delimited by the connection's end
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f": {exc}" if exc else ""
        self._finish(perf_counter(), f"connection closed before the response ended{reason}")

    def _finish(self, now: float, error: str | None) -> None:
        if self.done.done():
            return
        self.result.end = now
        if error is not None and self.result.error is None:
            self.result.error = error
        self.done.set_result(None)
        if self.transport is not None:
            self.transport.close()


def _body_error(body: bytes) -> str:
    try:
        return _error_message(json.loads(body))[:300]
    except ValueError:
        return body[:300].decode("utf-8", "replace")


async def _exchange(
    target: Target, request: bytes, result: RequestResult, sink: _SseSink | None, timeout: float
) -> bytes:
    """Send ``request`` and wait for the response; failures land in ``result.error``. Returns the collected body."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    proto = _Response(request, result, sink, done)
    tls = ssl.create_default_context() if target.tls else None
    transport: asyncio.BaseTransport | None = None
    try:
        async with asyncio.timeout(timeout):
            transport, _ = await loop.create_connection(lambda: proto, target.host, target.port, ssl=tls)
            await done
    except TimeoutError:
        result.error = result.error or f"timed out after {timeout:g} s"
    except OSError as exc:
        result.error = result.error or f"connection failed: {exc}"
    finally:
        if not done.done():
            done.cancel()  # the protocol records nothing more
        if transport is not None:
            transport.close()
        if not result.end:
            result.end = perf_counter()
    return bytes(proto.body)


async def stream(
    target: Target,
    path: str,
    body: dict[str, Any],
    *,
    keep_text: bool = False,
    timeout: float = 600.0,
) -> RequestResult:
    """POST one streaming completion request and time its chunks. Never raises for a failed request."""
    data = json.dumps(body).encode()
    result = RequestResult(start=perf_counter())
    text_key = b'"content"' if "messages" in body else b'"text"'
    await _exchange(target, target.request("POST", path, data), result, _SseSink(result, text_key, keep_text), timeout)
    return result


async def get_json(target: Target, path: str, timeout: float = 30.0) -> Any:
    """GET a JSON document; raises RuntimeError with the server's message when it fails."""
    result = RequestResult(start=perf_counter())
    body = await _exchange(target, target.request("GET", path), result, None, timeout)
    if result.error:
        raise RuntimeError(f"GET {target.url}{path}: {result.error}")
    try:
        return json.loads(body)
    except ValueError as exc:
        raise RuntimeError(f"GET {target.url}{path}: not JSON ({exc}): {body[:200]!r}") from None
