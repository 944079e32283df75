"""One routed request's lifecycle as the router must hear it: first token, each output block
boundary crossed, finish (success or failure). ``finish`` is idempotent, so a ``finally`` can
always call it and the worker's active load returns to exactly zero."""

from __future__ import annotations

import time
from typing import Any


class Lifecycle:
    __slots__ = (
        "router",
        "route_id",
        "block_size",
        "first_seen",
        "tokens",
        "finished",
        "started",
        "first_at",
        "on_done",
    )

    def __init__(self, router: Any, route_id: str, block_size: int, on_done=None) -> None:
        self.router = router
        self.route_id = route_id
        self.block_size = max(1, block_size)
        self.first_seen = False
        self.tokens = 0
        self.finished = False
        self.started = time.perf_counter()
        self.first_at: float | None = None
        self.on_done = on_done  # called once with this object after the router heard finish

    def first_token(self) -> None:
        if not self.first_seen and not self.finished:
            self.first_seen = True
            self.first_at = time.perf_counter()
            self.router.on_first_token(self.route_id)

    def output(self, total_tokens: int) -> None:
        """Total generated so far; tells the router only when a block boundary is crossed."""
        if self.finished or total_tokens <= self.tokens:
            return
        if not self.first_seen:
            self.first_token()
        crossed = total_tokens // self.block_size != self.tokens // self.block_size
        self.tokens = total_tokens
        if crossed:
            self.router.on_output_progress(self.route_id, total_tokens)

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        self.router.on_finish(self.route_id)
        if self.on_done is not None:
            self.on_done(self)
