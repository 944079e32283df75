"""Consume vLLM KV-event streams: one thread, many engines, sequence tracking, replay.

Sockets follow vLLM's rule (``ZmqEventPublisher``): the engine's PUB *binds* when its endpoint
has ``*`` / ``::`` or is ``ipc://`` / ``inproc://`` and *connects* otherwise. So for a wildcard
endpoint kvplug connects a SUB per (engine, DP rank) to the engine's host; for a concrete
address (``tcp://127.0.0.1:5557``) kvplug binds one SUB there that any number of engines
connect to, telling them apart by topic (frame 0) and the batch's ``data_parallel_rank``.
DP rank r > 0 publishes on port + r (and replays on replay port + r).

Per (engine, rank) the thread tracks the sequence number: the next expected seq is applied; a
gap asks the engine's replay ROUTER (from a DEALER) for the missing batches while live batches
wait; a seq going backwards means the engine restarted, so that rank is cleared
(``AllCleared``) and rebuilt from the new stream, as does a new publisher id (sent by
publishers with snapshots enabled: it shows a restart whose first batches were missed, which
the seq alone would take for a gap); an exact repeat is ignored. Events go to the
source's ``sink`` (a callable taking a list of normalised events) in order, batched per drain
of the sockets. Nothing here blocks routing: the router only sees finished ``sink`` calls.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import msgspec
import zmq

from kvplug import AllCleared, ConfigError, KvEvent

from .wire import (
    BatchDecoder,
    DecodedBatch,
    WireError,
    parse_replay_reply,
    replay_request,
    split_frames,
)

log = logging.getLogger("kvplug.vllm")

Sink = Callable[[list[KvEvent]], Any]
MAX_REPLAY_RESUMES = 100  # re-requests within one gap's replay before it is declared lost


# -------------------------------------------------------------------------------------------
# Endpoints
# -------------------------------------------------------------------------------------------


def engine_binds(endpoint: str) -> bool:
    """vLLM's rule: its PUB binds wildcard and ipc/inproc endpoints and connects to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint(endpoint: str | None, dp_rank: int) -> str | None:
    """The endpoint DP rank ``dp_rank`` uses (vLLM: port + rank; ``_dp{r}`` for inproc;
    port 0 = ephemeral, never offset)."""
    if not endpoint or dp_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{dp_rank}"
    if "tcp" in endpoint and ":" in endpoint:
        base, _, port = endpoint.rpartition(":")
        if int(port) == 0:
            return endpoint
        return f"{base}:{int(port) + dp_rank}"
    if endpoint.startswith("ipc://"):
        return endpoint  # vLLM leaves ipc endpoints as they are
    raise ConfigError(f"invalid vLLM event endpoint {endpoint!r}: must be tcp, ipc or inproc")


