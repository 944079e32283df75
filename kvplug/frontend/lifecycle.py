"""One routed request's lifecycle as the router must hear it: first token, each block boundary
the sequence crosses while generating, finish (success or failure). ``finish`` is idempotent,
so a ``finally`` can always call it and the worker's active load returns to exactly zero.
``on_release`` (optional) hears every first token and finish too: load dropped, so the
admission queue may let a waiting request go."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class Lifecycle:
    __slots__ = (
        "router",
        "route_id",
        "block_size",
        "prompt_tokens",
        "first_seen",
        "tokens",
        "finished",
        "started",
        "first_at",
        "on_release",
    )

    def __init__(
        self,
        router: Any,
        route_id: str,
        block_size: int,
        prompt_tokens: int = 0,
        on_release: Callable[[], None] | None = None,
    ):
        self.router = router
        self.route_id = route_id
        self.block_size = block_size if block_size > 0 else 1
        self.prompt_tokens = prompt_tokens  # boundaries are of the whole sequence (prompt+output)
        self.first_seen = False
        self.tokens = 0
        self.finished = False
        self.started = time.perf_counter()
        self.first_at: float | None = None
        self.on_release = on_release

    def first_token(self, measured: bool = True) -> None:
        """The first token came; ``measured=False`` when it came with a whole answer (after its
        decode), so its time says nothing of the prefill (``Router.on_first_token``)."""
        if not self.first_seen and not self.finished:
            self.first_seen = True
            self.first_at = time.perf_counter()
            self.router.on_first_token(self.route_id, measured)
            if self.on_release is not None:
                self.on_release()

    def output(self, total_tokens: int) -> None:
        """Total generated so far; the router hears it when a block boundary was crossed."""
        if self.finished or total_tokens <= self.tokens:
            return
        if not self.first_seen:
            self.first_token()
        p, bs = self.prompt_tokens, self.block_size
        crossed = (p + total_tokens) // bs != (p + self.tokens) // bs
        self.tokens = total_tokens
        if crossed:
            self.router.on_output_progress(self.route_id, total_tokens)

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.router.on_finish(self.route_id)
            if self.on_release is not None:
                self.on_release()
