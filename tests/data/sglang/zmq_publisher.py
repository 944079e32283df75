"""Test-side SGLang publisher (one DP rank's PUB + ROUTER replay) and loopback helpers.

Shared by ``tests/test_sglang_subscriber.py`` and ``tests/test_sglang_adapter.py`` (loaded by
path: this folder is data, not a package). Written from SGLang's documented transport.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import zmq

DATA = Path(__file__).resolve().parent
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def golden(name: str) -> list[bytes]:
    return [f.read_bytes() for f in sorted(DATA.glob(f"{name}_*.msgpack"))]


class SglangPublisher:
    """What one SGLang DP rank's ``ZmqEventPublisher`` does on the wire (bound PUB + ROUTER
    replay); ``topic_in_replies``: 0.5.23 replies ``[topic, seq, payload]``, older ones
    ``[seq, payload]``. Replay requests are served from a background thread."""

    def __init__(
        self, ctx, port: int, replay_port: int, *, topic_in_replies: bool, topic: bytes = b""
    ):
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.bind(f"tcp://127.0.0.1:{replay_port}")
        self.topic_in_replies = topic_in_replies
        self.topic = topic
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.requests: list[int] = []
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def publish(self, payload: bytes, *, lose: bool = False) -> None:
        with self._lock:
            seq, self.seq = self.seq, self.seq + 1
            self.buffer.append((seq, payload))
        if not lose:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def resend_last(self) -> None:
        """Send the newest batch again (the subscriber ignores an exact repeat): beats the ZMQ
        slow-joiner race without changing what the stream means."""
        with self._lock:
            seq, payload = self.buffer[-1]
        self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def restart(self) -> None:
        with self._lock:
            self.seq = 0
            self.buffer.clear()

    def _serve(self) -> None:
        while not self._stop:
            if not self.replay.poll(20):
                continue
            ident, _, start_b = self.replay.recv_multipart()
            start = int.from_bytes(start_b, "big")
            self.requests.append(start)
            with self._lock:
                items = [(s, p) for s, p in self.buffer if s >= start]
            head = [ident, b""] + ([self.topic] if self.topic_in_replies else [])
            for seq, payload in items:
                self.replay.send_multipart(head + [seq.to_bytes(8, "big"), payload])
            end = [ident, b""] + ([b""] if self.topic_in_replies else [])
            self.replay.send_multipart(end + [END_SEQ, b""])

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.pub.close(0)
        self.replay.close(0)


def _free_base(n: int) -> int:
    """A port p with p .. p+n-1 free on loopback (best effort)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            probes = []
            for i in range(n):
                p = socket.socket()
                p.bind(("127.0.0.1", base + i))
                probes.append(p)
        except OSError:
            continue
        finally:
            for p in locals().get("probes", []):
                p.close()
        return base
    raise RuntimeError("no free port range")
