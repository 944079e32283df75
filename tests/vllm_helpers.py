"""Shared helpers for the vLLM integration tests (free ports, an event mirror, waiting)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from kvplug.events import AllCleared, BlockRemoved, BlockStored, KvEvent
from kvplug.testing import free_port, free_port_run, free_port_runs

__all__ = [
    "Mirror",
    "free_port",
    "free_port_run",
    "free_port_runs",
    "wait_for",
    "wait_joined",
    "wait_sub_hears",
    "wait_subscribed",
]


class Mirror:
    """What a consumer of the normalised events believes each (worker, rank) holds.

    Engine-hash multiset per (worker, rank), applied with the index's rules (refcounted
    duplicates; a store from the root re-announcing blocks already held does not count them
    again; unknown removes counted). Thread-safe: the subscriber calls it from its thread.
    """

    def __init__(self) -> None:
        self.held: dict[tuple[str, int], dict[int, int]] = {}
        self.events: list[KvEvent] = []
        self.unknown_removes = 0
        self.lock = threading.Lock()

    def __call__(self, events: list[KvEvent]) -> None:
        with self.lock:
            for e in events:
                self.events.append(e)
                key = (e.worker_id, e.dp_rank)
                h = self.held.setdefault(key, {})
                if isinstance(e, BlockStored):
                    hashes = [int(x) for x in e.engine_hashes]
                    if e.parent_engine_hash is None:  # re-announced leading blocks: held already
                        while hashes and h.get(hashes[0], 0) > 0:
                            hashes.pop(0)
                    for x in hashes:
                        h[x] = h.get(x, 0) + 1
                elif isinstance(e, BlockRemoved):
                    for x in e.engine_hashes:
                        if h.get(int(x), 0) > 0:
                            h[int(x)] -= 1
                            if h[int(x)] == 0:
                                del h[int(x)]
                        else:
                            self.unknown_removes += 1
                elif isinstance(e, AllCleared):
                    h.clear()

    def hashes(self, worker: str, rank: int = 0) -> set[int]:
        with self.lock:
            return set(self.held.get((worker, rank), {}))


def wait_for(
    cond: Callable[[], bool], timeout: float = 15.0, pump: Callable[[], None] | None = None
) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pump is not None:
            pump()
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def wait_joined(
    probes: Sequence[Callable[[], None]], probes_seen: Callable[[], int], timeout: float = 20.0
) -> None:
    """Block until a subscriber hears each of several publishers (ZMQ's slow joiner).

    Each of ``probes`` sends, on one publisher, a one-frame message the subscriber drops as
    malformed; ``probes_seen`` reads its ``malformed_frames`` counter. A publisher's probes go
    out until the counter has grown by more than every probe sent before could account for (a
    late probe of the previous publisher must not pass for this one's). A fixed sleep is not
    enough on a loaded machine, and a batch published before the join is lost for good when
    nothing follows it. Probes still in flight when this returns are handled before any later
    message on their connection (ZMQ keeps its order): take a baseline after a batch.
    """
    start = probes_seen()
    sent = 0
    for probe in probes:
        before = probes_seen()
        unaccounted = sent - (before - start)  # sent earlier, not seen yet: may still arrive
        end = time.monotonic() + timeout
        while probes_seen() - before <= unaccounted:
            assert time.monotonic() < end, f"the subscriber heard no probe within {timeout:g} s"
            probe()
            sent += 1
            time.sleep(0.02)


def wait_subscribed(subscriber, publishers, timeout: float = 20.0) -> None:
    """``wait_joined`` for VllmEventPublishers (e.g. in-process simulated engines') and one
    VllmSubscriber (e.g. ``adapter.subscriber`` of a frontend)."""
    wait_joined(
        [lambda pub=pub: pub.send_raw([pub.topic]) for pub in publishers],
        lambda: subscriber.stats()["malformed_frames"],
        timeout,
    )


def wait_sub_hears(sub, pub, timeout: float = 20.0) -> None:
    """``wait_joined`` for a bare SUB socket the test reads itself and a VllmEventPublisher:
    probes until one arrives, then the probes still in flight are read off and dropped
    (call it before anything real is published)."""
    end = time.monotonic() + timeout
    while not sub.poll(20):
        assert time.monotonic() < end, f"the SUB socket heard no probe within {timeout:g} s"
        pub.send_raw([pub.topic])
    while sub.poll(200):
        sub.recv_multipart()
