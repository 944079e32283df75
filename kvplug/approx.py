"""Approximate mode: learn from routing when engines publish no KV events.

Each routed prompt is recorded as cached (device tier) on the chosen endpoint for a time to
live, in a *separate* KvIndex instance, so predicted entries never collide with event-fed
ones; the router combines both as the per-endpoint maximum. Size is capped in blocks: the
oldest records go first, and the side index itself is LRU-bounded by the same cap.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from kvplug.events import BlockRemoved, BlockStored
from kvplug.index import reserve_room

# live records per endpoint, at most: each record adds one reference to each of its blocks on
# its endpoint, and the core counts references in 16 bits (65,535). A prompt prefix every request
# shares (a system prompt) would otherwise overflow that count once one engine had been sent it
# 65,535 times within the TTL (~550 requests a second at the 120 s default), and the store
# would fail the request
RECORDS_PER_ENDPOINT = 65_000


def _as_sequence(hashes: np.ndarray) -> Sequence[int]:
    """A u64 array where the events declare Sequence[int]: it is one (len, index, iteration),
    and the core reads its buffer without per-block objects."""
    return cast(Sequence[int], hashes)


class ApproxIndex:
    def __init__(self, index_factory: Any, block_size: int, ttl: float, max_blocks: int) -> None:
        self.index = index_factory(block_size, max_entries=max_blocks)
        # a KvIndex's core and endpoint ids: records go straight in (another index kind: events)
        self._core = (
            getattr(self.index, "core", None) if hasattr(self.index, "endpoint_id") else None
        )
        self.ttl = ttl
        self.max_blocks = max_blocks
        self._records: deque[tuple[float, str, int, np.ndarray]] = deque()
        self._per_endpoint: dict[tuple[str, int], int] = {}  # live records
        self._blocks = 0
        self._presized = 0  # blocks its index has room for (presize)
        self.counters = {"recorded": 0, "expired": 0, "capped": 0, "capped_endpoint": 0}

    def presize(self, capacity: int) -> None:
        """Room for what the side index will hold once the fleet's caches are full (its
        capacity, within the block cap), reserved up front as the router does for its main
        index: recording routed prompts then never stops the event loop for a rehash. Room
        only grows."""
        want = min(capacity, self.max_blocks) if self.max_blocks else capacity
        self._presized = reserve_room(
            self.index, want, self._presized, "the approximate-mode index"
        )

    def add_endpoint(self, worker_id: str, dp_rank: int) -> int:
        return self.index.add_endpoint(worker_id, dp_rank)

    def endpoint_id(self, worker_id: str, dp_rank: int) -> int | None:
        return self.index.endpoint_id(worker_id, dp_rank)

    def remove_worker(self, worker_id: str) -> None:
        self.index.remove_worker(worker_id)
        self._records = deque(r for r in self._records if r[1] != worker_id)
        self._blocks = sum(len(r[3]) for r in self._records)
        self._per_endpoint = {k: n for k, n in self._per_endpoint.items() if k[0] != worker_id}

    def record(self, worker_id: str, dp_rank: int, hashes: np.ndarray, now: float) -> None:
        if len(hashes) == 0:
            return
        key = (worker_id, dp_rank)
        while self._per_endpoint.get(key, 0) >= RECORDS_PER_ENDPOINT and self._records:
            self._drop_oldest()  # the oldest first, as the block cap does
            self.counters["capped_endpoint"] += 1
        h = np.array(hashes, dtype=np.uint64, copy=True)
        # our own hashes double as the "engine" hashes: this namespace is ours alone. The
        # arrays go in as numpy buffers (the core reads them directly; no per-block objects).
        seq = _as_sequence(h)
        core = self._core
        ep = self.index.endpoint_id(worker_id, dp_rank) if core is not None else None
        if core is not None and ep is not None:
            # straight into the core: every request records one, and the event path's checks
            # (an engine's block size, tiers, shared copies) never apply to our own records
            core.store(ep, 0, seq, seq)
        else:
            self.index.apply(
                BlockStored(
                    worker_id=worker_id, dp_rank=dp_rank, engine_hashes=seq, block_hashes=seq
                )
            )
        self._records.append((now, worker_id, dp_rank, h))
        self._per_endpoint[key] = self._per_endpoint.get(key, 0) + 1
        self._blocks += len(h)
        self.counters["recorded"] += 1
        while self.max_blocks and self._blocks > self.max_blocks and self._records:
            self._drop_oldest()
            self.counters["capped"] += 1

    def expire(self, now: float) -> None:
        while self._records and now - self._records[0][0] > self.ttl:
            self._drop_oldest()
            self.counters["expired"] += 1

    def _drop_oldest(self) -> None:
        _, wid, rank, h = self._records.popleft()
        self._blocks -= len(h)
        left = self._per_endpoint.get((wid, rank), 0) - 1
        if left > 0:
            self._per_endpoint[(wid, rank)] = left
        else:
            self._per_endpoint.pop((wid, rank), None)
        core = self._core
        ep = self.index.endpoint_id(wid, rank) if core is not None else None
        try:
            if core is not None and ep is not None:  # as record: straight into the core
                core.remove(ep, _as_sequence(h), None)
            else:
                self.index.apply(
                    BlockRemoved(worker_id=wid, dp_rank=rank, engine_hashes=_as_sequence(h))
                )
        except Exception:  # the worker was removed meanwhile: nothing left to drop
            pass

    def query(self, hashes: np.ndarray) -> Any:
        return self.index.query(hashes)

    def stats(self) -> dict[str, int]:
        s = dict(self.counters)
        s["records"] = len(self._records)
        s["blocks"] = self._blocks
        s["presized_blocks"] = self._presized
        return s
