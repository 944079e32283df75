"""Batched completions (``prompt`` as a list of 2+ prompts), split into one sub-request per
prompt so each is routed on its own tokens, then merged into what one engine would answer.

Each prompt is a request of its own for the router: its own tokens, Decision, trace, load and
lifecycle (first token, block boundaries, finish). The sub-requests go out concurrently, each
with the client's body and ``prompt`` replaced by its prompt, and ``X-Request-Id`` =
``<request id>-<prompt index>``. The answers are merged as vLLM numbers a batch
(``vllm/entrypoints/openai/serving_completion.py``: streamed choice index =
``prompt_idx * n + output.index``; non-streamed choices appended prompt by prompt with
``index=len(choices)``, the same numbers): choice ``j`` of prompt ``i`` becomes ``i * n + j``.

* Non-streamed: one JSON, choices in prompt order, ``usage`` summed (``prompt_tokens``,
  ``completion_tokens``, ``total_tokens``, and ``prompt_tokens_details.cached_tokens`` when the
  engines report it), ``id`` = ``cmpl-<request id>``, one ``created``, the other top-level
  fields of the first prompt's answer.
* Streamed: the sub-streams' chunks interleaved as they arrive, each chunk's choice indexes
  remapped and its ``id``/``created`` made the batch's; the sub-streams' final usage chunks
  (``stream_options.include_usage``) are held back and sent as one summed usage chunk at the
  end; one ``data: [DONE]``.
* Errors: a sub-request that cannot be routed or sent (after the usual retry) or that the
  engine answers with an error status fails the whole request with that status and body (the
  headers name the failing prompt's worker and decision, ``x-kvplug-batch-failed-prompt`` its
  index); the other sub-requests are cancelled (their engine connections closed) and every
  sub-request's load is released. Once a stream has started, an error event from one
  sub-stream is passed on, the others are cancelled and the stream ends with ``[DONE]``; a
  sub-stream that breaks ends the stream with an error event (no ``[DONE]``, as for a single
  request).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from aiohttp import web

from kvplug.frontend.context import RequestContext, Routed
from kvplug.frontend.errors import ApiError
from kvplug.frontend.parsing import ParsedRequest
from kvplug.frontend.streaming import SseCounter, completion_tokens, sse_error
from kvplug.workers import Stage

if TYPE_CHECKING:
    from kvplug.frontend.app import Frontend  # the caller; a type only (no import cycle)
    from kvplug.frontend.hints import RequestHints

log = logging.getLogger(__name__)

_decode = msgspec.json.decode
_encode = msgspec.json.encode
_DONE = b"data: [DONE]\n\n"
_USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")


# -- merging (pure) ---------------------------------------------------------------------------
def remap_choices(choices: list[Any], prompt_index: int, n: int) -> None:
    """Choice ``j`` of prompt ``i`` is choice ``i * n + j`` of the batch (in place)."""
    base = prompt_index * n
    for choice in choices:
        if isinstance(choice, dict):
            index = choice.get("index")
            choice["index"] = base + (index if isinstance(index, int) else 0)


def sum_usage(usages: list[Any]) -> dict[str, Any] | None:
    """Token counts summed over the prompts' ``usage`` objects (None when none has one)."""
    found = [u for u in usages if isinstance(u, dict)]
    if not found:
        return None
    total: dict[str, Any] = {k: 0 for k in _USAGE_KEYS}
    cached = None
    for u in found:
        for k in _USAGE_KEYS:
            v = u.get(k)
            if isinstance(v, int):
                total[k] += v
        details = u.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            cached = (cached or 0) + details["cached_tokens"]
    if cached is not None:
        total["prompt_tokens_details"] = {"cached_tokens": cached}
    return total


def merge_answers(answers: list[dict[str, Any]], n: int, batch_id: str, created: int) -> dict:
    """The non-streamed answers of the prompts (in prompt order) as one batch answer."""
    merged = dict(answers[0])
    choices: list[Any] = []
    for i, answer in enumerate(answers):
        part = answer.get("choices")
        if isinstance(part, list):
            remap_choices(part, i, n)
            choices.extend(part)
    merged["id"] = batch_id
    merged["created"] = created
    merged["choices"] = choices
    usage = sum_usage([a.get("usage") for a in answers])
    if usage is not None:
        merged["usage"] = usage
    return merged