def connect_address(endpoint: str, engine_host: str | None) -> str:
    """Where kvplug connects for an endpoint the engine binds (wildcard -> the engine's host)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint
    host = engine_host or "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return endpoint.replace("[::]", host).replace("*", host)


@dataclass
class EventSource:
    """One (engine, DP rank) event stream as kvplug reaches it.

    ``endpoint`` / ``replay_endpoint`` are as the engine's rank uses them (already offset);
    ``engine_host`` replaces a wildcard when kvplug connects.
    """

    worker_id: str
    endpoint: str
    sink: Sink
    replay_endpoint: str | None = None
    topic: str = ""
    dp_rank: int = 0
    engine_host: str | None = None
    block_size: int = 0

    endpoint_mode: str = "auto"  # "connect" once binding the address turned out impossible

    @property
    def kvplug_binds(self) -> bool:
        return self.endpoint_mode != "connect" and not engine_binds(self.endpoint)

    @property
    def address(self) -> str:
        if self.kvplug_binds:
            return self.endpoint
        return connect_address(self.endpoint, self.engine_host)

    @property
    def replay_address(self) -> str | None:
        if self.replay_endpoint is None:
            return None
        return connect_address(self.replay_endpoint, self.engine_host)


def sources_for_engine(
    worker_id: str,
    endpoint: str,
    sink: Sink,
    *,
    replay_endpoint: str | None = None,
    topic: str = "",
    dp_start: int = 0,
    dp_size: int = 1,
    engine_url: str | None = None,
    block_size: int = 0,
) -> list[EventSource]:
    """Sources for every DP rank of one engine, from its ``KVEventsConfig`` values."""
    host = urlsplit(engine_url).hostname if engine_url else None
    return [
        EventSource(
            worker_id=worker_id,
            endpoint=offset_endpoint(endpoint, r) or endpoint,
            replay_endpoint=offset_endpoint(replay_endpoint, r),
            sink=sink,
            topic=topic,
            dp_rank=r,
            engine_host=host,
            block_size=block_size,
        )
        for r in range(dp_start, dp_start + dp_size)
    ]


# -------------------------------------------------------------------------------------------
# Per-stream state
# -------------------------------------------------------------------------------------------


@dataclass
class StreamStats:
    batches: int = 0
    events: int = 0
    gaps: int = 0
    missed_batches: int = 0
    replays: int = 0
    replayed_batches: int = 0
    replay_resumes: int = 0  # a replay whose replies skipped ahead, asked again from the gap
    replay_failures: int = 0
    restarts: int = 0
    duplicates: int = 0
    stale_replies: int = 0
    stale_messages: int = 0  # live messages of a publisher lifetime already replaced
    malformed: int = 0  # batches rejected whole (their seq is consumed: they cost only themselves)
    decoder_errors: int = 0  # of those, batches the decoder raised on (a decoder bug)
    dropped_events: int = 0
    sink_errors: int = 0
    last_seq: int = -1
    last_message_at: float = 0.0


@dataclass
class _Stream:
    src: EventSource
    decoder: BatchDecoder
    stats: StreamStats = field(default_factory=StreamStats)
    expected: int | None = None  # next seq; None before the first message
    last_payload: bytes = b""  # the last applied payload: tells a repeat from a restart
    replaying: bool = False
    catching_up: bool = False  # the first replay, from seq 0, after joining a running engine
    replay_sock: zmq.Socket | None = None
    replay_deadline: float = 0.0
    replay_got: int = 0  # replies applied since the replay request went out
    # seq -> crc32 of the batches the last replay applied: a late live copy of one of them
    # (queued in ZMQ while the replay ran) is a duplicate, not an engine restart
    replayed: dict[int, int] = field(default_factory=dict)
    replay_resumes: int = 0  # re-requests within this gap's replay (replies dropped on the way)
    publisher: bytes | None = None  # the lifetime id a snapshot-enabled publisher sends
    # ids of lifetimes already replaced: a late message or reply carrying one is stale, not
    # another restart
    retired: deque[bytes] = field(default_factory=lambda: deque(maxlen=4))
    # live batches waiting for a replay: (seq, payload, decoded; None = unreadable)
    pending: list[tuple[int, bytes, DecodedBatch | None]] = field(default_factory=list)


class _DropLog:
    """Logs a kind of drop the first few times, then every 1000th (counters keep the totals)."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def __call__(self, kind: str, msg: str, *args: Any) -> None:
        n = self.seen.get(kind, 0) + 1
        self.seen[kind] = n
        if n <= 5 or n % 1000 == 0:
            log.warning(msg + (f" ({n} so far)" if n > 5 else ""), *args)


# -------------------------------------------------------------------------------------------
# The subscriber
# -------------------------------------------------------------------------------------------


