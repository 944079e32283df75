"""In-flight load shared between the processes of one ``kvplug serve --processes N``.

The same events as router replicas share over NATS (:class:`kvplug.replica_sync.ReplicaLoad`:
added / first token / finished, heartbeats, ``bye``), carried between the processes of one host
over Unix stream sockets in a directory the supervisor creates (mode 0700): process ``i``
listens on ``load-<i>.sock`` and connects to every other process's socket. One JSON batch per
line (msgspec's JSON never contains a raw newline), at most every ``flush_s``.

Why streams rather than datagrams: a stream never drops a batch while the peer lives (asyncio
buffers what the kernel cannot take yet), and a lost "finished" would leave load on a worker
for good; and a connection that closes says its process is gone, so the requests it had
announced are released at once rather than after ``expiry_s`` (still applied to a peer that
hangs without closing).

A process that (re)starts hears, on each new connection, the requests that peer has in flight
at that moment (as "added" events, plus "first token" for those past it), so a restarted
process sees the fleet's load from its first request on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvplug.load import ActiveRequest
from kvplug.replica_sync import ReplicaLoad
from kvplug.tasks import cancel_and_wait

log = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode
_MAX_LINE = 16 * 1024 * 1024  # a batch longer than this is a broken peer, not a burst
_ADDED_PREFILL = 5  # an "a" event's uncached prefill tokens (ReplicaLoad.added_event)


def load_socket(directory: str, index: int) -> str:
    return os.path.join(directory, f"load-{index}.sock")


class _Inbound(asyncio.Protocol):
    """One peer's connection to us: newline-separated batches."""

    def __init__(self, owner: LocalLoadSync) -> None:
        self.owner = owner
        self.buf = bytearray()
        self.peers: set[str] = set()  # replica ids heard on this connection

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.owner._inbound.add(self)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\n")
            if end < 0:
                if len(self.buf) > _MAX_LINE:
                    self.owner.stats.dropped_malformed += 1
                    self.transport.close()
                return
            line = bytes(self.buf[:end])
            del self.buf[: end + 1]
            peer = self.owner.apply_line(line)
            if peer is not None:
                self.peers.add(peer)

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner._inbound.discard(self)
        self.owner.peer_gone(self.peers)


class _Outbound(asyncio.Protocol):
    """Our connection to one peer: we only write; ``closed`` resolves when it ends."""

    def __init__(self, closed: asyncio.Future[None]) -> None:
        self.closed = closed

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


