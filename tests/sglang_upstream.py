"""SGLang's own KV-event module (``sglang/srt/disaggregation/kv_events.py``) from the installed
``sglang`` wheel (``.ci/run`` installs sglang 0.5.23 with ``--no-deps``, plus psutil and pydantic,
which that module's imports need).

``import sglang`` runs a package ``__init__`` that pulls torch and triton, and so does
``sglang.srt.utils``; neither is needed by the event classes or the ZMQ publisher. The loader
registers bare package shells for ``sglang`` and ``sglang.srt.utils`` whose ``__path__`` is the
wheel's own directory, so ``kv_events.py`` and its two real imports
(``sglang.srt.runtime_context``, ``sglang.srt.utils.network``) load from the wheel unchanged and
nothing else runs. The shells are removed from ``sys.modules`` afterwards.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path

import pytest

PINNED = "0.5.23"
_SHELLS = ("sglang", "sglang.srt", "sglang.srt.utils")


def load_kv_events() -> types.ModuleType:
    """The wheel's ``kv_events`` module; skips when sglang is not installed (``.ci/run``
    installs it, and a skip fails under CI=true)."""
    spec = importlib.util.find_spec("sglang")  # finds the package without running __init__
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"sglang {PINNED} is not installed (pip install --no-deps sglang=={PINNED})")
    version = importlib.metadata.version("sglang")
    assert version == PINNED, f"the fixtures are pinned to sglang {PINNED}, found {version}"
    root = Path(next(iter(spec.submodule_search_locations)))
    name = "sglang.srt.disaggregation.kv_events"
    if name in sys.modules:
        return sys.modules[name]
    added = []
    for shell, rel in zip(_SHELLS, ("", "srt", "srt/utils"), strict=True):
        if shell not in sys.modules:
            module = types.ModuleType(shell)
            module.__path__ = [str(root / rel)]
            sys.modules[shell] = module
            added.append(shell)
    try:
        return importlib.import_module(name)
    finally:
        for shell in added:  # the loaded modules keep what they imported
            sys.modules.pop(shell, None)
