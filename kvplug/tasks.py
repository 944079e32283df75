"""Stopping background tasks: one helper for every loop kvplug runs (pollers, watches,
heartbeats, probes)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable


async def cancel_and_wait(tasks: Iterable[asyncio.Task | None]) -> None:
    """Cancel the tasks, then wait for each to end; what they raise while ending is theirs
    (already logged by them), not the caller's. ``None`` entries are skipped."""
    running = [t for t in tasks if t is not None]
    for task in running:
        task.cancel()
    for task in running:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
