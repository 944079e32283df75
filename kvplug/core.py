"""The active core backend.

The compiled ``kvplug._core`` is the default. The pure-Python reference runs only when asked
for explicitly with ``KVPLUG_CORE=reference``; a missing compiled core is a loud ImportError,
never a silent fall back to the (100x slower) reference.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

_BUILD_HINT = (
    "kvplug's compiled core (kvplug._core) is not built or cannot be loaded. Build it from the "
    "repository root with `pip install -e .` (or `python setup.py build_ext --inplace`). To run "
    "the slow pure-Python reference instead, set KVPLUG_CORE=reference explicitly."
)


def load_backend(name: str) -> ModuleType:
    """The core module for ``name``: "c" (compiled) or "reference" (pure Python)."""
    if name == "reference":
        from kvplug import _reference

        return _reference
    if name == "c":
        try:
            from kvplug import _core
        except ImportError as err:
            missing = err.name or ""
            if missing and missing != "kvplug._core" and not missing.startswith("kvplug"):
                # built, but a dependency is missing: typically a Python other than the venv's
                raise ImportError(
                    f"kvplug needs {missing!r}, which this Python ({sys.executable}) does not "
                    "have: run kvplug (and benchmarks/*.py) with the Python of the environment "
                    "it is installed in (e.g. .venv/bin/python), or `pip install -e .` here"
                ) from err
            found = importlib.util.find_spec("kvplug._core") is not None
            why = f"loading it failed: {err}" if found else "no compiled kvplug/_core*.so found"
            raise ImportError(f"{_BUILD_HINT} ({why})") from err
        return _core
    raise ImportError(f"unknown kvplug core backend {name!r}: expected 'c' or 'reference'")


def _choose() -> tuple[str, ModuleType]:
    raw = os.environ.get("KVPLUG_CORE", "").strip().lower()
    if raw in ("", "c", "compiled"):
        return "c", load_backend("c")
    if raw in ("reference", "python", "py"):
        return "reference", load_backend("reference")
    raise ImportError(f"KVPLUG_CORE={raw!r} is not a kvplug core: use 'c' or 'reference'")


backend, impl = _choose()

Index = impl.Index
QueryResult = impl.QueryResult
CostParams = impl.CostParams
hash_blocks = impl.hash_blocks
seq_hashes = impl.seq_hashes
local_hash = impl.local_hash
chain_hash = impl.chain_hash
costs = impl.costs
select = impl.select
# compiled only: the reference takes SeedCost's numpy path, which this matches bit for bit
seed_load_costs = getattr(impl, "seed_load_costs", None)
# compiled only: the reference backend runs kvplug.active_blocks.ActiveBlocks and numpy gathers
ActiveBlocks = getattr(impl, "ActiveBlocks", None)
gather_f64 = getattr(impl, "gather_f64", None)
# compiled only: the affinity policy's predictions for many engines (one Python call per engine
# on the reference, the same floats)
stale_prefill_summaries = getattr(impl, "stale_prefill_summaries", None)
predicted_ttfts = getattr(impl, "predicted_ttfts", None)
# compiled only: kvplug.affinity.RecentQuantile's twin (the same floats)
SlidingQuantile = getattr(impl, "SlidingQuantile", None)
softmax_probs = impl.softmax_probs
DEVICE, HOST, DISK, N_TIERS = impl.DEVICE, impl.HOST, impl.DISK, impl.N_TIERS
SHARED = impl.SHARED
MAX_ENDPOINT = impl.MAX_ENDPOINT

__all__ = [
    "DEVICE",
    "DISK",
    "HOST",
    "MAX_ENDPOINT",
    "N_TIERS",
    "SHARED",
    "SlidingQuantile",
    "ActiveBlocks",
    "CostParams",
    "Index",
    "QueryResult",
    "backend",
    "chain_hash",
    "costs",
    "gather_f64",
    "hash_blocks",
    "impl",
    "load_backend",
    "local_hash",
    "predicted_ttfts",
    "seed_load_costs",
    "select",
    "seq_hashes",
    "softmax_probs",
    "stale_prefill_summaries",
]
