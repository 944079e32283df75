"""The control plane of the compiled HTTP data path (``kvplug/frontend/native_lane.py``).

The compiled lane reads a client's request, writes it to the engine and relays the answer in C;
for each plain request it calls back here: ``decide`` once (route it: the engine's request head
and kvplug's answer headers), ``first_byte`` when a streamed answer starts (time to first token,
prefill load released) and ``finish`` once per decided request (trace, load, ``/metrics``,
outlier detection; when the engine failed before answering, the retry on another worker or the
502). Each step is the Python path's own code in ``Frontend`` (``route_stage``,
``answer_headers``, ``record_answer``, ``attempt_failed``, ``unavailable_error``,
``count_request``), so the two paths record the same things.

What is served here: a ``POST /v1/completions`` whose body the token-id parser reads
(``parsing.parse_token_prompt``: a model, a prompt of token ids, no ``nvext``), and, with a
local ``--tokenizer``, a text completion or a chat request whose prompt it tokenizes on the
loop (``TokenResolver.resolve_now``), without ``nvext`` or a batch; from a client with the right
``--api-key``, for a model the fleet serves, within ``--max-prompt-tokens``, on an aggregated
fleet of ``http://`` engines without the admission queue. Anything else makes ``decide`` return
None and the lane hands the connection to the Python server, which answers as it always did
(its errors, batches, engine tokenization, P/D, the queue). Routing failures after a request
was accepted (503s, the 502 once retries are spent) are answered here, with the Python path's
status, headers and body.

Output tokens come from the answer's last bytes (``tail``, up to ``TAIL_BYTES``): a non-streamed
answer's ``usage.completion_tokens``; a stream's count as ``streaming.SseCounter`` makes it: a
stream longer than the tail is handed over 4 KiB at a time as it passes (``stream_bytes``), so
the router hears its output at block boundaries 4 KiB apart (the Python path: at each chunk);
where routing reads each output block as it is crossed (``Router.hears_output_progress``:
output-block tracking), streams are left to the Python path. (An affinity setting with
``read_ms`` reads the outputs too, but summed into each engine's context, which reports 4 KiB
apart move by under one percent: those streams stay on the lane.)
"""

from __future__ import annotations

import hmac
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from multidict import CIMultiDict

from kvplug.frontend.app import Frontend
from kvplug.frontend.context import RequestContext
from kvplug.frontend.engine_http import header_lines, request_target
from kvplug.frontend.errors import ApiError
from kvplug.frontend.fleet import RANK_HEADER
from kvplug.frontend.hints import NO_HINTS
from kvplug.frontend.parsing import (
    CHAT,
    COMPLETIONS,
    ParsedRequest,
    parse_request_general,
    parse_token_prompt,
)
from kvplug.frontend.streaming import (
    SseCounter,
    completion_tokens,
    engine_error_text,
    mid_answer_error,
    mid_stream_event,
    sse_error,
    stream_timeout_error,
    whole_answer_read,
)
from kvplug.frontend.upstream import UpstreamUnavailable
from kvplug.workers import Stage

log = logging.getLogger(__name__)

# decide's kind: the endpoint the lane read
KIND_COMPLETIONS = 0
KIND_CHAT = 1
_PATHS = (COMPLETIONS, CHAT)

# finish's outcome
OK = 0
CLIENT_GONE = 1
UNAVAILABLE = 2  # no answer body: refused, reset, closed, per-try timeout, empty 5xx (retried)
FAILED_MID_ANSWER = 3
TIMED_OUT = 4  # the engine's silence (--idle-timeout)
DEADLINE = 5  # --request-timeout (a stream: until its first bytes), then --max-stream-duration

TAIL_BYTES = 4096  # the most of an answer's last bytes the lane hands to finish

# the lane sends no reason for an engine that failed before its answer head when it has none
_NO_ANSWER = "no answer head (connection refused, reset or closed, or --per-try-timeout passed)"
_BROKE_OFF = "the engine's connection ended before the answer did"
_UNREACHABLE = "not an http:// engine the native lane can reach"
_NO_WORKERS: frozenset[str] = frozenset()
_WRITTEN_HERE = frozenset({"content-type", "x-request-id"})  # by _attempt's head, for every request
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')
_USAGE_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')

