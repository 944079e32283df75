"""The sole consumer of one TRT-LLM worker's draining ``POST /kv_cache_events``.

Every read drains the engine's event queue, so exactly one poller per worker may exist (a
second one — another router, TRT-LLM's own ``kv_cache_aware`` router, a debugging ``curl`` —
would silently split the stream). The poller keeps one request in flight at a time, decodes
each answer with the worker's ``TrtllmDecoder`` (which owns the per-rank ``event_id`` checks)
and hands the events to ``deliver``.

Loss handling: an answer that never arrived whole (timeout or connection reset after the
request was sent, an unparsable body, a non-200 status) may have drained events kvplug never
saw, so every rank of the worker is cleared (``AllCleared``) and rebuilt from the live stream;
TRT-LLM has no replay. A refused connection drained nothing and clears nothing (a restarted
engine announces itself with ``created`` at ``event_id`` 0).

Robustness: no answer stops the poller. An answer nested too deep to parse is unparsable (a
lost answer, above); a decoder bug on an answer costs that answer (counted ``decoder_errors``,
handled as lost); any other failure of a round is counted (``internal_errors``), logged and
followed by the next round. ``running`` is False once ``run`` has returned for any reason: the
adapter's readiness says so.

Pacing: after a non-empty answer the next poll goes at once (``min_interval``); empty answers
back off ×1.5 up to ``max_interval``. Builds ≤ 1.3.0rc9 hold an idle poll ≈2 s before
answering ``[]``; the request timeout allows for that.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
from kvplug.integrations.common import DECODE_ERRORS

from kvplug import KvEvent
from kvplug.frontend.timeouts import within

from .events import TrtllmDecoder, read_envelope

log = logging.getLogger("kvplug.integrations.trtllm")

MAX_BODY = 64 << 20  # one drained answer; a bigger one is treated as garbage
_json = msgspec.json.Decoder()
_envelopes = msgspec.json.Decoder(list[msgspec.Raw])


def parse_answer(body: bytes) -> tuple[list | None, str]:
    """A drained answer's body -> (its envelopes, "") or (None, why it is unusable). Never
    raises: nesting past the recursion limit is unparsable like any other bad JSON.

    The array is split into each envelope's raw JSON, and each is read typed if it is a
    stored event of the usual shape, else as a dict (``events.read_envelope``). An answer a
    plain JSON decode refuses is refused whole, as before: the split checks the syntax, the
    reads check the numbers, the UTF-8 inside strings is checked here. One exception: a
    number out of a float's range (``1e999``) in a field of a stored envelope that kvplug does
    not read is skipped unread there, and the answer is used (Python's ``json`` would read it
    as inf)."""
    if len(body) > MAX_BODY:
        return None, f"answer over {MAX_BODY} bytes"
    try:
        if not body.isascii():
            body.decode("utf-8")
        raws = _envelopes.decode(body)
    except msgspec.ValidationError:  # JSON, but not an array
        return _not_a_list(body)
    except (*DECODE_ERRORS, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        return None, f"unparsable JSON: {type(exc).__name__}: {exc}"
    try:  # ints of any size, like json.loads
        return [read_envelope(raw) for raw in raws], ""
    except DECODE_ERRORS as exc:
        return None, f"unparsable JSON: {type(exc).__name__}: {exc}"


def compare_readers(
    body: bytes, typed: TrtllmDecoder, checked: TrtllmDecoder
) -> tuple[list[KvEvent] | None, str | None]:
    """One answer to two decoders of the same stream: ``typed`` fed as the poller feeds it
    (``parse_answer``'s envelopes, stored ones read typed), ``checked`` fed a plain JSON
    decode of the body (the dicts the checked reader takes). Returns ``typed``'s events (None
    if ``parse_answer`` refused the answer) and None, or what differs: the events, what either
    counted or dropped, either's per-rank state. For tests and the fuzzer."""
    envelopes, _ = parse_answer(body)
    try:
        plain = _json.decode(body) if len(body) <= MAX_BODY else None
    except msgspec.ValidationError as exc:
        # a number out of a float's range: parse_answer may take the answer (it is then in a
        # field kvplug does not read), and the checked reader gets Python's reading of it
        plain = json.loads(body) if envelopes is not None and "out of range" in str(exc) else None
    except (*DECODE_ERRORS, ValueError):
        plain = None
    if envelopes is None or not isinstance(plain, list):
        if envelopes is None and not isinstance(plain, list):
            return None, None
        took = "refused" if envelopes is None else "took"
        return None, f"parse_answer {took} an answer a plain JSON decode did not"
    got, want = typed.decode(envelopes), checked.decode(plain)
    if got != want:
        return got, f"events differ: {got!r} != {want!r}"
    for what in ("counts", "drops", "ranks", "hash_algo"):
        if getattr(typed, what) != getattr(checked, what):
            return got, f"{what} differ: {getattr(typed, what)!r} != {getattr(checked, what)!r}"
    return got, None


