"""The event loops kvplug serve runs on, for tests that must hold on each."""

from __future__ import annotations

import asyncio


def loop_factories() -> list:
    """asyncio's loop, and uvloop's when installed (kvplug serve's loop then: its timers run
    before its I/O poll, asyncio's after)."""
    loops = [asyncio.new_event_loop]
    try:
        import uvloop
    except ImportError:  # pragma: no cover - the serve extra
        return loops
    return [*loops, uvloop.new_event_loop]
