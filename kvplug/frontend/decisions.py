"""A bounded store of recent routing decisions, for ``GET /kvplug/decisions/{id}``.

Records keep the router's ``Decision`` object and the frontend's facts about the request (token
source, attempts, outcome, timings); JSON is built only when someone asks.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections import OrderedDict
from typing import Any


class _RandomIds:
    """24 hex digits from the OS's CSPRNG (as ``secrets.token_hex(12)``), drawn 256 ids at a
    time: one ``getrandom`` call (and one hex conversion) per 256 decisions instead of one per
    decision."""

    __slots__ = ("_hex", "_pos")
    _DIGITS = 24
    _BATCH = 256

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._hex = ""
        self._pos = 0

    def next(self) -> str:
        pos = self._pos
        if pos >= len(self._hex):
            self._hex = secrets.token_hex(self._DIGITS // 2 * self._BATCH)
            pos = 0
        self._pos = pos + self._DIGITS
        return self._hex[pos : pos + self._DIGITS]


_random_ids = _RandomIds()
if hasattr(os, "register_at_fork"):  # a forked child draws its own ids, never its parent's
    os.register_at_fork(after_in_child=_random_ids.reset)


class DecisionRecord:
    __slots__ = (
        "decision",
        "decision_id",
        "request_id",
        "stage",
        "attempt",
        "path",
        "model",
        "token_source",
        "token_note",
        "prompt_tokens",
        "worker_id",
        "dp_rank",
        "worker_url",
        "status",
        "outcome",
        "error",
        "route_us",
        "ttft_s",
        "total_s",
        "output_tokens",
        "related",
        "created",
        "fallback_reason",
        "queue_wait_s",
        "batch",
        "unhealthy",
    )

    def __init__(
        self,
        decision: Any,
        request_id: str,
        stage: str,
        attempt: int,
        path: str,
        model: str,
        token_source: str,
        token_note: str | None,
        prompt_tokens: int | None,
        worker_url: str | None,
        route_us: float,
    ) -> None:
        self.decision = decision
        # random, not the router's sequence number: a trace id cannot be guessed
        self.decision_id = _random_ids.next()
        self.request_id = request_id
        self.stage = stage
        self.attempt = attempt
        self.path = path
        self.model = model
        self.token_source = token_source
        self.token_note = token_note
        self.prompt_tokens = prompt_tokens
        self.worker_id = decision.worker_id
        self.dp_rank = decision.dp_rank
        self.worker_url = worker_url
        self.status: int | None = None
        self.outcome = "in_flight"
        self.error: str | None = None
        self.route_us = route_us
        self.ttft_s: float | None = None
        self.total_s: float | None = None
        self.output_tokens: int | None = None
        self.related: list[str] = []  # other decisions of the same request (retries, P/D stages)
        self.created = time.time()
        self.fallback_reason: str | None = None
        self.queue_wait_s: float | None = None  # time in the admission queue (None: not queued)
        # one prompt of a split batch: {"request_id", "prompt_index", "size"}
        self.batch: dict[str, Any] | None = None
        # workers kept out of this decision for their health: id -> {"down_by", "reason"}
        # (down_by "outlier": ejected by outlier detection)
        self.unhealthy: dict[str, dict[str, Any]] | None = None

    def to_json(self) -> dict[str, Any]:
        to_dict = getattr(self.decision, "to_dict", None)
        trace = to_dict() if to_dict is not None else json.loads(self.decision.to_json())
        return {
            "decision_id": self.decision_id,
            "request_id": self.request_id,
            "stage": self.stage,
            "attempt": self.attempt,
            "path": self.path,
            "model": self.model,
            "worker_id": self.worker_id,
            "dp_rank": self.dp_rank,
            "worker_url": self.worker_url,
            "tokens": {
                "source": self.token_source,
                "count": self.prompt_tokens,
                "note": self.token_note,
            },
            "outcome": self.outcome,
            "status": self.status,
            "error": self.error,
            "fallback_reason": self.fallback_reason,
            "timings": {
                "route_us": round(self.route_us, 1),
                "ttft_s": self.ttft_s,
                "total_s": self.total_s,
                "queue_wait_s": self.queue_wait_s,
            },
            "output_tokens": self.output_tokens,
            "related_decisions": list(self.related),
            "batch": self.batch,
            "unhealthy_workers": self.unhealthy or {},
            "created_unix": self.created,
            "router": trace,
        }


class DecisionStore:
    """LRU of the last ``capacity`` decisions (lookups refresh an entry)."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = max(0, capacity)
        self._records: OrderedDict[str, DecisionRecord] = OrderedDict()

    def add(self, record: DecisionRecord) -> None:
        if self.capacity == 0:
            return
        self._records[record.decision_id] = record
        if len(self._records) > self.capacity:
            self._records.popitem(last=False)

    def get(self, decision_id: str) -> DecisionRecord | None:
        record = self._records.get(decision_id)
        if record is not None:
            self._records.move_to_end(decision_id)
        return record

    def __len__(self) -> int:
        return len(self._records)
