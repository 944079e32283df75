"""A vLLM-compatible KV-event publisher: what a simulated engine (or a test) speaks.

Behaves like vLLM's ``ZmqEventPublisher`` on the wire: a PUB socket that binds or connects by
vLLM's endpoint rule, three-frame messages ``[topic, seq, payload]`` with seq counting from 0,
and an optional ROUTER replay socket answering ``[b"", start_seq]`` with the buffered batches and
an end marker, in the framing of the chosen vLLM version (topic frame from 0.26 on). It runs in
the caller's thread: call ``serve_replay()`` (or ``publish``, which does it) to answer replay
requests. Written from the documented protocol; tests use it to inject loss, restarts and junk.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterable

import zmq

from kvplug import KvEvent

from .subscriber import engine_binds
from .wire import END_SEQ, PUBLISHER_ID_BYTES, SEQ_BYTES, encode_batch, parse_version

TOPIC_REPLY_SINCE = (0, 26, 0)  # replay replies carry the topic frame from this version on


class VllmEventPublisher:
    """``publish(events)`` encodes a batch as vLLM ``version`` would and sends it."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        version: str = "0.32.0",
        dp_rank: int = 0,
        buffer_steps: int = 10_000,
        hash_form: str = "uint64",
        context: zmq.Context | None = None,
        bind: bool | None = None,
        sndhwm: int = 100_000,
        publisher_ids: bool = False,
    ) -> None:
        """``bind``: None binds a wildcard endpoint and connects to any other, as vLLM does;
        True binds exactly ``endpoint`` (one interface, e.g. the simulator's --host).
        ``publisher_ids``: data messages carry a 16-byte id of the publisher's lifetime after
        the seq, as vLLM's do with ``snapshot_endpoint`` set (``wire.parse_seq_frame``); a
        ``restart`` draws a new one."""
        self.version = version
        self.publisher_id = os.urandom(PUBLISHER_ID_BYTES) if publisher_ids else b""
        self.topic = topic.encode()
        self.dp_rank = dp_rank
        self.hash_form = hash_form
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = context or zmq.Context.instance()
        self.pub = self._ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, sndhwm)  # past it, ZMQ drops (as vLLM's PUB does)
        if "[" in endpoint:  # an IPv6 literal
            self.pub.setsockopt(zmq.IPV6, 1)
        if bind or (bind is None and engine_binds(endpoint)):
            self.pub.bind(endpoint)
        else:
            self.pub.connect(endpoint)
        self.replay: zmq.Socket | None = None
        if replay_endpoint:
            self.replay = self._ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            if "[" in replay_endpoint:
                self.replay.setsockopt(zmq.IPV6, 1)
            self.replay.bind(replay_endpoint)
        self.replay_requests: list[int] = []
        self.auto_serve = True  # answer waiting replay requests on every publish

    # -- publishing ---------------------------------------------------------------------------
    def encode(self, events: Iterable[KvEvent], ts: float | None = None) -> bytes:
        return encode_batch(
            events, self.version, ts=ts, dp_rank=self.dp_rank, hash_form=self.hash_form
        )

    def publish(
        self, events: Iterable[KvEvent], *, ts: float | None = None, send: bool = True
    ) -> int:
        """Encode and publish one batch; returns its seq. ``send=False`` buffers it for replay
        without sending it live (a message the subscriber 'lost')."""
        return self.publish_payload(self.encode(events, ts), send=send)

    def publish_payload(self, payload: bytes, *, send: bool = True) -> int:
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart([self.topic, self._seq_frame(seq), payload])
        if self.auto_serve:
            self.serve_replay()
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        """Send arbitrary frames on the PUB socket (garbage for fault tests)."""
        self.pub.send_multipart(frames)

    def _seq_frame(self, seq: int) -> bytes:
        return seq.to_bytes(SEQ_BYTES, "big") + self.publisher_id

    def restart(self) -> None:
        """What an engine restart looks like on the wire: seq back to 0, empty replay buffer
        (and a new publisher id, when ids are sent)."""
        self.seq = 0
        self.buffer.clear()
        if self.publisher_id:
            self.publisher_id = os.urandom(PUBLISHER_ID_BYTES)

    # -- replay -------------------------------------------------------------------------------
    def serve_replay(self, timeout_ms: int = 0) -> int:
        """Answer every waiting replay request; returns how many were served."""
        if self.replay is None:
            return 0
        served = 0
        while self.replay.poll(timeout_ms if served == 0 else 0):
            frames = self.replay.recv_multipart()
            if len(frames) != 3:
                continue  # vLLM ignores malformed requests too
            ident, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            self.replay_requests.append(start)
            for seq, payload in list(self.buffer):
                if seq >= start:
                    self.send_reply(ident, seq, payload)
            self.send_end(ident)
            served += 1
        return served

    def send_reply(self, ident: bytes, seq: int, payload: bytes) -> None:
        assert self.replay is not None
        seq_b = self._seq_frame(seq)
        if parse_version(self.version) >= TOPIC_REPLY_SINCE:
            self.replay.send_multipart([ident, b"", self.topic, seq_b, payload])
        else:
            self.replay.send_multipart([ident, b"", seq_b, payload])

    def send_end(self, ident: bytes) -> None:
        assert self.replay is not None
        if parse_version(self.version) >= TOPIC_REPLY_SINCE:
            self.replay.send_multipart([ident, b"", b"", END_SEQ, b""])
        else:
            self.replay.send_multipart([ident, b"", END_SEQ, b""])

    def pump(self, seconds: float) -> None:
        """Serve replay requests for a while (tests waiting on the subscriber)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.serve_replay(timeout_ms=10)

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
