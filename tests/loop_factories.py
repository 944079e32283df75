"""The event loops kvplug serve runs on, for tests that must hold on each."""

from __future__ import annotations

import asyncio
import os


def loop_factories() -> list:
    """asyncio's loop, and uvloop's when installed (kvplug serve's loop then: its timers run
    before its I/O poll, asyncio's after). Under ``CI=true`` uvloop must be there (``.ci/run``
    installs the serve extra): without it the uvloop cases would vanish from the suite rather
    than fail, past the rule that fails skips (``tests/conftest.py``)."""
    loops = [asyncio.new_event_loop]
    try:
        import uvloop
    except ImportError:  # pragma: no cover - the serve extra
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            raise
        return loops
    return [*loops, uvloop.new_event_loop]