_ANSWER_HEADERS = (
    b"x-kvplug-decision-id: %s\r\nx-kvplug-worker: %s\r\nx-kvplug-dp-rank: %d\r\n"
    b"X-Request-Id: %s\r\n"
)

Decided = tuple[int, bytes, bytes | None, bytes, "GlueRequest"]
Answer = tuple[int, bytes, bytes]


class _Target:
    """One engine URL as the lane reaches it: its upstream id and, per endpoint, the head's
    start up to the ``Content-Length`` value (request line, Host, Content-Type)."""

    __slots__ = ("upstream_id", "host", "port", "heads")

    def __init__(self, upstream_id: int, host: str, port: int, heads: tuple[bytes, ...]) -> None:
        self.upstream_id = upstream_id
        self.host = host
        self.port = port
        self.heads = heads


class GlueRequest:
    """One decided request (``decide``'s token): what ``finish`` needs of it."""

    __slots__ = (
        "ctx",
        "routed",
        "kind",
        "started",
        "attempt",
        "exclude",
        "failures",
        "request_id",
        "hop_lines",
        "finished",
        "counter",
    )

    def __init__(
        self, ctx: RequestContext, kind: int, started: float, request_id: bytes, hop_lines: bytes
    ) -> None:
        self.ctx = ctx
        self.routed: Any = None  # the current attempt's Routed
        self.kind = kind
        self.started = started  # time.perf_counter() when decide began
        self.attempt = 0
        self.exclude: set[str] = set()  # workers that failed this request before answering
        self.failures: list[str] = []
        self.counter: SseCounter | None = None  # a long stream's reader (stream_bytes)
        self.request_id = request_id  # as sent to the engine
        # the engine's header lines besides the request line, Host, Content-Type, Content-Length
        # and X-Request-Id: its Authorization and the client's forwarded fields, or b""
        self.hop_lines = hop_lines
        self.finished = False


def _usage_total(tail: bytes) -> int | None:
    """``completion_tokens`` of the last ``"usage"`` object in ``tail``; None when there is
    none, or the last ``"usage"`` is not an object (``null`` in a stream's chunks). A quote
    inside a JSON string is escaped, so ``"usage"`` after no backslash is a key, not text."""
    at = tail.rfind(b'"usage"')
    while at > 0 and tail[at - 1] == 0x5C:
        at = tail.rfind(b'"usage"', 0, at)
    if at < 0:
        return None
    opened = _USAGE_OBJECT.match(tail, at)
    if opened is None:
        return None
    end = tail.find(b"\n\n", at)  # within its own event (a stream) or the rest (a body)
    found = _USAGE_TOKENS.search(tail, opened.end(), end if end >= 0 else len(tail))
    return int(found.group(1)) if found else None


def _last_event(status: int, result: str, error: str | None) -> Answer | None:
    """The event a stream that broke off ends with, as ``streaming.relay`` writes it (the lane
    sends the body as the stream's last chunk); None for a stream that ended by itself."""
    if result == "upstream_failed_mid_stream":
        return status, b"", mid_stream_event(error or "")
    if result == "stream_timeout":
        return status, b"", sse_error(error or "", 504, "timeout_error")
    return None


def answer_tokens(tail: bytes) -> int | None:
    """``usage.completion_tokens`` of a non-streamed answer from its last bytes: the whole
    body's when the tail is all of it, else the last usage object's (engines put it last)."""
    if len(tail) < TAIL_BYTES:
        return completion_tokens(tail)
    return _usage_total(tail)


def stream_tokens(tail: bytes) -> tuple[int | None, Any]:
    """(output tokens, the engine's streamed error or None) of a stream from its last bytes:
    the last usage chunk's total (``stream_options.include_usage``: the engine's own count,
    which ``SseCounter`` also takes over its own), else ``SseCounter``'s count when the tail is
    the whole stream, else None (not known). A partial tail is read from its first whole
    event."""
    if b'"error"' not in tail:
        total = _usage_total(tail)
        if total is not None:
            return total, None
    counter = SseCounter()
    if len(tail) < TAIL_BYTES:
        counter.feed(tail)
        return counter.tokens, counter.engine_error
    cut = tail.find(b"\n\n")
    if cut >= 0:
        counter.feed(tail[cut + 2 :])
    return counter.usage, counter.engine_error


