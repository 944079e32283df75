"""Packaging rules: nothing installs outside the kvplug name, no module shadows the stdlib."""

from __future__ import annotations

import sys
from pathlib import Path

import kvplug

ROOT = Path(__file__).resolve().parent.parent


def test_no_module_shares_a_standard_library_name():
    # A script run from a folder holding e.g. http.py imports it instead of the stdlib's
    # http (this broke .ci/setup_vllm.sh once).
    ours = [
        p
        for top in ("kvplug", "integrations", "tests", "benchmarks", ".ci")
        for p in (ROOT / top).rglob("*.py")
        if p.stem != "__init__"
    ]
    clashes = sorted(str(p.relative_to(ROOT)) for p in ours if p.stem in sys.stdlib_module_names)
    clashes += sorted(
        str(p.relative_to(ROOT))
        for top in ("kvplug", "integrations", "tests")
        for p in (ROOT / top).rglob("__init__.py")
        if p.parent.name in sys.stdlib_module_names
    )
    assert not clashes, f"modules named like the standard library: {clashes}"


def test_integrations_install_under_the_kvplug_name():
    import kvplug.integrations.vllm.wire as wire

    assert wire.__name__.startswith("kvplug.integrations.")
    assert Path(wire.__file__).resolve().is_relative_to(ROOT / "integrations")
    assert kvplug.__name__ == "kvplug"


def test_wheel_declares_only_kvplug_packages():
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(p == "kvplug" or p.startswith("kvplug.") for p in cfg["packages"])
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")


def test_the_only_file_outside_kvplug_is_the_one_line_hook_pth():
    # setup.py's build_py puts kvplug_trtllm.pth at the wheel root (site-packages); it must
    # keep the kvplug name, stay one line, and reach the sdist (MANIFEST.in)
    setup = (ROOT / "setup.py").read_text()
    assert 'HOOK_PTH = "kvplug_trtllm.pth"' in setup
    pth = (ROOT / "kvplug_trtllm.pth").read_text()
    assert pth.count("\n") == 1 and pth.startswith("import os; ")
    assert "KVPLUG_TRTLLM_HOOK" in pth and "kvplug.integrations.trtllm.hook" in pth
    assert "include kvplug_trtllm.pth" in (ROOT / "MANIFEST.in").read_text()
    stray = [p.name for p in ROOT.glob("*.pth") if not p.name.startswith("kvplug")]
    assert not stray, stray
