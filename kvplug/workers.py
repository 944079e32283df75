"""Workers (routable engines) and the router's per-worker runtime state.

A worker is one routable engine; a tensor/expert-parallel engine spanning several GPUs is one
worker. Data-parallel ranks ``[dp_start, dp_start + dp_size)`` are separate endpoints of the
same worker: each rank has its own KV cache, hence its own index endpoint and its own load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from kvplug.errors import ConfigError
from kvplug.stalls import LoopStalls


class Role(str, Enum):
    """Which stage of a disaggregated deployment a worker serves."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    def __str__(self) -> str:
        return self.value


class Stage(str, Enum):
    """Which stage a routing request is for (PROTOCOLS.md §4.6)."""

    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"

    def __str__(self) -> str:  # "prefill", not "Stage.PREFILL", in f-strings and logs
        return self.value

    # the str's own hash (C), not Enum's Python-level hash(self._name_): every decision looks
    # its stage up in a few dicts; equal to the value's hash, as equality already is
    __hash__ = str.__hash__


def role_serves(role: Role, stage: Stage) -> bool:
    """Prefill requests go to prefill/both workers, decode requests to decode/both."""
    if stage is Stage.PREFILL:
        return role is not Role.DECODE
    if stage is Stage.DECODE:
        return role is not Role.PREFILL
    return True


@dataclass
class Worker:
    """One routable engine. A tensor- or expert-parallel engine spanning several GPUs is one
    worker; each data-parallel rank in ``[dp_start, dp_start + dp_size)`` is an endpoint of
    its own (own KV cache, own load). ``kv_capacity_blocks`` / ``max_batched_tokens`` of 0
    mean unknown (the busy thresholds that need them are skipped)."""

    worker_id: str
    url: str | None = None
    engine: str = "vllm"
    role: Role = Role.BOTH
    dp_start: int = 0
    dp_size: int = 1
    labels: dict[str, str] = field(default_factory=dict)
    taints: frozenset[str] = frozenset()
    device: str = "gpu"  # "cpu" or an accelerator class ("gpu", "tpu", ...)
    kv_capacity_blocks: int = 0  # 0 = unknown
    max_batched_tokens: int = 0  # 0 = unknown
    # vLLM's --long-prefill-token-threshold: while other requests run or wait, a prompt takes at
    # most this many tokens of a step, so it does not hold up the requests behind it (0 = off)
    long_prefill_token_threshold: int = 0
    # vLLM's --long-prefill-token-threshold-adaptive: that cap is floored at the budget over
    # the engine's running and waiting requests
    long_prefill_token_threshold_adaptive: bool = False
    event_endpoint: str | None = None
    replay_endpoint: str | None = None
    metrics_url: str | None = None

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ConfigError("worker_id must be a non-empty string")
        if isinstance(self.role, str) and not isinstance(self.role, Role):
            try:
                self.role = Role(self.role)
            except ValueError:
                raise ConfigError(
                    f"worker {self.worker_id}: role {self.role!r} is not prefill|decode|both"
                ) from None
        if self.dp_size < 1 or self.dp_start < 0:
            raise ConfigError(
                f"worker {self.worker_id}: dp_start={self.dp_start} dp_size={self.dp_size} "
                "(need dp_start >= 0, dp_size >= 1)"
            )
        if (
            self.kv_capacity_blocks < 0
            or self.max_batched_tokens < 0
            or self.long_prefill_token_threshold < 0
        ):
            raise ConfigError(
                f"worker {self.worker_id}: kv_capacity_blocks, max_batched_tokens and "
                "long_prefill_token_threshold must be >= 0"
            )
        self.taints = frozenset(self.taints)
        self.labels = dict(self.labels)

    @property
    def dp_ranks(self) -> range:
        return range(self.dp_start, self.dp_start + self.dp_size)

    @property
    def is_cpu(self) -> bool:
        return self.device.lower() == "cpu"


@dataclass
class Attribute:
    value: float
    ts: float  # router clock time of the observation


@dataclass
class WorkerState:
    """What the router knows about a worker at run time."""

    worker: Worker
    endpoint_ids: list[int]  # one per DP rank, in rank order
    draining: bool = False
    attributes: dict[str, Attribute] = field(default_factory=dict)

    def attribute(self, name: str, now: float, max_age: float) -> tuple[float | None, float | None]:
        """(value or None if missing/stale, age or None if missing)."""
        a = self.attributes.get(name)
        if a is None:
            return None, None
        age = now - a.ts
        if max_age > 0 and age > max_age:
            return None, age
        return a.value, age


class AttributeTable:
    """Attribute values and observation times as dense vectors by endpoint id (NaN time =
    never observed), so filters and scorers read a whole candidate set in one gather."""

    def __init__(self) -> None:
        self._cap = 0
        self.values: dict[str, np.ndarray] = {}
        self.times: dict[str, np.ndarray] = {}
        # kvplug serve's event-loop stalls (kvplug.stalls): an age does not count time the
        # pollers could not run. None in the simulator (its clock is virtual)
        self.stalls: LoopStalls | None = None

    def ensure(self, n: int) -> None:
        if n <= self._cap:
            return
        cap = max(n, 2 * self._cap, 16)
        for table, fill in ((self.values, 0.0), (self.times, np.nan)):
            for name, old in table.items():
                new = np.full(cap, fill)
                new[: len(old)] = old
                table[name] = new
        self._cap = cap

    def set(self, endpoints: list[int], name: str, value: float, ts: float) -> None:
        if name not in self.values:
            self.values[name] = np.zeros(self._cap)
            self.times[name] = np.full(self._cap, np.nan)
        self.values[name][endpoints] = value
        self.times[name][endpoints] = ts

    def clear(self, endpoints: list[int]) -> None:
        for name in self.times:
            self.times[name][endpoints] = np.nan

    def read(
        self, name: str, endpoints: np.ndarray, now: float, max_age: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(values, fresh mask, ages with NaN = never observed) for the endpoints."""
        n = len(endpoints)
        if name not in self.values:
            return np.zeros(n), np.zeros(n, dtype=bool), np.full(n, np.nan)
        times = self.times[name][endpoints]
        ages = now - times
        if self.stalls is not None:
            credit = self.stalls.credit(times, now)
            if credit is not None:
                ages -= credit
        fresh = ages <= max_age if max_age > 0 else ~np.isnan(ages)  # NaN compares False
        return self.values[name][endpoints], fresh, ages