class NativeGlue:
    """``decide`` / ``first_byte`` / ``finish`` / ``upstream_of`` for the compiled lane, on one
    ``Frontend``. ``register_upstream(id, host, port)``, when set, hears each upstream id
    before the first ``decide`` that uses it."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.register_upstream: Callable[[int, str, int], None] | None = None
        self._ids: dict[tuple[str, int], int] = {}  # (host, port) -> upstream id, never reused
        self._targets: dict[str, _Target | None] = {}  # worker URL -> target (None: not http)
        self._epoch = -1  # the fleet epoch _targets were checked at
        self._servable = False  # _fleet_servable's answer at _epoch
        self._bearer: tuple[str, bytes] | None = None  # (--api-key, b"Bearer <key>")
        self._engine_auth: tuple[str, bytes] | None = None  # (--engine-api-key, its line)

    # -- the lane's callbacks ------------------------------------------------------------------
    def decide(
        self,
        kind: int,
        body: bytes,
        request_id: bytes | None,
        authorization: bytes | None,
        fields: bytes | None = None,
    ) -> Decided | Answer | None:
        started = time.perf_counter()
        fe = self.frontend
        if not self._fleet_servable():
            return None
        s = fe.settings
        if s.api_key and not hmac.compare_digest(authorization or b"", self._bearer_for(s.api_key)):
            return None  # the Python path answers the 401
        if request_id is not None and not request_id.isascii():
            return None  # the Python path decides what such an id becomes
        if len(body) > s.max_body_bytes:
            return None
        req = parse_token_prompt(body) if kind == KIND_COMPLETIONS else None
        if req is None:
            req = self._parse_text(kind, body)
            if req is None:
                return None
        if req.stream and fe.router.hears_output_progress():
            return None  # the Python path tells the router each output block a stream crosses
        try:
            model_workers = fe._check_model(req)
            resolved = fe.tokens.resolve_now(req)
            if resolved is None:
                return None  # the engine's /tokenize (or none): the Python path waits for it
            tokens, source = resolved
            fe.check_prompt_tokens(tokens, "prompt")
        except ApiError:
            return None  # the Python path answers the 404 / 400
        # from here the request is this path's: counted as the Python path counts it
        fe.request_started()
        fe.count_token_source(source)
        # no hints: the bodies taken have no nvext and the lane hands off hint headers
        ctx = fe.request_context(
            req,
            request_id.decode() if request_id else None,
            tokens,
            source,
            None,
            NO_HINTS,
            model_workers,
        )
        rid = request_id or ctx.request_id.encode()
        lines = self._auth_line(authorization) if fields is None else self._hop_lines(fields, rid)
        return self._attempt(GlueRequest(ctx, kind, started, rid, lines))

    def _parse_text(self, kind: int, body: bytes) -> ParsedRequest | None:
        """A text completion or a chat request, when a local tokenizer can give its ids;
        None for what the Python path serves (no tokenizer, a bad body, a batch, nvext)."""
        if self.frontend.tokens.tokenizer is None:
            return None
        try:
            req = parse_request_general(body, _PATHS[kind])
        except ApiError:
            return None
        return req if req.nvext is None and req.prompts is None else None

    def first_byte(self, token: GlueRequest) -> None:
        token.routed.lifecycle.first_token()

    def stream_bytes(self, token: GlueRequest, data: bytes) -> None:
        """4 KiB of a stream's body as it passes (a stream longer than the lane's tail): read
        as the Python path's relay reads it, its output reported at block boundaries."""
        if token.counter is None:
            token.counter = SseCounter()
        token.counter.feed(data)
        token.routed.lifecycle.output(token.counter.tokens)

    def finish(
        self, token: GlueRequest, status: int, outcome: int, tail: bytes
    ) -> Decided | Answer | None:
        if token.finished:
            log.error("finish called twice for request %s", token.ctx.request_id)
            return None
        fe = self.frontend
        routed = token.routed
        reason = _BROKE_OFF
        if outcome == TIMED_OUT:
            # the engine fell silent for --idle-timeout: the Python path's engine client fails
            # the same way, before the answer head (retried) or within the answer
            reason = (
                f"no byte from the engine within --idle-timeout ({fe.settings.idle_timeout:g} s)"
            )
            outcome = UNAVAILABLE if status == 0 else FAILED_MID_ANSWER
        if outcome == UNAVAILABLE:
            if tail:
                reason = tail.decode(errors="replace")
            elif reason is _BROKE_OFF:
                reason = _NO_ANSWER
            exc = UpstreamUnavailable(routed.decision.worker_id, reason)
            attempts = fe.settings.retries + 1
            token.attempt += 1
            retrying = token.attempt < attempts
            fe.attempt_failed(
                routed, Stage.AGGREGATED, exc, token.exclude, token.failures, retrying
            )
            if retrying:
                return self._attempt(token)
            return self._answer_error(
                token, fe.unavailable_error(token.ctx, attempts, token.failures)
            )
        token.finished = True
        routed.entry.inflight -= 1
        try:
            return self._finished(token, status, outcome, tail, reason)
        finally:
            routed.lifecycle.finish()

    def upstream_of(self, worker_id: str) -> tuple[int, str, int] | None:
        """The lane's upstream for a worker: (id, host, port); None if the lane cannot reach
        it (not ``http://``) or the worker is unknown."""
        entry = self.frontend.fleet.workers.get(worker_id)
        target = None if entry is None else self._target(entry.url_base)
        return None if target is None else (target.upstream_id, target.host, target.port)

    # -- steps -----------------------------------------------------------------------------------
    def _attempt(self, token: GlueRequest) -> Decided | Answer:
        """Route one attempt and give the lane what to send where."""
        fe = self.frontend
        ctx = token.ctx
        try:
            routed = fe.route_stage(
                ctx,
                Stage.AGGREGATED,
                token.attempt,
                frozenset(token.exclude) if token.exclude else _NO_WORKERS,
                None,
            )
        except ApiError as err:  # no worker can take it (503), counted by route_stage
            return self._answer_error(token, err)
        token.routed = routed
        entry = routed.entry
        entry.inflight += 1
        d = routed.decision
        target = self._targets.get(entry.url_base) or self._target(entry.url_base)
        if target is None:  # a retry's worker, added since decide, that the lane cannot reach
            entry.inflight -= 1
            routed.lifecycle.finish()
            routed.record.outcome, routed.record.error = "unavailable", _UNREACHABLE
            token.failures.append(str(UpstreamUnavailable(d.worker_id, _UNREACHABLE)))
            return self._answer_error(
                token, fe.unavailable_error(ctx, token.attempt + 1, token.failures)
            )
        rank = entry.rank_on_url(d.dp_rank)  # as Frontend.open_upstream sends it
        head = b"%s%d\r\nX-Request-Id: %s\r\n%s%s\r\n" % (
            target.heads[token.kind],
            len(ctx.req.raw),
            token.request_id,
            b"" if rank is None else b"%s: %d\r\n" % (RANK_HEADER.encode(), rank),
            token.hop_lines,
        )
        # Frontend.answer_headers' lines, formatted at once (the tests check they are equal)
        answer = _ANSWER_HEADERS % (
            routed.record.decision_id.encode(),
            d.worker_id.encode(),
            d.dp_rank,
            token.request_id,
        )
        # None: the client's body, as the token-id parser keeps it (it takes no nvext to strip)
        return target.upstream_id, head, None, answer, token

    def _finished(
        self, token: GlueRequest, status: int, outcome: int, tail: bytes, reason: str
    ) -> Answer | None:
        """The answer's end in the trace and ``/metrics`` (``reason``: why an answer broke
        off); the lifecycle is finished after."""
        fe = self.frontend
        ctx, routed = token.ctx, token.routed
        path = _PATHS[token.kind]
        lc = routed.lifecycle
        if outcome == CLIENT_GONE:  # as the Python path's cancelled handler counts it
            fe.client_gone(ctx)
            fe.count_request(path, 499, False, token.started)
            return None
        if outcome == DEADLINE and not lc.first_seen:  # the whole answer, or a stream's start
            return self._answer_error(token, fe._timed_out(ctx))
        if not lc.first_seen:  # a whole answer, not a stream
            if outcome == FAILED_MID_ANSWER:
                fe.record_answer(ctx, routed, status, "upstream_failed_mid_stream", reason, 0)
                fe.count_request(path, 502, ctx.req.stream, token.started)
                headers = fe.answer_headers(ctx, routed)
                headers["Content-Type"] = "application/json"
                return 502, header_lines(headers), mid_answer_error(reason)
            whole_answer_read(lc, status, answer_tokens(tail) if status == 200 else None)
            fe.record_answer(ctx, routed, status, "ok", None, lc.tokens)
            fe.count_request(path, status, ctx.req.stream, token.started)
            return None
        if token.counter is None:  # the whole stream is in the tail
            total, engine_error = stream_tokens(tail)
        else:
            token.counter.feed(tail)
            total, engine_error = token.counter.tokens, token.counter.engine_error
        if total:
            lc.output(total)
        if outcome == FAILED_MID_ANSWER:
            result, error = "upstream_failed_mid_stream", reason
        elif outcome == DEADLINE:
            result, error = "stream_timeout", stream_timeout_error(fe.settings.max_stream_duration)
        elif engine_error is not None:
            result, error = "engine_error", engine_error_text(engine_error)
        else:
            result, error = "ok", None
        fe.record_answer(ctx, routed, status, result, error, total)
        fe.count_request(path, status, ctx.req.stream, token.started)
        return _last_event(status, result, error)

    def _answer_error(self, token: GlueRequest, err: ApiError) -> Answer:
        """An error answer the lane writes as is (the Python path's status, headers, body)."""
        fe = self.frontend
        token.finished = True
        if err.status < 500:
            fe.metrics.rejected.labels(err.code).inc()
        fe.count_request(_PATHS[token.kind], err.status, False, token.started)
        headers = {"Content-Type": "application/json", **err.headers}
        return err.status, header_lines(headers), err.payload()

    # -- engines and keys ------------------------------------------------------------------------
    def _fleet_servable(self) -> bool:
        """Whether this path serves the fleet (checked again when it changes): no admission
        queue, no prefill workers, and every worker an engine the lane can reach (routing may
        pick any of them)."""
        fe = self.frontend
        fleet = fe.fleet
        if fleet.epoch != self._epoch:
            self._epoch = fleet.epoch
            targets = [self._target(e.url_base) for e in list(fleet.workers.values())]
            self._servable = (
                fe.queue is None and not fleet.disaggregated and all(t is not None for t in targets)
            )
        return self._servable

    def _target(self, url_base: str) -> _Target | None:
        if url_base in self._targets:
            return self._targets[url_base]
        target = None
        heads = []
        for path in _PATHS:
            try:
                (scheme, host, port), line = request_target(url_base + path)
            except Exception:  # a URL the engine client would refuse too
                break
            if scheme != "http":
                break
            heads.append(line + b"Content-Type: application/json\r\nContent-Length: ")
        else:
            upstream_id = self._ids.get((host, port))
            if upstream_id is None:
                upstream_id = self._ids[(host, port)] = len(self._ids)
                if self.register_upstream is not None:
                    self.register_upstream(upstream_id, host, port)
            target = _Target(upstream_id, host, port, tuple(heads))
        self._targets[url_base] = target
        return target

    def _bearer_for(self, key: str) -> bytes:
        cached = self._bearer
        if cached is None or cached[0] != key:
            cached = self._bearer = (key, f"Bearer {key}".encode())
        return cached[1]

    def _hop_lines(self, fields: bytes, request_id: bytes) -> bytes:
        """The engine's header lines for a head with fields of the client's to forward:
        ``Frontend.hop_headers`` of those fields (the client's, minus hop-by-hop ones and
        kvplug's, with the Authorization its rules give), less the Content-Type and
        X-Request-Id lines this path writes itself. The lane takes ASCII heads only."""
        client: CIMultiDict[str] = CIMultiDict()
        for line in fields.split(b"\r\n"):
            name, _, value = line.partition(b":")
            client.add(name.decode("ascii"), value.strip(b" \t").decode("ascii"))
        hop = self.frontend.hop_headers(client, request_id.decode())
        return header_lines({k: v for k, v in hop.items() if k.lower() not in _WRITTEN_HERE})

    def _auth_line(self, authorization: bytes | None) -> bytes:
        """The ``Authorization`` the engine gets, as ``Frontend.hop_headers`` decides it: the
        engine key; none when the client's was kvplug's own key; else the client's."""
        s = self.frontend.settings
        if s.engine_api_key:
            cached = self._engine_auth
            if cached is None or cached[0] != s.engine_api_key:
                line = f"Authorization: Bearer {s.engine_api_key}\r\n".encode()
                cached = self._engine_auth = (s.engine_api_key, line)
            return cached[1]
        if s.api_key is not None or authorization is None:
            return b""
        return b"Authorization: " + authorization + b"\r\n"
