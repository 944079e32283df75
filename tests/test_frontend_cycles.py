"""A request through ``kvplug serve`` leaves nothing for the garbage collector: everything it
allocates is freed by reference counting when it ends. Objects left in reference cycles made
CPython's collector run every ~30 requests at 16 connections (issue 12: ~11 us of CPU a
request, docs/frontend.md "Benchmark")."""

from __future__ import annotations

import gc

import pytest
from test_frontend_harness import prompt, serving

pytestmark = pytest.mark.timeout(60)


def _kvplug_cycles() -> dict[str, int]:
    """kvplug's own objects (stub engines aside) the collector finds unreachable now."""
    found: dict[str, int] = {}
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        for obj in gc.garbage:
            kind = type(obj)
            module = getattr(kind, "__module__", "") or ""
            if module.startswith("kvplug.") and "stub_engine" not in module:
                name = f"{module}.{kind.__qualname__}"
                found[name] = found.get(name, 0) + 1
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return found


@pytest.mark.parametrize("stream", [False, True])
async def test_served_requests_leave_no_reference_cycles(stream):
    async with serving(2) as h:
        for i in range(3):  # warm: connections opened, caches filled
            resp, _ = await h.complete(prompt(4, i), stream=stream)
            assert resp.status == 200
        gc.collect()
        gc.disable()
        try:
            for i in range(20):
                resp, _ = await h.complete(prompt(4, 100 + i), stream=stream)
                assert resp.status == 200
            h.assert_idle()
            assert _kvplug_cycles() == {}
        finally:
            gc.enable()