def _not_a_list(body: bytes) -> tuple[None, str]:
    try:
        answer = _json.decode(body)
    except (*DECODE_ERRORS, ValueError) as exc:
        return None, f"unparsable JSON: {type(exc).__name__}: {exc}"
    return None, f"answer is {type(answer).__name__}, not a list"


class TrtllmPoller:
    def __init__(
        self,
        url: str,
        decoder: TrtllmDecoder,
        deliver: Callable[[list[KvEvent]], Any],
        *,
        session: aiohttp.ClientSession,
        min_interval: float = 0.005,
        max_interval: float = 0.1,
        timeout: float = 10.0,
    ) -> None:
        self.url = url.rstrip("/") + "/kv_cache_events"
        self.decoder = decoder
        self.deliver = deliver
        self.session = session
        self.min_interval = min_interval
        self.max_interval = max_interval
        self.timeout = timeout
        self.counts: Counter[str] = Counter()
        self.last_ok_at: float | None = None
        self.connected = False
        self.running = False  # True while run() is polling
        self._interval = min_interval

    @property
    def worker_id(self) -> str:
        return self.decoder.worker_id

    async def run(self) -> None:
        """Poll until cancelled; a failing round is counted and the next one follows."""
        self.running = True
        try:
            while True:
                try:
                    got = await self.poll_once()
                except Exception:  # a bug must cost one round, never the worker's events
                    self.counts["internal_errors"] += 1
                    self.connected = False  # not trusted again until a round succeeds
                    log.exception("trtllm worker %s: event poll failed", self.worker_id)
                    got = 0
                if got:
                    self._interval = self.min_interval
                else:
                    self._interval = min(self.max_interval, self._interval * 1.5)
                await asyncio.sleep(self._interval)
        finally:
            self.running = False
            self.connected = False

    async def poll_once(self) -> int:
        """One drain. Returns how many envelopes it carried (0 on error)."""
        try:
            # the deadline is ``within``'s, which a stall of this loop does not fire (the
            # answer drains the engine's queue: one cancelled by our own stall is lost)
            status, body = await within(self._post(), self.timeout)
            if status != 200:
                self._lost(f"HTTP {status}")
                return 0
        except aiohttp.ClientConnectorError as exc:
            # nothing was sent, nothing drained: the worker is down (or not up yet)
            self.counts["connect_errors"] += 1
            if self.connected:
                log.warning("trtllm worker %s: %s unreachable: %s", self.worker_id, self.url, exc)
            self.connected = False
            return 0
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._lost(f"{type(exc).__name__}: {exc}")
            return 0
        envelopes, why = parse_answer(body)
        if envelopes is None:
            self._lost(why)
            return 0
        self.connected = True
        self.last_ok_at = time.monotonic()
        self.counts["polls"] += 1
        if not envelopes:
            self.counts["empty_polls"] += 1
            return 0
        self.counts["envelopes"] += len(envelopes)
        try:
            events = self.decoder.decode(envelopes)
        except Exception:  # never by contract; if so, the answer is lost, not the poller
            self.counts["decoder_errors"] += 1
            log.exception("trtllm worker %s: decoder failed on a drained answer", self.worker_id)
            self._lost("decoder error")
            return 0
        if events:
            self.deliver(events)
        return len(envelopes)

    async def _post(self) -> tuple[int, bytes]:
        async with self.session.post(self.url, timeout=aiohttp.ClientTimeout(total=None)) as resp:
            if resp.status != 200:
                return resp.status, b""
            return 200, await resp.content.read(MAX_BODY + 1)

    def _lost(self, why: str) -> None:
        """An answer that may have drained events we never saw: clear and resync."""
        self.counts["lost_answers"] += 1
        log.warning(
            "trtllm worker %s: event drain lost (%s); clearing its blocks", self.worker_id, why
        )
        events = self.decoder.lost_stream()
        if events:
            self.deliver(events)
