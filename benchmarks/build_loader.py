"""A compiled extension module of another source tree (built in place with
``setup.py build_ext --inplace``), loaded beside this process's own: the A/B benchmarks
(``ab_*_builds.py``, ``ab_seq_hashes.py``) time two builds taking turns in one process."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path
from types import ModuleType


def load_extension(tree: str, folder: str, stem: str, name: str) -> ModuleType:
    """``tree/folder/stem*.so`` as module ``name`` (its last part must be ``stem``: it names the
    init function)."""
    found = sorted(Path(tree, folder).glob(f"{stem}*.so"))
    if not found:
        raise SystemExit(f"no {folder}/{stem}*.so under {tree}: build it in place first")
    loader = importlib.machinery.ExtensionFileLoader(name, str(found[0]))
    spec = importlib.util.spec_from_file_location(name, str(found[0]), loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
