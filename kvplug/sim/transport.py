"""What lies between a simulated engine and the router: KV-event delivery (delay, jitter, loss,
gap detection and replay), metric staleness and request-report delay.

The event link models one engine's vLLM ZMQ stream as kvplug's subscriber
(``kvplug.integrations.vllm.subscriber``) consumes it: the events of one engine step form one
batch with the next sequence number; each batch is lost with probability ``loss`` (independently)
and otherwise arrives ``delay + Exp(jitter)`` later, in order. The subscriber applies the next
expected seq; a later seq is a gap: live batches wait while it asks the engine's replay socket for
the missing ones, which arrive one ``replay_rtt`` later together with everything the engine had
published by then (the engine buffers ``replay_buffer`` batches, vLLM's default 10,000); batches
that fell out of the buffer stay lost. A gap is only noticed when the next batch arrives, as live.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass

IDEAL = "ideal"
REALISTIC = "realistic"


@dataclass(frozen=True)
class LinkConfig:
    """The router's view of the fleet; defaults = the ideal view (today's replay)."""

    event_delay_s: float = 0.005  # engine step -> router, fixed part
    event_jitter_s: float = 0.0  # mean of an exponential extra delay per batch
    event_loss: float = 0.0  # probability a batch never arrives live
    replay_rtt_s: float = 0.02  # gap noticed -> replayed batches applied
    replay_buffer: int = 10_000  # batches an engine keeps for replay (vLLM's default)
    metrics_delay_s: float = 0.0  # age of the gauges when the router gets them
    attribute_period_s: float = 1.0  # scrape period of the gauges
    report_delay_s: float = 0.0  # first token / progress / finish reach the router this late

    def __post_init__(self) -> None:
        for name in (
            "event_delay_s",
            "event_jitter_s",
            "replay_rtt_s",
            "metrics_delay_s",
            "report_delay_s",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0")
        if not 0 <= self.event_loss < 1:
            raise ValueError("event_loss must be in [0, 1)")
        if self.attribute_period_s <= 0:
            raise ValueError("attribute_period_s must be > 0")
        if self.replay_buffer < 0:
            raise ValueError("replay_buffer must be >= 0")


# "realistic": what a router sees across a datacenter network from vLLM engines (assumptions,
# each varied in docs/sim.md): ZMQ batches 20 ms late plus 10 ms mean jitter, 1 % of batches lost
# (a slow subscriber's high-water mark, a reconnect), replay answered in 20 ms; gauges scraped
# every 2 s and 1 s old when read (vLLM updates its Prometheus gauges from the logging loop);
# streamed first tokens and finishes reach the proxy 20 ms late.
PRESETS = {
    IDEAL: LinkConfig(),
    REALISTIC: LinkConfig(
        event_delay_s=0.02,
        event_jitter_s=0.01,
        event_loss=0.01,
        replay_rtt_s=0.02,
        metrics_delay_s=1.0,
        attribute_period_s=2.0,
        report_delay_s=0.02,
    ),
}


class EventLink:
    """One engine's KV-event stream into the router's subscriber.

    ``publish(t, events)`` -> the (time, events) deliveries this batch causes, which the caller
    schedules; ``on_batch`` / ``on_replay`` are called at delivery time and return the event
    lists to apply now, in order.
    """

    __slots__ = (
        "cfg",
        "rng",
        "seq",
        "buffer",
        "expected",
        "replaying",
        "pending",
        "last_arrival",
        "stats",
    )

    def __init__(self, cfg: LinkConfig, rng: random.Random) -> None:
        self.cfg = cfg
        self.rng = rng
        self.seq = 0  # next seq the engine publishes
        self.buffer: deque[tuple[int, float, list]] = deque()  # (seq, publish time, events)
        self.expected = 0  # the subscriber's next seq
        self.replaying = False
        self.pending: list[tuple[int, list]] = []  # live batches waiting for a replay
        self.last_arrival = -math.inf
        self.stats = {"batches": 0, "lost": 0, "gaps": 0, "replayed": 0, "unrecovered": 0}

    def publish(self, t: float, events: list) -> tuple[int, float] | None:
        """The engine publishes a batch at ``t``; returns (seq, arrival time) or None if lost."""
        cfg = self.cfg
        seq = self.seq
        self.seq += 1
        self.stats["batches"] += 1
        if cfg.replay_buffer:
            self.buffer.append((seq, t, events))
            if len(self.buffer) > cfg.replay_buffer:
                self.buffer.popleft()
        if cfg.event_loss and self.rng.random() < cfg.event_loss:
            self.stats["lost"] += 1
            return None
        delay = cfg.event_delay_s
        if cfg.event_jitter_s:
            delay += self.rng.expovariate(1.0 / cfg.event_jitter_s)
        arrival = max(t + delay, self.last_arrival)  # one ordered stream
        self.last_arrival = arrival
        return seq, arrival

    def on_batch(self, seq: int, events: list) -> tuple[list[list], bool]:
        """A live batch arrives: (event lists to apply now, whether to schedule a replay)."""
        if self.replaying:
            self.pending.append((seq, events))
            return [], False
        if seq == self.expected:
            self.expected = seq + 1
            return [events], False
        if seq < self.expected:  # already applied from a replay
            return [], False
        self.stats["gaps"] += 1
        self.pending.append((seq, events))
        self.replaying = True
        return [], True

    def on_replay(self, t: float) -> list[list]:
        """The replay reply arrives at ``t``: everything the engine published by ``t`` from the
        expected seq on (what its buffer still holds), then the waiting live batches."""
        out: list[list] = []
        for seq, t_pub, events in self.buffer:
            if t_pub > t:
                break
            if seq < self.expected:
                continue
            if seq > self.expected:  # fell out of the replay buffer: lost for good
                self.stats["unrecovered"] += seq - self.expected
            out.append(events)
            self.stats["replayed"] += 1
            self.expected = seq + 1
        for seq, events in sorted(self.pending, key=lambda p: p[0]):
            if seq < self.expected:
                continue
            if seq > self.expected:
                self.stats["unrecovered"] += seq - self.expected
            out.append(events)
            self.expected = seq + 1
        self.pending.clear()
        self.replaying = False
        return out
