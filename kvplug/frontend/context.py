"""What the frontend knows about one client request while it serves it, and where one of its
routing stages went. Shared by the single-request path (app.py) and batched completions
(batch.py), so neither imports the other for them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvplug.frontend.decisions import DecisionRecord
from kvplug.frontend.fleet import WorkerEntry
from kvplug.frontend.hints import RequestHints
from kvplug.frontend.lifecycle import Lifecycle
from kvplug.frontend.parsing import ParsedRequest


@dataclass(slots=True)
class RequestContext:
    key: int
    request_id: str
    req: ParsedRequest
    tokens: list[int] | np.ndarray | None  # a uint32 array from the token-id fast path
    token_source: str
    token_note: str | None
    hints: RequestHints
    model_workers: frozenset[str] | None
    forward: dict[str, str] = field(default_factory=dict)  # client headers for the engine
    records: list[DecisionRecord] = field(default_factory=list)
    ticket: Any = None  # released from the admission queue, not yet routed
    queue_wait_s: float | None = None
    deadline: float | None = None  # time.monotonic() of --request-timeout


@dataclass(slots=True)
class Routed:
    decision: Any
    entry: WorkerEntry
    lifecycle: Lifecycle
    record: DecisionRecord