class VllmSubscriber:
    """One background thread consuming any number of vLLM event sources.

    ``add(source)`` / ``remove(worker_id)`` may be called from any thread at any time.
    ``replay_timeout``: how long live batches wait for a replay reply (a replay that keeps
    delivering is not cut short, nor one whose replies wait while this thread drains a
    backlog) before the gap is declared lost
    (then the rank is cleared, so the index never claims blocks it may have missed removals
    of). ``catch_up``: when the first batch seen from a stream is not seq 0, ask for a replay
    from 0 (the engine keeps the last ``buffer_steps`` batches). ``max_drain``: messages taken
    from one socket per poll round; ``flush_every``: messages whose events go to the sinks in
    one call (a lock or a hop to the router's loop each). ``rcvhwm``: messages ZMQ queues
    per socket before it drops (the publisher's SNDHWM drops too): a drop is a gap.
    """

    def __init__(
        self,
        *,
        replay_timeout: float = 2.0,
        catch_up: bool = True,
        max_drain: int = 4096,
        flush_every: int = 16,
        context: zmq.Context | None = None,
        rcvhwm: int = 1_000_000,
    ) -> None:
        self.replay_timeout = replay_timeout
        self.rcvhwm = rcvhwm
        self.catch_up = catch_up
        self.max_drain = max_drain
        self.flush_every = max(1, flush_every)
        self._ctx = context or zmq.Context.instance()
        self._cmds: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[tuple[str, int], _Stream] = {}
        self._by_socket: dict[zmq.Socket, list[EventSource]] = {}
        self._bound: dict[str, zmq.Socket] = {}  # address -> shared bound SUB
        self._routes: dict[zmq.Socket, dict[bytes | None, dict[int, _Stream]]] = {}
        self._poller = zmq.Poller()
        self._thread: threading.Thread | None = None
        self._running = False
        self._lock = threading.Lock()  # guards the stats snapshot
        self._droplog = _DropLog()
        self._ready = threading.Event()
        # rounds and flushes of the thread: add() waits while a long drain makes progress
        self._progress = 0
        self.command_stall_s = 5.0  # no progress this long while a command waits: an error
        self.counters = {
            "unknown_source": 0,
            "malformed_frames": 0,
            "stale_replies": 0,
            "sink_errors": 0,
            "internal_errors": 0,
        }

    # -- public API ---------------------------------------------------------------------------
    def start(self) -> VllmSubscriber:
        if self._thread is None:
            self._running = True
            self._thread = threading.Thread(target=self._run, name="kvplug-vllm-sub", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._running = False
        thread = self._thread  # read once: two stops may race (an adapter closing)
        if thread is not None:
            thread.join(timeout)
            self._thread = None

    def add(self, source: EventSource) -> None:
        """Start consuming a source (an engine's DP rank). Errors surface in the thread's log;
        a clash (same bound address and topic for two workers) raises here."""
        for st in list(self._streams.values()):
            o = st.src
            if (
                o.worker_id != source.worker_id
                and o.kvplug_binds
                and source.kvplug_binds
                and o.address == source.address
                and o.topic == source.topic
            ):
                raise ConfigError(
                    f"workers {o.worker_id} and {source.worker_id} publish to the same address "
                    f"{source.address} with the same topic {source.topic!r}: give each engine "
                    "its own topic (--kv-events-config topic) so kvplug can tell them apart"
                )
        done = threading.Event()
        self._cmds.put(("add", (source, done)))
        if self._thread is None or not self._thread.is_alive():
            self._apply_commands()  # not started yet: register now
        elif not self._applied(done):
            raise RuntimeError(f"subscriber thread did not register {source.worker_id}")
        err = getattr(done, "error", None)
        if err is not None:
            raise err

    def remove(self, worker_id: str) -> None:
        """Stop consuming every rank of one worker (its index entries are the caller's)."""
        done = threading.Event()
        self._cmds.put(("remove", (worker_id, done)))
        if self._thread is None or not self._thread.is_alive():
            self._apply_commands()
        else:
            self._applied(done)

    def _applied(self, done: threading.Event) -> bool:
        """Wait until the thread has applied a command (it does between rounds): as long as it
        runs and makes progress, since a round that drains a backlog (engines catching up at
        startup) can take longer than any fixed wait; False once it stopped or stalled."""
        seen = self._progress
        while not done.wait(self.command_stall_s):
            if self._thread is None or not self._thread.is_alive():
                return done.is_set()
            if self._progress == seen:
                return False  # not a round nor a flush for command_stall_s: stuck
            seen = self._progress
        return True

    def restarts(self, worker_id: str) -> int:
        """How many restarts the sequence numbers revealed, over a worker's ranks."""
        return sum(s.stats.restarts for (w, _), s in list(self._streams.items()) if w == worker_id)

    def resync(self, worker_id: str, if_restarts_at: int | None = None) -> None:
        """The engine restarted (e.g. its process start time changed): clear its ranks and
        rebuild them from its replay buffer (seq 0 on), or from the live stream without one.

        ``if_restarts_at``: ``restarts(worker_id)`` as the caller last saw it; when the
        sequence numbers already revealed this restart (the count grew), the subscriber is
        consuming the new engine and nothing is done — a second clear would drop its blocks.
        """
        self._cmds.put(("resync", (worker_id, if_restarts_at)))
        if self._thread is None or not self._thread.is_alive():
            self._apply_commands()

    def last_message_at(self, worker_id: str) -> float | None:
        """Monotonic time of the newest batch from any rank of a worker (a liveness signal)."""
        items = list(self._streams.items())
        ts = [s.stats.last_message_at for (w, _), s in items if w == worker_id]
        ts = [t for t in ts if t > 0]
        return max(ts) if ts else None

    def has_worker(self, worker_id: str) -> bool:
        return any(w == worker_id for (w, _) in list(self._streams))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self.counters)
            out["streams"] = {  # list(): the subscriber thread may add or remove streams
                f"{w}/{r}": {**s.stats.__dict__, **{"decode": s.decoder.stats.as_dict()}}
                for (w, r), s in list(self._streams.items())
            }
        return out

    @property
    def running(self) -> bool:
        """False when the consumer thread is not running (never started, stopped, or died)."""
        return self._thread is not None and self._thread.is_alive()

    def drop_counts(self) -> dict[str, dict[str, int]]:
        """What was dropped or rejected, for ``/metrics``: worker id -> reason -> count (summed
        over its ranks); worker "" holds what no worker can be named for. Stream reasons count
        batches (``rejected_batches``, ``missed_batches``, ...), gaps and restarts count
        occurrences, ``decode.*`` reasons are the decoder's (events, or batches)."""
        out: dict[str, dict[str, int]] = {"": {k: v for k, v in self.counters.items()}}
        for (wid, _), st in list(self._streams.items()):
            d = out.setdefault(wid, {})
            s = st.stats
            for reason, n in (
                ("rejected_batches", s.malformed),
                ("decoder_errors", s.decoder_errors),
                ("dropped_events", s.dropped_events),
                ("gaps", s.gaps),
                ("missed_batches", s.missed_batches),
                ("replay_failures", s.replay_failures),
                ("restarts", s.restarts),
                ("duplicates", s.duplicates),
                ("stale_replies", s.stale_replies),
                ("stale_messages", s.stale_messages),
            ):
                d[reason] = d.get(reason, 0) + n
            for reason, n in st.decoder.stats.drops().items():
                key = f"decode.{reason}"
                d[key] = d.get(key, 0) + n
        return out

    # -- thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        self._ready.set()
        try:
            while self._running:
                try:
                    self._step()
                except Exception:  # never let the consumer thread die
                    self.counters["internal_errors"] += 1
                    log.exception("vLLM events: subscriber loop error")
                    time.sleep(0.1)
        finally:
            for st in self._streams.values():
                self._close_replay(st)
            for sock in list(self._by_socket):
                sock.close(linger=0)
            self._by_socket.clear()
            self._bound.clear()

    def _step(self) -> None:
        """One round: commands, a poll, drain what is readable, replay timeouts, sinks."""
        self._progress += 1
        self._apply_commands()
        try:
            ready = dict(self._poller.poll(50))
        except zmq.ZMQError as e:  # a socket closed under us during remove
            log.debug("poll: %s", e)
            return
        out: dict[int, tuple[Sink, list[KvEvent]]] = {}
        try:
            for sock in ready:
                self._drain(sock, out)
            self._check_replay_timeouts(out)
        finally:
            self._flush(out)  # what was decoded before an error still reaches the index

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd, arg = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd == "add":
                src, done = arg
                try:
                    self._add(src)
                except Exception as e:  # surfaced to the caller of add()
                    done.error = e
                done.set()
            elif cmd == "remove":
                wid, done = arg
                self._remove(wid)
                done.set()
            elif cmd == "resync":
                wid, seen = arg
                out: dict = {}
                self._resync(wid, seen, out)
                self._flush(out)

    def _resync(self, worker_id: str, seen: int | None, out: dict) -> None:
        streams = [s for (w, _), s in self._streams.items() if w == worker_id]
        if seen is not None and sum(s.stats.restarts for s in streams) > seen:
            return  # the sequence numbers showed this restart already
        for st in streams:
            st.stats.restarts += 1
            log.warning(
                "vLLM events: %s rank %d: engine restarted; clearing its blocks and "
                "rebuilding from its replay buffer",
                st.src.worker_id,
                st.src.dp_rank,
            )
            self._emit(st, [AllCleared(worker_id=st.src.worker_id, dp_rank=st.src.dp_rank)], out)
            self._abort_replay(st)
            st.last_payload = b""
            if st.publisher is not None:  # the new process's id is taken as it comes
                st.retired.append(st.publisher)
                st.publisher = None
            if st.src.replay_address:
                st.expected = 0
                st.catching_up = True
                self._start_replay(st, 0, out)
            else:
                st.expected = None

    def _add(self, src: EventSource) -> None:
        self._routes.clear()
        key = (src.worker_id, src.dp_rank)
        if key in self._streams:
            self._remove_key(key)
        sock = None
        if src.kvplug_binds:
            sock = self._bound.get(src.address)
            if sock is None:
                sock = self._new_sub()
                try:
                    sock.bind(src.address)
                except zmq.ZMQError as e:
                    # Not ours to bind: the address is another host's, or the engine itself
                    # bound it (a configured endpoint naming the engine's address). Dial it.
                    sock.close(linger=0)
                    sock = None
                    log.info(
                        "vLLM events: %s: cannot bind %s (%s); connecting instead",
                        src.worker_id,
                        src.address,
                        e,
                    )
                    src.endpoint_mode = "connect"
                else:
                    self._bound[src.address] = sock
                    self._by_socket[sock] = []
                    self._poller.register(sock, zmq.POLLIN)
        if sock is None:
            sock = self._new_sub()
            sock.connect(src.address)
            self._by_socket[sock] = []
            self._poller.register(sock, zmq.POLLIN)
        sock.setsockopt(zmq.SUBSCRIBE, src.topic.encode())
        self._by_socket[sock].append(src)
        self._streams[key] = _Stream(src, BatchDecoder(src.worker_id, block_size=src.block_size))
        log.info(
            "vLLM events: %s rank %d %s %s (topic %r, replay %s)",
            src.worker_id,
            src.dp_rank,
            "bound" if src.kvplug_binds else "connected to",
            src.address,
            src.topic,
            src.replay_address,
        )

    def _new_sub(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, self.rcvhwm)  # past it ZMQ drops: a gap, replayed
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 28)  # a bigger frame is garbage: zmq drops it
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    def _remove(self, worker_id: str) -> None:
        for key in [k for k in self._streams if k[0] == worker_id]:
            self._remove_key(key)

    def _remove_key(self, key: tuple[str, int]) -> None:
        self._routes.clear()
        st = self._streams.pop(key)
        self._close_replay(st)
        for sock, srcs in list(self._by_socket.items()):
            if st.src in srcs:
                srcs.remove(st.src)
                if not srcs:
                    self._poller.unregister(sock)
                    del self._by_socket[sock]
                    for addr, s in list(self._bound.items()):
                        if s is sock:
                            del self._bound[addr]
                    sock.close(linger=0)

    # -- receiving ----------------------------------------------------------------------------
    def _drain(self, sock: zmq.Socket, out: dict) -> None:
        if sock in self._by_socket:
            self._receive(
                sock,
                lambda frames: self._on_live(sock, frames, out),
                "vLLM events: message dropped after an internal error",
                out,
            )
            return
        st = next((s for s in self._streams.values() if s.replay_sock is sock), None)
        if st is None:
            return
        self._receive(
            sock,
            lambda frames: self._on_replay(st, frames, out),
            f"vLLM replay from {st.src.worker_id}: reply dropped after an internal error",
            out,
            until=lambda: st.replay_sock is not sock,  # the replay ended or was re-asked
        )

    def _receive(
        self,
        sock: zmq.Socket,
        handle: Callable[[list[bytes]], None],
        dropped: str,
        out: dict,
        until: Callable[[], bool] | None = None,
    ) -> None:
        """Hand up to max_drain waiting messages to handle; a bug in it costs that one
        message (counted, logged as ``dropped``), never the thread. Every ``flush_every``
        messages the decoded events go to the sinks: a backlog is applied in bounded batches
        (holding thousands of batches' events first costs more than the extra sink calls)."""
        flush_every = self.flush_every
        for i in range(1, self.max_drain + 1):
            try:
                frames = _recv_frames(sock)
            except zmq.Again:
                break
            try:
                handle(frames)
            except Exception:
                self.counters["internal_errors"] += 1
                log.exception("%s", dropped)
            if i % flush_every == 0:
                self._progress += 1
                self._flush(out)
                out.clear()
            if until is not None and until():
                break

    def _routes_for(self, sock: zmq.Socket) -> dict[bytes | None, dict[int, _Stream]]:
        """topic (None on a connected socket: one engine's) -> rank -> stream; cached."""
        routes = self._routes.get(sock)
        if routes is None:
            routes = {}
            for src in self._by_socket.get(sock, []):
                st = self._streams.get((src.worker_id, src.dp_rank))
                if st is not None:
                    key = src.topic.encode() if src.kvplug_binds else None
                    routes.setdefault(key, {})[src.dp_rank] = st
            self._routes[sock] = routes
        return routes

    def _on_live(self, sock: zmq.Socket, frames: list[bytes], out: dict) -> None:
        try:
            topic, seq, payload, publisher = split_frames(frames)
        except WireError as e:
            self.counters["malformed_frames"] += 1
            self._droplog("frames", "vLLM events: malformed message dropped: %s", e)
            return
        routes = self._routes_for(sock)
        connected = None in routes
        ranks = routes.get(None) if connected else routes.get(topic)
        if not ranks:
            self.counters["unknown_source"] += 1
            self._droplog(
                "unknown",
                "vLLM events: batch seq %d on topic %r from an unknown engine dropped",
                seq,
                topic,
            )
            return
        first = next(iter(ranks.values()))
        batch = self._decode(first, seq, payload)
        st = first
        if batch is not None and batch.dp_rank is not None and batch.dp_rank != first.src.dp_rank:
            routed = ranks.get(batch.dp_rank)
            if routed is None and len(ranks) == 1:
                # one rank configured for this socket/topic (vLLM rank r publishes on port + r,
                # so a socket sees one rank): it is that rank's; _apply says so and fixes it
                pass
            elif routed is None:
                self.counters["unknown_source"] += 1
                self._droplog(
                    "unknown",
                    "vLLM events: batch seq %d (topic %r) from rank %d, "
                    "which is not configured, dropped",
                    seq,
                    topic,
                    batch.dp_rank,
                )
                return
            elif routed is not first:
                st = routed
                batch = self._decode(st, seq, payload)  # per-rank stats
        st.stats.last_message_at = time.monotonic()
        self._on_batch(st, seq, payload, batch, out, publisher)

    def _on_batch(
        self,
        st: _Stream,
        seq: int,
        payload: bytes,
        batch: DecodedBatch | None,
        out: dict,
        publisher: bytes | None = None,
    ) -> None:
        s = st.stats
        if publisher is not None and publisher != st.publisher:
            if publisher in st.retired:  # a late message of a lifetime already replaced
                s.stale_messages += 1
                return
            if self._new_lifetime(st, publisher):
                # the engine restarted, even when its seq looks like the next batch or a gap
                # (its first batches were missed) rather than going backwards
                self._restarted(st, seq, payload, batch, out, "publisher id changed")
                return
        if st.replaying:
            st.pending.append((seq, payload, batch))
            return
        if st.expected is None:
            st.expected = seq
            if seq > 0 and self.catch_up and st.src.replay_address:
                # joined a running engine: fetch what it still buffers from its start
                st.expected = 0
                st.catching_up = True
                st.pending.append((seq, payload, batch))
                self._start_replay(st, 0, out)
                return
        if seq == st.expected:
            self._apply(st, seq, payload, batch, out)
            return
        if seq > st.expected:
            s.gaps += 1
            log.warning(
                "vLLM events: %s rank %d gap: expected seq %d, got %d",
                st.src.worker_id,
                st.src.dp_rank,
                st.expected,
                seq,
            )
            st.pending.append((seq, payload, batch))
            if st.src.replay_address:
                self._start_replay(st, st.expected, out)
            else:
                self._finish_replay(st, out)  # nothing to ask: declare the gap lost
            return
        # seq < expected
        if seq == st.expected - 1 and payload == st.last_payload:
            s.duplicates += 1
            return
        if st.replayed.get(seq) == zlib.crc32(payload):
            # a live copy that ZMQ delivered after the replay brought the same batch (the
            # publisher's queue held it): a duplicate, not a restart
            s.duplicates += 1
            return
        self._restarted(st, seq, payload, batch, out, f"seq {seq} after {st.expected - 1}")

    def _restarted(
        self,
        st: _Stream,
        seq: int,
        payload: bytes,
        batch: DecodedBatch | None,
        out: dict,
        why: str,
    ) -> None:
        """Batch ``seq`` comes from a restarted engine: clear the rank, then rebuild it from
        the new process's first batch on (replayed when this one is not it)."""
        st.stats.restarts += 1
        log.warning(
            "vLLM events: %s rank %d: %s: engine restarted, clearing its blocks",
            st.src.worker_id,
            st.src.dp_rank,
            why,
        )
        self._emit(st, [AllCleared(worker_id=st.src.worker_id, dp_rank=st.src.dp_rank)], out)
        st.expected = 0
        if seq > 0 and st.src.replay_address:
            st.pending.append((seq, payload, batch))
            self._start_replay(st, 0, out)
        else:
            st.expected = seq
            self._apply(st, seq, payload, batch, out)

    def _new_lifetime(self, st: _Stream, publisher: bytes) -> bool:
        """Take ``publisher`` as the stream's id; True when it replaces a known one (a restart:
        the old id is retired and any replay from the old process dropped)."""
        known, st.publisher = st.publisher, publisher
        if known is None:
            return False
        st.retired.append(known)
        self._abort_replay(st)
        return True

    def _abort_replay(self, st: _Stream) -> None:
        """Forget a replay and the batches waiting for it (its process is gone, or its answer
        is no longer wanted), with the state a finished replay would leave."""
        self._close_replay(st)
        st.replaying = False
        st.pending = []
        st.replay_resumes = 0
        st.replayed.clear()

    def _decode(self, st: _Stream, seq: int, payload: bytes) -> DecodedBatch | None:
        """The stream's decoder on one payload; None = unreadable. Decoders never raise by
        contract; if one does anyway, the batch is rejected like an unreadable one (counted,
        logged with the traceback) so its sequence number is still consumed."""
        try:
            return st.decoder.decode(payload, dp_rank=st.src.dp_rank)
        except Exception:
            st.stats.decoder_errors += 1
            log.exception(
                "vLLM events: %s rank %d seq %d: the decoder raised; batch rejected",
                st.src.worker_id,
                st.src.dp_rank,
                seq,
            )
            return None

    def _apply(
        self, st: _Stream, seq: int, payload: bytes, batch: DecodedBatch | None, out: dict
    ) -> None:
        """Apply batch ``seq`` (``batch``: its decoded form, None = unreadable). An unreadable
        batch still consumes its seq, so the next one is not taken for a gap."""
        s = st.stats
        st.expected = seq + 1
        st.last_payload = payload
        s.last_seq = seq
        s.batches += 1
        if batch is None:
            s.malformed += 1
            self._droplog(
                "batch",
                "vLLM events: %s rank %d seq %d: %s; batch dropped",
                st.src.worker_id,
                st.src.dp_rank,
                seq,
                st.decoder.stats.last_error,
            )
            return
        if batch.dropped:
            s.dropped_events += batch.dropped
            self._droplog(
                "event",
                "vLLM events: %s rank %d seq %d: dropped %d event(s): %s",
                st.src.worker_id,
                st.src.dp_rank,
                seq,
                batch.dropped,
                st.decoder.stats.last_error,
            )
        s.events += len(batch.events)
        if batch.dp_rank is not None and batch.dp_rank != st.src.dp_rank:
            # a socket (or topic) configured for one rank: trust the configuration, say so
            self._droplog(
                "rank",
                "vLLM events: %s: batch says rank %d on rank %d's socket",
                st.src.worker_id,
                batch.dp_rank,
                st.src.dp_rank,
            )
            evs = [_with_rank(e, st.src.dp_rank) for e in batch.events]
        else:
            evs = batch.events
        self._emit(st, evs, out)

    def _emit(self, st: _Stream, events: list[KvEvent], out: dict) -> None:
        if not events:
            return
        k = id(st.src.sink)
        if k not in out:
            out[k] = (st.src.sink, [])
        out[k][1].extend(events)

    def _flush(self, out: dict) -> None:
        for sink, events in out.values():
            try:
                sink(events)
            except Exception:
                self.counters["sink_errors"] += 1
                log.exception("vLLM events: sink failed on %d events", len(events))

    # -- replay -------------------------------------------------------------------------------
    def _start_replay(self, st: _Stream, start: int, out: dict) -> None:
        if not st.replay_resumes:
            st.replayed.clear()  # a new gap: the previous replay's copies are long gone
        st.stats.replays += 1
        st.replaying = True
        st.replay_deadline = time.monotonic() + self.replay_timeout
        st.replay_got = 0
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # the engine's buffer is bounded (buffer_steps)
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 28)
        sock.connect(st.src.replay_address)
        sock.send_multipart(replay_request(start))
        st.replay_sock = sock
        self._poller.register(sock, zmq.POLLIN)

    def _close_replay(self, st: _Stream) -> None:
        if st.replay_sock is not None:
            try:
                self._poller.unregister(st.replay_sock)
            except KeyError:
                pass
            st.replay_sock.close(linger=0)
            st.replay_sock = None

    def _on_replay(self, st: _Stream, frames: list[bytes], out: dict) -> None:
        s = st.stats
        try:
            item = parse_replay_reply(frames)
        except WireError as e:
            self.counters["malformed_frames"] += 1
            self._droplog(
                "replay", "vLLM replay from %s: malformed reply dropped: %s", st.src.worker_id, e
            )
            return
        if item is None:
            self._finish_replay(st, out)
            return
        if not st.replaying:
            s.stale_replies += 1
            self.counters["stale_replies"] += 1
            return
        if (item.topic is not None and item.topic != st.src.topic.encode()) or (
            item.publisher is not None and item.publisher in st.retired
        ):
            s.stale_replies += 1
            self.counters["stale_replies"] += 1
            return
        if item.publisher is not None and item.publisher != st.publisher:
            if self._new_lifetime(st, item.publisher):  # a new process answered the replay
                batch = self._decode(st, item.seq, item.payload)
                self._restarted(st, item.seq, item.payload, batch, out, "publisher id changed")
                return
        assert st.expected is not None
        if item.seq < st.expected:
            s.stale_replies += 1
            self.counters["stale_replies"] += 1
            self._droplog(
                "stale",
                "vLLM replay from %s rank %d: stale seq %d (have up to %d) dropped",
                st.src.worker_id,
                st.src.dp_rank,
                item.seq,
                st.expected - 1,
            )
            return
        if item.seq > st.expected:
            if st.replay_got and st.replay_resumes < MAX_REPLAY_RESUMES:
                # Replies were dropped on the way (the engine's ROUTER drops past its send
                # high-water mark: 1000 to 0.32, 2 * (buffer_steps + 1) since): the buffer had
                # them a moment ago, so ask again from the first missing one. Each resume
                # follows progress.
                st.replay_resumes += 1
                s.replay_resumes += 1
                self._close_replay(st)
                s.replays -= 1  # one gap, one replay: a resume is counted on its own
                self._start_replay(st, st.expected, out)
                return
            self._lost(st, item.seq, out)
        st.replay_got += 1
        # a replay that makes progress is not timed out: the timeout is for silence
        st.replay_deadline = time.monotonic() + self.replay_timeout
        st.replayed[item.seq] = zlib.crc32(item.payload)
        s.replayed_batches += 1
        self._apply(st, item.seq, item.payload, self._decode(st, item.seq, item.payload), out)

    def _lost(self, st: _Stream, next_seq: int, out: dict) -> None:
        """Batches expected..next_seq-1 cannot be had: clear the rank so nothing stale stays."""
        s = st.stats
        if st.catching_up and st.expected == 0:
            # the engine ran before kvplug joined and no longer buffers its first batches:
            # expected, and nothing is indexed yet that could be stale
            log.info(
                "vLLM events: %s rank %d: joined at seq %d (older batches not buffered)",
                st.src.worker_id,
                st.src.dp_rank,
                next_seq,
            )
            st.expected = next_seq
            return
        s.replay_failures += 1
        s.missed_batches += next_seq - (st.expected or 0)
        log.warning(
            "vLLM events: %s rank %d lost batches %d..%d; clearing its blocks",
            st.src.worker_id,
            st.src.dp_rank,
            st.expected,
            next_seq - 1,
        )
        self._emit(st, [AllCleared(worker_id=st.src.worker_id, dp_rank=st.src.dp_rank)], out)
        st.expected = next_seq

    def _finish_replay(self, st: _Stream, out: dict) -> None:
        self._close_replay(st)
        st.replaying = False
        st.replay_resumes = 0
        st.catching_up = False
        pending, st.pending = sorted(st.pending, key=lambda p: p[0]), []
        for seq, payload, batch in pending:
            assert st.expected is not None
            if seq < st.expected:
                continue  # the replay already delivered it
            if seq > st.expected:
                self._lost(st, seq, out)
            self._apply(st, seq, payload, batch, out)

    def _check_replay_timeouts(self, out: dict) -> None:
        now = time.monotonic()
        for st in self._streams.values():
            if st.replaying and now > st.replay_deadline:
                if st.replay_sock is not None and st.replay_sock.poll(0):
                    # replies wait unread: the time passed draining a backlog here (the
                    # situation that makes gaps), not in silence from the engine
                    st.replay_deadline = now + self.replay_timeout
                    continue
                log.warning(
                    "vLLM events: replay from %s rank %d timed out",
                    st.src.worker_id,
                    st.src.dp_rank,
                )
                self._finish_replay(st, out)


def _recv_frames(sock: zmq.Socket) -> list[bytes]:
    """One waiting multipart message (zmq.Again if none). Frame by frame with ``more``: about
    a microsecond less per message than ``recv_multipart``, whose RCVMORE lookups build an
    enum each (measured; ``copy=False`` alone is slower still for KB-sized payloads)."""
    f = sock.recv(zmq.NOBLOCK, copy=False)
    frames = [f.bytes]
    while f.more:
        f = sock.recv(zmq.NOBLOCK, copy=False)
        frames.append(f.bytes)
    return frames


def _with_rank(ev: KvEvent, rank: int) -> KvEvent:
    return msgspec.structs.replace(ev, dp_rank=rank)