class SseEvents:
    """Splits an SSE byte stream into the payloads of its ``data:`` lines."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        out: list[bytes] = []
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            for line in buf[start:end].split(b"\n"):
                if line.startswith(b"data:"):
                    out.append(line[5:].strip())
            start = end + 2
        self._buf = buf[start:]
        return out


# -- serving ----------------------------------------------------------------------------------
class _SubFailed(Exception):
    """A sub-request failed before its answer started: this becomes the batch's answer."""

    def __init__(self, part: _Part, status: int, body: bytes, ctype: str) -> None:
        super().__init__(f"prompt {part.index}: HTTP {status}")
        self.part = part
        self.status = status
        self.body = body
        self.ctype = ctype


@dataclass(eq=False)
class _Part:
    index: int
    ctx: RequestContext
    routed: Routed | None = None
    upstream: Any = None
    first: bytes = b""
    released: bool = False
    answer: dict[str, Any] | None = None

    def release(self, outcome: str | None = None, error: str | None = None) -> None:
        """Give back this prompt's load and engine connection (idempotent)."""
        routed = self.routed
        if routed is None or self.released:
            return
        self.released = True
        routed.entry.inflight -= 1
        lc = routed.lifecycle
        lc.finish()
        rec = routed.record
        if outcome is not None and rec.outcome == "in_flight":
            rec.outcome, rec.error = outcome, error
        rec.output_tokens = lc.tokens
        rec.total_s = time.perf_counter() - lc.started
        if lc.first_at is not None:
            rec.ttft_s = lc.first_at - lc.started
        up = self.upstream
        if up is not None:
            if up.content.at_eof():
                up.release()
            else:
                up.close()  # the engine aborts the request


def _choices_per_prompt(body: dict[str, Any]) -> int:
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


async def serve_batch(
    fe: Frontend,
    request: web.Request,
    req: ParsedRequest,
    hints: RequestHints,
    model_workers: frozenset[str] | None,
) -> web.StreamResponse:
    prompts = req.prompts
    assert prompts is not None
    base = {k: v for k, v in req.body.items() if k != "nvext"}
    subs: list[ParsedRequest] = []
    for p in prompts:
        body = {**base, "prompt": p}
        sub = ParsedRequest(
            req.path,
            _encode(body),
            req.model,
            req.stream,
            decoded=body,
            cache_salt=req.cache_salt,
        )
        if isinstance(p, str):
            sub.prompt_text = p
        else:
            sub.prompt_ids = p
        subs.append(sub)
    resolved = await asyncio.gather(*(fe.tokens.resolve(sub) for sub in subs))
    for i, (tokens, source, _) in enumerate(resolved):
        fe.count_token_source(source)
        fe.check_prompt_tokens(tokens, f"prompt[{i}]")

    request_id = request.headers.get("X-Request-Id") or f"kvplug-{fe._id_prefix}-{next(fe._keys)}"
    forward = fe.hop_headers(request.headers, request_id)
    parts: list[_Part] = []
    for i, (sub, (tokens, source, note)) in enumerate(zip(subs, resolved, strict=True)):
        sub_id = f"{request_id}-{i}"
        ctx = RequestContext(
            next(fe._keys), sub_id, sub, tokens, source, note, hints, model_workers
        )
        ctx.forward = {**forward, "X-Request-Id": sub_id}
        parts.append(_Part(i, ctx))
    batch = _Batch(fe, request, req, parts, request_id)
    try:
        return await batch.run()
    finally:
        for part in parts:
            _cancel(part)
            fe.admitted(part.ctx)


def _cancel(part: _Part, why: str = "the batch ended before this prompt's answer") -> None:
    part.release("cancelled", why)
    for rec in part.ctx.records:  # also attempts cancelled while they were being sent
        if rec.outcome == "in_flight":
            rec.outcome, rec.error = "cancelled", why


