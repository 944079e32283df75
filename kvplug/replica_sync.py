"""In-flight load shared between router replicas over NATS, so replicas do not herd.

Every replica subscribes to every engine's KV events, so their prefix indexes converge on their
own; what a replica cannot see is the requests *other* replicas have just sent. Without that, N
replicas that each see an idle worker all send to it. As Dynamo's router replicas do, each
replica publishes its own requests' lifecycle (added / first token / finished) on one NATS
subject, and folds every other replica's into its load tracker as if it had routed them.

Wire (JSON on ``kvplug.<namespace>.load``, one message per batch, sent at most every
``flush_s``): ``{"replica": id, "seq": n, "events": [[kind, request_id, ...], ...]}`` with kind
``"a"`` (added: worker id, DP rank, prompt tokens, uncached prefill tokens, decode blocks,
expected output length), ``"t"`` (first token), ``"f"`` (finished), and ``"bye"`` when a replica
stops. A batch with no events is a heartbeat (every ``heartbeat_s``). A replica silent for
``expiry_s`` is presumed dead and its requests are released, so a killed replica's load does not
stay on its workers forever.

What is approximate, on purpose: a remote request's prompt blocks are counted in full on the
worker (this replica does not know their hashes, so it cannot deduplicate them against its own
in-flight prompts), and output-block growth is not shared. Both overstate a busy worker's load
slightly, which errs toward spreading.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvplug.load import ActiveRequest
from kvplug.tasks import cancel_and_wait

log = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


@dataclass
class SyncStats:
    published_batches: int = 0
    published_events: int = 0
    received_batches: int = 0
    applied_events: int = 0
    dropped_unknown_worker: int = 0  # a peer routed to a worker this replica does not know
    dropped_malformed: int = 0
    expired_peers: int = 0
    late_heartbeats: int = 0  # ticks this event loop was too late for to judge peers' silence
    peers: dict[str, float] = field(default_factory=dict)  # peer id -> last heard (monotonic)


class ReplicaLoad:
    """The transport-free half of load sharing. As the router's
    :class:`kvplug.load.LoadListener` it turns this replica's request lifecycle into wire events,
    each handed to ``send``; ``apply_events`` folds a peer's events into the load tracker.
    :class:`LoadSync` carries the events over NATS; the simulator (``kvplug bench --replicas``)
    carries them in virtual time."""

    def __init__(
        self,
        router: Any,
        replica_id: str | None = None,
        *,
        send: Callable[[list[Any]], None] | None = None,
        expiry_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.router = router
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self.expiry_s = expiry_s
        self.clock = clock
        self.stats = SyncStats()
        self._send = send
        self._remote: dict[str, set[str]] = {}  # peer -> its request ids held here (prefixed)

    def attach(self) -> None:
        """Hear the router's own lifecycle from now on."""
        self.router.load.listener = self

    def detach(self) -> None:
        if self.router.load.listener is self:
            self.router.load.listener = None

    # -- this replica's requests (LoadListener) ----------------------------------------------
    def added(self, r: ActiveRequest) -> None:
        event = self.added_event(r)
        if event is not None:
            self._queue(event)

    def added_event(self, r: ActiveRequest) -> list[Any] | None:
        """The wire event of one of this replica's requests (None: its worker is gone)."""
        worker = self.router.ep_worker[r.endpoint]
        if worker is None:
            return None
        blocks = r.decode_blocks
        if r.deduplicated:  # the hashed chain lives in this replica's trie: send it in full
            blocks += r.prompt_tokens // self.router.load.block_size
        return [
            "a",
            r.request_id,
            worker,
            int(self.router.ep_rank[r.endpoint]),
            r.prompt_tokens,
            r.prefill_tokens,
            blocks,
            r.expected_osl,
        ]

    def first_token(self, request_id: str) -> None:
        self._queue(["t", request_id])

    def finished(self, request_id: str) -> None:
        self._queue(["f", request_id])

    def _queue(self, event: list[Any]) -> None:
        if self._send is not None:
            self._send(event)

    # -- peers' requests -------------------------------------------------------------------------
    def apply_wire_batch(self, data: bytes) -> str | None:
        """Decode one peer batch (the wire above) and fold it in; returns the peer's id, or
        None for a malformed batch, which is counted, never raised (NATS and the local
        transport of ``--processes`` carry the same batches)."""
        try:
            batch = _decode(data)
            peer = batch["replica"]
            events = batch["events"]
            if not isinstance(peer, str) or not isinstance(events, list):
                raise TypeError("bad batch shape")
        except Exception:
            self.stats.dropped_malformed += 1
            return None
        self.apply_events(peer, events)
        return peer

    def apply_events(self, peer: str, events: list[Any]) -> None:
        """Fold one batch of ``peer``'s events in; a bad event is counted, never raised.

        One loop, no call per event: a busy ``--processes`` serve folds thousands of events a
        second. The batch is folded in one synchronous step, so it is folded at one moment
        (one clock reading) and its workers' endpoints cannot change during it (looked up once
        per worker and rank)."""
        if peer == self.replica_id:
            return
        stats = self.stats
        stats.received_batches += 1
        now = self.clock()
        stats.peers[peer] = now
        held = self._remote.setdefault(peer, set())
        load = self.router.load
        endpoints: dict[tuple[Any, Any], int | None] = {}
        applied = 0
        for event in events:
            try:
                kind = event[0]
                if kind == "a":
                    _, request_id, worker, rank, prompt_tokens, prefill_tokens, blocks, osl = event
                    key = (worker, rank)
                    if key in endpoints:
                        ep = endpoints[key]
                    else:
                        ep = endpoints[key] = self.router.endpoint_of(str(worker), int(rank))
                    if ep is None:
                        stats.dropped_unknown_worker += 1
                        continue
                    rid = f"{peer}/{request_id}"
                    prompt_tokens = int(prompt_tokens)
                    load.add(
                        rid,
                        ep,
                        prompt_tokens,
                        max(prompt_tokens - int(prefill_tokens), 0),
                        track_prefill=True,
                        track_decode=True,
                        decode_blocks=float(blocks),
                        expected_osl=None if osl is None else int(osl),
                        track_output=False,
                        now=now,
                        notify=False,
                    )
                    held.add(rid)
                elif kind == "t":
                    load.first_token(f"{peer}/{event[1]}", now, notify=False)
                elif kind == "f":
                    rid = f"{peer}/{event[1]}"
                    if rid in held:
                        held.discard(rid)
                        load.finish(rid, now, notify=False)
                elif kind == "bye":
                    self._release_peer(peer)
                    continue
                else:
                    raise ValueError(f"unknown event kind {kind!r}")
                applied += 1
            except Exception:
                stats.dropped_malformed += 1
        stats.applied_events += applied

    def _release_peer(self, peer: str) -> None:
        now = self.clock()
        for rid in self._remote.pop(peer, set()):
            self.router.load.finish(rid, now, notify=False)
        self.stats.peers.pop(peer, None)

    def expire_silent_peers(self) -> list[str]:
        """Release the requests of peers not heard from for ``expiry_s`` (crashed replicas)."""
        cutoff = self.clock() - self.expiry_s
        gone = [p for p, seen in self.stats.peers.items() if seen < cutoff]
        for peer in gone:
            log.warning(
                "load sync: replica %s silent for %.1f s: its load released", peer, self.expiry_s
            )
            self._release_peer(peer)
            self.stats.expired_peers += 1
        return gone

    def remote_inflight(self) -> int:
        return sum(len(ids) for ids in self._remote.values())

    def stats_dict(self) -> dict[str, int]:
        """Counters for Router.stats() (so /metrics shows drops: kvplug_router_stat)."""
        st = self.stats
        return {
            "published_batches": st.published_batches,
            "published_events": st.published_events,
            "received_batches": st.received_batches,
            "applied_events": st.applied_events,
            "dropped_unknown_worker": st.dropped_unknown_worker,
            "dropped_malformed": st.dropped_malformed,
            "expired_peers": st.expired_peers,
            "late_heartbeats": st.late_heartbeats,
            "peers": len(st.peers),
            "remote_inflight": self.remote_inflight(),
        }


