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


def load_event_recorder() -> type:
    """The wheel's ``KVCacheEventRecorder`` (``sglang/srt/mem_cache/events.py``): the class whose
    ``enqueue`` decides how many events a radix cache's stores and removals become (it joins a
    page's store onto the store it chains to, and a removal onto the removal before it).

    ``mem_cache/events.py`` imports three hash helpers from ``mem_cache/utils.py``, whose own
    imports pull SGLang's GPU kernels; ``enqueue`` uses none of them, so a stand-in module
    holding the three names is registered while the file loads. The event classes are the
    wheel's own (``load_kv_events``)."""
    kv_events = load_kv_events()
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations)))
    path = root / "srt" / "mem_cache" / "events.py"
    stand_in = types.ModuleType("sglang.srt.mem_cache.utils")
    for helper in (
        "compute_node_event_hash_values",
        "compute_node_hash_values",
        "hash_str_to_int64",
    ):
        setattr(stand_in, helper, None)
    saved = {k: sys.modules.get(k) for k in ("sglang.srt.mem_cache.utils", kv_events.__name__)}
    sys.modules["sglang.srt.mem_cache.utils"] = stand_in
    sys.modules[kv_events.__name__] = kv_events
    try:
        module_spec = importlib.util.spec_from_file_location("_sglang_mem_cache_events", path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    finally:
        for key, value in saved.items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value
    return module.KVCacheEventRecorder