class _Batch:
    def __init__(
        self,
        fe: Frontend,
        request: web.Request,
        req: ParsedRequest,
        parts: list[_Part],
        request_id: str,
    ) -> None:
        self.fe = fe
        self.request = request
        self.req = req
        self.parts = parts
        self.request_id = request_id
        self.n = _choices_per_prompt(req.body)
        self.batch_id = f"cmpl-{request_id}"
        self.created = int(time.time())
        self.started = time.perf_counter()
        self.usage_chunks: list[dict[str, Any]] = []  # streamed final usage chunks, held

    # -- phase 1: every prompt routed, sent, and (non-streamed) answered ------------------
    async def _open(self, part: _Part) -> None:
        fe = self.fe
        ctx = part.ctx
        try:
            if fe.queue is not None:
                await fe.admit(self.request, ctx)
            routed, upstream, first = await fe.open_upstream(
                ctx, Stage.AGGREGATED, ctx.req.raw, ctx.forward, None, None
            )
        except ApiError as exc:
            exc.message = f"prompt {part.index} of the batch: {exc.message}"
            exc.headers = {**exc.headers, "x-kvplug-batch-failed-prompt": str(part.index)}
            raise
        part.routed, part.upstream, part.first = routed, upstream, first
        rec = routed.record
        rec.batch = {
            "request_id": self.request_id,
            "prompt_index": part.index,
            "size": len(self.parts),
        }
        rec.status = upstream.status
        ctype = upstream.headers.get("Content-Type", "")
        streamed = ctype.startswith("text/event-stream")
        if upstream.status != 200 or streamed != self.req.stream:
            body = first + await upstream.content.read()
            routed.lifecycle.first_token(measured=False)
            if upstream.status == 200:  # a 200 in the wrong shape: not mergeable
                body = _encode(
                    {
                        "error": {
                            "message": f"worker {routed.decision.worker_id} answered prompt "
                            f"{part.index} with {ctype or 'no content type'}, not "
                            f"{'an SSE stream' if self.req.stream else 'JSON'}",
                            "type": "upstream_error",
                            "code": "engine_bad_answer",
                        }
                    }
                )
                ctype = "application/json"
            rec.error = body[:500].decode(errors="replace")
            part.release("engine_error", rec.error)
            if upstream.status >= 500:  # a sick engine (outlier detection); a 4xx is the client's
                fe.outliers.failure(routed.decision.worker_id, f"HTTP {upstream.status}")
            raise _SubFailed(part, upstream.status if upstream.status != 200 else 502, body, ctype)
        if self.req.stream:
            return
        body = first + await upstream.content.read()
        routed.lifecycle.first_token(measured=False)  # a whole answer, after its decode
        total = completion_tokens(body)
        if total:
            routed.lifecycle.output(total)
        try:
            answer = _decode(body)
        except msgspec.DecodeError:
            answer = None
        if not isinstance(answer, dict):
            part.release("engine_error", "not a JSON object")
            raise _SubFailed(part, 502, _bad_json(part, routed), "application/json")
        part.answer = answer
        part.release("ok")

    async def _open_all(self) -> None:
        """Run ``_open`` for every prompt; the first failure cancels the others and is raised."""
        tasks = [asyncio.ensure_future(self._open(p)) for p in self.parts]
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    exc = task.exception()
                    if exc is not None:
                        raise exc
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _headers(self) -> dict[str, str]:
        decisions = [p.routed.decision for p in self.parts if p.routed is not None]
        return {
            "x-kvplug-decision-id": ",".join(
                p.routed.record.decision_id for p in self.parts if p.routed is not None
            ),
            "x-kvplug-worker": ",".join(d.worker_id for d in decisions),
            "x-kvplug-dp-rank": ",".join(str(d.dp_rank) for d in decisions),
            "X-Request-Id": self.request_id,
        }

    async def run(self) -> web.StreamResponse:
        try:
            await self._open_all()
        except _SubFailed as exc:
            routed = exc.part.routed
            assert routed is not None
            headers = {
                "Content-Type": exc.ctype or "application/json",
                "x-kvplug-decision-id": routed.record.decision_id,
                "x-kvplug-worker": routed.decision.worker_id,
                "x-kvplug-dp-rank": str(routed.decision.dp_rank),
                "x-kvplug-batch-failed-prompt": str(exc.part.index),
                "X-Request-Id": self.request_id,
            }
            return web.Response(status=exc.status, body=exc.body, headers=headers)
        except ApiError as exc:
            exc.headers = {**exc.headers, "X-Request-Id": self.request_id}
            raise
        if not self.req.stream:
            answers = [p.answer for p in self.parts]
            merged = merge_answers(answers, self.n, self.batch_id, self.created)  # type: ignore[arg-type]
            headers = {**self._headers(), "Content-Type": "application/json"}
            return web.Response(body=_encode(merged), headers=headers)
        return await self._stream()

    # -- phase 2 (streamed): interleave the sub-streams ------------------------------------
    async def _pump(self, part: _Part, queue: asyncio.Queue) -> None:
        """Forward one sub-stream's events (remapped) to ``queue``; then ``(part, None)``."""
        routed = part.routed
        assert routed is not None
        lc = routed.lifecycle
        counter = SseCounter()
        events = SseEvents()
        chunk = part.first
        error: Any = None
        try:
            while chunk:
                counter.feed(chunk)
                if counter.events and not lc.first_seen:
                    lc.first_token()
                lc.output(counter.tokens)
                for payload in events.feed(chunk):
                    out = self._rewrite(part, payload)
                    if out is not None:
                        await queue.put((part, out))
                chunk = await part.upstream.content.readany()
            lc.output(counter.tokens)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.fe.metrics.upstream_errors.labels(routed.decision.worker_id, "mid_stream").inc()
            log.warning("batch %s prompt %d: stream broke: %s", self.request_id, part.index, error)
            part.release("upstream_failed_mid_stream", error)
            await queue.put((part, _Broken(error)))
            return
        if counter.engine_error is not None:
            part.release("engine_error", _encode(counter.engine_error)[:500].decode())
            await queue.put((part, _EngineError()))
            return
        part.release("ok")
        await queue.put((part, None))

    def _rewrite(self, part: _Part, payload: bytes) -> bytes | None:
        """One event of prompt ``part.index`` as the batch's event; None: held or dropped."""
        if payload == b"[DONE]":
            return None
        try:
            chunk = _decode(payload)
        except msgspec.DecodeError:
            return b"data: " + payload + b"\n\n"
        if not isinstance(chunk, dict):
            return b"data: " + payload + b"\n\n"
        if "error" in chunk:
            return b"data: " + payload + b"\n\n"
        choices = chunk.get("choices")
        if not choices and isinstance(chunk.get("usage"), dict):
            self.usage_chunks.append(chunk)  # the final usage chunk: summed at the end
            return None
        if isinstance(choices, list):
            remap_choices(choices, part.index, self.n)
        if "id" in chunk:
            chunk["id"] = self.batch_id
        if "created" in chunk:
            chunk["created"] = self.created
        return b"data: " + _encode(chunk) + b"\n\n"

    async def _stream(self) -> web.StreamResponse:
        headers = {
            **self._headers(),
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
        }
        out = web.StreamResponse(status=200, headers=headers)
        try:
            await out.prepare(self.request)
        except ConnectionResetError:  # gone while the engines were starting
            for p in self.parts:
                _cancel(p, "client closed the connection")
            return out
        queue: asyncio.Queue = asyncio.Queue(maxsize=64)  # slow client: engines wait
        tasks = [asyncio.ensure_future(self._pump(p, queue)) for p in self.parts]
        running = len(tasks)
        end = _DONE
        why = "another prompt of the batch failed"
        try:
            try:
                while running:
                    part, item = await queue.get()
                    if item is None:
                        running -= 1
                        continue
                    if isinstance(item, _Broken):
                        end = sse_error(
                            f"the engine failed mid-stream on prompt {part.index}: {item}"
                        )
                        break
                    if isinstance(item, _EngineError):
                        break  # its error event was already passed on
                    await out.write(item)
            except ConnectionResetError:
                why = "client closed the connection"
                raise
            finally:
                # everything is released before the client sees the end of the stream
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                for p in self.parts:
                    _cancel(p, why)
                self._observe_ttft()
            if not running:
                usage = sum_usage([c.get("usage") for c in self.usage_chunks])
                if usage is not None:
                    final = dict(self.usage_chunks[0])
                    final.update(id=self.batch_id, created=self.created, usage=usage)
                    await out.write(b"data: " + _encode(final) + b"\n\n")
            await out.write(end)
            await out.write_eof()
        except ConnectionResetError:
            for p in self.parts:
                rec = p.routed.record if p.routed is not None else None
                if rec is not None and rec.outcome == "cancelled":
                    rec.outcome = "client_disconnected"
        return out

    def _observe_ttft(self) -> None:
        firsts = [
            p.routed.lifecycle.first_at
            for p in self.parts
            if p.routed is not None and p.routed.lifecycle.first_at is not None
        ]
        if firsts:
            self.fe.metrics.ttft_seconds.observe(min(firsts) - self.started)


class _Broken(str):
    """A sub-stream whose connection broke (the text says how)."""


class _EngineError:
    """A sub-stream that carried an engine error event."""


def _bad_json(part: _Part, routed: Routed) -> bytes:
    return _encode(
        {
            "error": {
                "message": f"worker {routed.decision.worker_id} answered prompt {part.index} "
                "with a body that is not a JSON object",
                "type": "upstream_error",
                "code": "engine_bad_answer",
            }
        }
    )