class LoadSync(ReplicaLoad):
    """Publishes this router's request lifecycle on NATS and folds in its peers'."""

    def __init__(
        self,
        router: Any,
        nats_url: str,
        *,
        namespace: str = "default",
        replica_id: str | None = None,
        flush_s: float = 0.001,
        heartbeat_s: float = 1.0,
        expiry_s: float = 5.0,
        connect_timeout: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(router, replica_id, expiry_s=expiry_s, clock=clock)
        self.nats_url = nats_url
        self.subject = f"kvplug.{namespace}.load"
        self.flush_s = flush_s
        self.heartbeat_s = heartbeat_s
        self.connect_timeout = connect_timeout
        self._outbox: list[list[Any]] = []
        self._wake = asyncio.Event()
        self._seq = 0
        self._nc: Any = None
        self._tasks: list[asyncio.Task] = []
        self._closing = False  # nats-py calls disconnected_cb on a deliberate close too

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        import nats  # the replicas extra

        async def error(exc: Exception) -> None:  # one line, not nats-py's traceback
            log.warning("load sync: NATS %s: %s", self.nats_url, exc or type(exc).__name__)

        async def disconnected() -> None:
            if not self._closing:
                log.warning("load sync: disconnected from %s; reconnecting", self.nats_url)

        async def reconnected() -> None:
            log.info("load sync: reconnected to %s", self.nats_url)

        # nats-py retries a first connection forever; a replica that cannot reach NATS at start
        # should say so and stop, and only reconnect forever once it has been connected.
        try:
            self._nc = await asyncio.wait_for(
                nats.connect(
                    servers=[self.nats_url],
                    name=f"kvplug-{self.replica_id}",
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    connect_timeout=2,
                    error_cb=error,
                    disconnected_cb=disconnected,
                    reconnected_cb=reconnected,
                ),
                timeout=self.connect_timeout,
            )
        except (asyncio.TimeoutError, OSError) as exc:
            raise ConnectionError(
                f"no NATS server answered at {self.nats_url} within {self.connect_timeout:g} s"
            ) from exc
        await self._nc.subscribe(self.subject, cb=self._on_message)
        # nats-py only queues the SUB: a peer's event could pass the server before it. A PING
        # round trip after it means the server has it, so peers are heard once start() returns
        try:
            await self._nc.flush(timeout=self.connect_timeout)
        except Exception as exc:
            await self._nc.close()
            self._nc = None
            raise ConnectionError(
                f"NATS at {self.nats_url} did not confirm the subscription within "
                f"{self.connect_timeout:g} s"
            ) from exc
        self.attach()
        self._tasks = [
            asyncio.create_task(self._flusher(), name="kvplug-load-sync-flush"),
            asyncio.create_task(self._heartbeats(), name="kvplug-load-sync-heartbeat"),
        ]
        log.info("replica %s shares load on %s at %s", self.replica_id, self.subject, self.nats_url)

    async def close(self, say_bye: bool = True) -> None:
        """Stop; with ``say_bye`` peers release this replica's requests at once."""
        self.detach()
        await cancel_and_wait(self._tasks)
        if self._nc is not None:
            if say_bye and self._nc.is_connected:
                await self._publish([["bye"]])
                await self._nc.flush(timeout=2)
            self._closing = True
            await self._nc.close()
            self._nc = None

    def _queue(self, event: list[Any]) -> None:
        self._outbox.append(event)
        self._wake.set()

    # -- publishing ----------------------------------------------------------------------------
    async def _publish(self, events: list[list[Any]]) -> None:
        self._seq += 1
        payload = _encode({"replica": self.replica_id, "seq": self._seq, "events": events})
        await self._nc.publish(self.subject, payload)
        self.stats.published_batches += 1
        self.stats.published_events += len(events)

    async def _flusher(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.flush_s:
                await asyncio.sleep(self.flush_s)  # let a burst of decisions share one message
            events, self._outbox = self._outbox, []
            if events:
                try:
                    await self._publish(events)
                except Exception as exc:  # NATS down: peers will expire our requests
                    log.warning("load sync: publish failed (%s); %d events lost", exc, len(events))

    async def _heartbeats(self) -> None:
        loop = asyncio.get_running_loop()
        skipped = False
        while True:
            slept = loop.time()
            await asyncio.sleep(self.heartbeat_s)
            late = loop.time() - slept - self.heartbeat_s
            try:
                await self._publish([])
            except Exception as exc:
                log.debug("load sync: heartbeat failed: %s", exc)
            if late > self.heartbeat_s and not skipped:
                # this event loop stalled: the peers' heartbeats of the meantime wait unread
                # in the socket, so their silence is ours; expire on the next tick, after them
                # (one tick only: a loop late every time still releases a dead peer's load)
                self.stats.late_heartbeats += 1
                skipped = True
                continue
            skipped = False
            self.expire_silent_peers()

    # -- peers' requests -------------------------------------------------------------------------
    async def _on_message(self, msg: Any) -> None:
        self.apply_batch(msg.data)

    def apply_batch(self, data: bytes) -> None:
        """Fold one peer batch into the load tracker; malformed input is counted, never raised."""
        self.apply_wire_batch(data)
