"""kvplug serve's collector settings (kvplug/frontend/gc_tuning.py)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

from kvplug.frontend.gc_tuning import SERVING_THRESHOLDS, tune_for_serving


def test_tune_for_serving_raises_the_thresholds_and_freezes_startup():
    previous = gc.get_threshold()
    try:
        assert tune_for_serving() == previous
        assert gc.get_threshold() == SERVING_THRESHOLDS
        assert gc.get_freeze_count() > 0
        assert SERVING_THRESHOLDS[0] > 700  # CPython's default, a pass every ~2 requests
    finally:
        gc.unfreeze()
        gc.set_threshold(*previous)


def test_cycles_are_still_collected_after_tuning():
    # a fresh interpreter: the settings are process-wide
    code = """
import gc, json, weakref
from kvplug.frontend.gc_tuning import tune_for_serving
tune_for_serving()
class Node: pass
refs = []
for _ in range(50_000):  # cyclic garbage, as aiohttp's protocol/transport pairs leave
    a, b = Node(), Node()
    a.other, b.other = b, a
    refs.append(weakref.ref(a))
alive = sum(r() is not None for r in refs)
print(json.dumps({"alive": alive, "threshold": gc.get_threshold()}))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    result = json.loads(out)
    assert result["threshold"] == list(SERVING_THRESHOLDS)
    assert result["alive"] < 10_000  # collected along the way, not piling up
