"""Relay an engine's answer to the client: SSE streams chunk by chunk with the payload bytes
unchanged, non-streamed bodies whole; output tokens are counted on the side to drive the
request's lifecycle.

Counting rule per SSE ``data:`` event: a ``usage.completion_tokens`` field is authoritative (the
running total); otherwise each choice adds ``len(token_ids)`` when the engine returns token ids,
else 1 when it carries text, content, reasoning or tool calls. One event is one decoding step in
vLLM, SGLang and TRT-LLM's OpenAI servers, so this is exact unless the engine batches steps.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from kvplug.frontend.engine_http import EngineResponse
from kvplug.frontend.lifecycle import Lifecycle

log = logging.getLogger(__name__)


class _Delta(msgspec.Struct):
    content: Any = None
    reasoning_content: Any = None
    reasoning: Any = None
    tool_calls: Any = None


class _Choice(msgspec.Struct):
    text: Any = None
    delta: _Delta | None = None
    token_ids: Any = None


class _Usage(msgspec.Struct):
    completion_tokens: int | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None


class _Body(msgspec.Struct):
    usage: _Usage | None = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)
_body_decoder = msgspec.json.Decoder(_Body)


class SseCounter:
    """Incremental SSE parser: counts data events and generated tokens."""

    __slots__ = ("_buf", "events", "tokens", "done", "engine_error", "unparsed", "usage")

    def __init__(self) -> None:
        self._buf = b""
        self.events = 0  # data events other than [DONE]
        self.tokens = 0
        self.done = False
        self.engine_error: Any = None  # an {"error": ...} event the engine streamed
        self.unparsed = 0
        self.usage: int | None = None  # the last usage.completion_tokens the engine streamed

    def feed(self, chunk: bytes) -> None:
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            self._event(buf[start:end])
            start = end + 2
        self._buf = buf[start:]

    def _event(self, block: bytes) -> None:
        for line in block.split(b"\n"):
            if not line.startswith(b"data:"):
                continue  # comments, event:, id:, retry:
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            self.events += 1
            try:
                chunk = _chunk_decoder.decode(payload)
            except msgspec.DecodeError:
                self.unparsed += 1
                self.tokens += 1  # an engine step we cannot read still is a step
                continue
            if chunk.error is not None:
                self.engine_error = chunk.error
            if chunk.usage is not None and chunk.usage.completion_tokens is not None:
                self.usage = chunk.usage.completion_tokens
                self.tokens = max(self.tokens, self.usage)
                continue
            for choice in chunk.choices or ():
                if choice.token_ids:
                    self.tokens += len(choice.token_ids)
                elif choice.text:
                    self.tokens += 1
                elif choice.delta is not None and (
                    choice.delta.content
                    or choice.delta.reasoning_content
                    or choice.delta.reasoning
                    or choice.delta.tool_calls
                ):
                    self.tokens += 1


def completion_tokens(body: bytes) -> int | None:
    """``usage.completion_tokens`` of a non-streamed answer, if it has one."""
    try:
        usage = _body_decoder.decode(body).usage
    except msgspec.DecodeError:
        return None
    return usage.completion_tokens if usage is not None else None


def whole_answer_read(lifecycle: Lifecycle, status: int, total: int | None) -> None:
    """A non-streamed answer arrived whole: its first token is now (not a measured one: it
    came after the decode), and an answer that reports ``usage.completion_tokens`` (``total``)
    is counted."""
    lifecycle.first_token(measured=False)
    if status == 200 and total:
        lifecycle.output(total)


def engine_error_text(error: Any) -> str:
    """An error event an engine streamed, as its trace shows it."""
    return json.dumps(error)[:500]


def mid_answer_error(why: str) -> bytes:
    """The 502 body of a non-streamed answer that broke off."""
    payload = {
        "error": {
            "message": f"the engine failed mid-answer: {why}",
            "type": "upstream_error",
            "code": "engine_failed",
        }
    }
    return json.dumps(payload).encode()


def sse_error(message: str, code: int = 502, type_: str = "upstream_error") -> bytes:
    payload = {"error": {"message": message, "type": type_, "code": code}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def mid_stream_event(why: str) -> bytes:
    """The last event of a stream whose engine broke off after its first bytes."""
    return sse_error(f"the engine failed mid-stream: {why}")


def stream_timeout_error(limit: float) -> str:
    """Why a stream was cut at ``--max-stream-duration`` (its trace's error, its last event's
    message: ``sse_error(..., 504, "timeout_error")``)."""
    return f"the stream ran past --max-stream-duration ({limit:g} s)"


def response_headers(upstream: EngineResponse, extra: dict[str, str]) -> dict[str, str]:
    headers = {"Content-Type": upstream.headers.get("Content-Type", "application/json")}
    rid = upstream.headers.get("X-Request-Id")
    if rid:
        headers["X-Request-Id"] = rid
    headers.update(extra)
    return headers


class _RelayedStream(web.StreamResponse):
    """A relayed stream's head waits for its first bytes, which the relay has in hand when it
    prepares the response: head and first event leave in one send, not two (aiohttp's
    ``web.Response`` buffers the same way; a plain ``StreamResponse`` sends its head alone)."""

    _send_headers_immediately = False


async def relay(
    request: web.Request,
    upstream: EngineResponse,
    first_chunk: bytes,
    lifecycle: Lifecycle,
    extra_headers: dict[str, str],
    max_stream_duration: float | None = None,
) -> tuple[web.StreamResponse, str, str | None]:
    """Send the engine's answer to the client. Returns (response, outcome, error).

    A stream still running ``max_stream_duration`` seconds after the relay began ends with an
    error event (outcome ``stream_timeout``). The caller owns ``lifecycle.finish()`` and
    releasing ``upstream``.
    """
    ctype = upstream.headers.get("Content-Type", "")
    headers = response_headers(upstream, extra_headers)
    if not ctype.startswith("text/event-stream"):
        # whole body: small answers (non-streamed completions, engine errors)
        try:
            body = first_chunk + await upstream.content.read() if first_chunk else b""
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            why = f"{type(exc).__name__}: {exc}"
            headers["Content-Type"] = "application/json"
            return (
                web.Response(status=502, body=mid_answer_error(why), headers=headers),
                "upstream_failed_mid_stream",
                why,
            )
        status = upstream.status
        whole_answer_read(lifecycle, status, completion_tokens(body) if status == 200 else None)
        return web.Response(status=upstream.status, body=body, headers=headers), "ok", None

    headers["Cache-Control"] = "no-cache"
    out = _RelayedStream(status=upstream.status, headers=headers)
    await out.prepare(request)
    counter = SseCounter()
    chunk = first_chunk
    tail = b""
    outcome: str = "ok"
    error: str | None = None
    loop = asyncio.get_running_loop()
    ends_at = None if max_stream_duration is None else loop.time() + max_stream_duration
    try:
        while chunk:
            counter.feed(chunk)
            if counter.events and not lifecycle.first_seen:
                lifecycle.first_token()
            lifecycle.output(counter.tokens)  # tells the router at block boundaries
            if upstream.at_eof():  # the engine's last bytes go out with the stream's end
                tail = chunk  # (one send, not two)
                break
            await out.write(chunk)
            if ends_at is None:  # the common case: no timer task per chunk
                chunk = await upstream.content.readany()
                continue
            try:
                chunk = await asyncio.wait_for(
                    upstream.content.readany(), max(0.0, ends_at - loop.time())
                )
            except asyncio.TimeoutError:
                if loop.time() < ends_at:
                    raise  # the engine's idle timeout: handled below
                upstream.close()  # the engine aborts the request
                outcome = "stream_timeout"
                error = stream_timeout_error(max_stream_duration or 0.0)  # not None here
                await out.write(sse_error(error, 504, "timeout_error"))
                break
        lifecycle.output(counter.tokens)
        if counter.engine_error is not None and outcome == "ok":
            outcome, error = "engine_error", engine_error_text(counter.engine_error)
    except ConnectionResetError:
        # the client went away: closing the engine connection makes the engine abort
        upstream.close()
        return out, "client_disconnected", "client closed the connection"
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        outcome, error = "upstream_failed_mid_stream", f"{type(exc).__name__}: {exc}"
        log.warning("engine stream broke after the first byte: %s", error)
        try:
            await out.write(mid_stream_event(error))
        except ConnectionResetError:
            pass
    try:
        await out.write_eof(tail)
    except ConnectionResetError:
        outcome = outcome if outcome != "ok" else "client_disconnected"
    return out, outcome, error