class LocalLoadSync(ReplicaLoad):
    """Shares this process's request lifecycle with the other ``count - 1`` processes of one
    serve, and folds theirs in (``index`` is this process's number, ``0 <= index < count``)."""

    def __init__(
        self,
        router: Any,
        directory: str,
        index: int,
        count: int,
        *,
        replica_id: str | None = None,
        flush_s: float = 0.001,
        heartbeat_s: float = 1.0,
        expiry_s: float = 5.0,
        reconnect_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            router, replica_id or f"p{index}.{os.getpid()}", expiry_s=expiry_s, clock=clock
        )
        self.directory = directory
        self.index = index
        self.count = count
        self.flush_s = flush_s
        self.heartbeat_s = heartbeat_s
        self.reconnect_s = reconnect_s
        self._outbox: list[list[Any] | None] = []
        # request id -> where its "a" (its "t") waits in the outbox, until the flush: what a
        # "f" in the same batch makes moot is taken out (the outbox's holes), never sent
        self._unsent: dict[str, int] = {}
        self._unsent_first: dict[str, int] = {}
        self._holes = 0
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self._flush_timer: asyncio.TimerHandle | None = None  # armed by a batch's first event
        self._seq = 0
        self._server: asyncio.AbstractServer | None = None
        self._out: dict[int, asyncio.Transport] = {}  # peer index -> our connection to it
        self._inbound: set[_Inbound] = set()  # peers' connections to us
        self._tasks: list[asyncio.Task] = []
        self.send_failures = 0  # batches not written to a peer (it was not connected)
        self.unsent_requests = 0  # added and finished within one batch: not sent at all

    async def start(self) -> None:
        path = load_socket(self.directory, self.index)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # this index's previous process, which died
        loop = self._loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Inbound(self), path)
        self.attach()
        self._tasks = [
            asyncio.create_task(self._connect(j), name=f"kvplug-local-sync-peer-{j}")
            for j in range(self.count)
            if j != self.index
        ]
        self._tasks.append(
            asyncio.create_task(self._heartbeats(), name="kvplug-local-sync-heartbeat")
        )
        log.info("process %s shares load with %d other processes", self.index, self.count - 1)

    async def close(self) -> None:
        """Stop; peers release this process's requests when its connections close."""
        self.detach()
        await cancel_and_wait(self._tasks)
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        for transport in self._out.values():
            with contextlib.suppress(Exception):
                transport.write(self._line([["bye"]]))
            transport.close()
        self._out.clear()
        if self._server is not None:
            self._server.close()
            self._server = None
            with contextlib.suppress(OSError):
                os.unlink(load_socket(self.directory, self.index))
        for inbound in list(self._inbound):  # peers see us gone, as if the process had exited
            inbound.transport.close()

    def connected_peers(self) -> list[int]:
        return sorted(self._out)

    # -- outgoing --------------------------------------------------------------------------
    async def _connect(self, peer: int) -> None:
        """Keep one connection to ``peer``'s socket (it may be starting or restarting)."""
        loop = asyncio.get_running_loop()
        path = load_socket(self.directory, peer)
        while True:
            closed: asyncio.Future[None] = loop.create_future()
            try:
                transport, _ = await loop.create_unix_connection(
                    functools.partial(_Outbound, closed), path
                )
            except OSError:  # not listening yet (or any more)
                await asyncio.sleep(self.reconnect_s)
                continue
            # a new connection is a new peer process (or a new us): it has heard nothing of
            # ours. Pending events go to the peers that have; the newcomer gets a snapshot
            # of what is in flight now, which already contains them
            self._flush()
            snapshot = self._inflight_events()
            if snapshot:
                transport.write(self._line(snapshot))
            self._out[peer] = transport  # type: ignore[assignment]
            try:
                await closed
            finally:
                self._out.pop(peer, None)
                transport.close()
            await asyncio.sleep(self.reconnect_s)

    # -- this process's requests (ReplicaLoad's listener, with the batch in view) -------------
    def added(self, r: ActiveRequest) -> None:
        event = self.added_event(r)
        if event is not None:
            self._unsent[r.request_id] = len(self._outbox)
            self._queue(event)

    def first_token(self, request_id: str) -> None:
        at = self._unsent.get(request_id)
        if at is None:
            self._unsent_first[request_id] = len(self._outbox)
            self._queue(["t", request_id])
        else:  # its "a" has not left: it leaves as a prefill already done ("a" then "t")
            self._outbox[at][_ADDED_PREFILL] = 0  # type: ignore[index]

    def finished(self, request_id: str) -> None:
        at = self._unsent.pop(request_id, None)
        if at is not None:  # added and finished within one batch: a peer folds it in and out
            # in one step, between two of its decisions, so not sending it changes nothing
            self._outbox[at] = None
            self._holes += 1
            self.unsent_requests += 1
            return
        at = self._unsent_first.pop(request_id, None)
        if at is not None:  # a finish releases the prefill too, at the same moment of the fold
            self._outbox[at] = None
            self._holes += 1
        self._queue(["f", request_id])

    def _queue(self, event: list[Any]) -> None:
        self._outbox.append(event)
        # a batch's first event arms one timer: a burst of decisions within flush_s shares one
        # batch. A timer rather than a task woken per batch: no futures, no task steps
        if self._flush_timer is None and self._loop is not None:
            self._flush_timer = self._loop.call_later(self.flush_s, self._flush_due)

    def _flush_due(self) -> None:
        self._flush_timer = None
        self._flush()

    def _line(self, events: list[list[Any]]) -> bytes:
        self._seq += 1
        return _encode({"replica": self.replica_id, "seq": self._seq, "events": events}) + b"\n"

    def _publish(self, events: list[list[Any]]) -> None:
        line = self._line(events)
        for peer in range(self.count):
            if peer == self.index:
                continue
            transport = self._out.get(peer)
            if transport is None or transport.is_closing():
                self.send_failures += 1
                continue
            transport.write(line)
        self.stats.published_batches += 1
        self.stats.published_events += len(events)

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        if self._holes:
            events = [e for e in outbox if e is not None]
            self._holes = 0
        else:
            events = outbox  # type: ignore[assignment]
        self._unsent.clear()
        self._unsent_first.clear()
        if events:
            self._publish(events)

    def _inflight_events(self) -> list[list[Any]]:
        """This process's own requests in flight, as the events that announced them."""
        remote: set[str] = set().union(*self._remote.values())
        events: list[list[Any]] = []
        for request_id, r in self.router.load.requests.items():
            if request_id in remote:
                continue
            added = self.added_event(r)
            if added is not None:
                events.append(added)
                if r.prefill_done:
                    events.append(["t", request_id])
        return events

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            self._publish([])
            self.expire_silent_peers()

    # -- incoming --------------------------------------------------------------------------
    def apply_line(self, line: bytes) -> str | None:
        """Fold one peer batch in; returns the peer's id (None for a malformed batch)."""
        return self.apply_wire_batch(line)

    def peer_gone(self, peers: set[str]) -> None:
        """A peer's connection closed: its process stopped or died, its requests are done."""
        for peer in peers:
            if peer in self._remote or peer in self.stats.peers:
                self._release_peer(peer)

    def stats_dict(self) -> dict[str, int]:
        out = super().stats_dict()
        out["send_failures"] = self.send_failures
        out["connected_peers"] = len(self._out)
        return out
