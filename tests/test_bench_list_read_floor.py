"""Smoke run of benchmarks/bench_list_read_floor.py: the read loop builds, reads every case's
lists (it refuses an item that is not a small exact int) and the JSON has every method."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    path = ROOT / "benchmarks/bench_list_read_floor.py"
    spec = importlib.util.spec_from_file_location("bench_list_read_floor", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


NO_CC = shutil.which("cc") is None and shutil.which("gcc") is None
OLD_INTS = sys.version_info < (3, 12)  # the read loop reads CPython 3.10/3.11's int layout
pytestmark = pytest.mark.skipif(NO_CC or not OLD_INTS, reason="needs cc and CPython < 3.12")


def test_every_case_times_the_read_loop_and_kvplug(tmp_path):
    out = tmp_path / "floor.json"
    assert _bench().main(["--rounds", "2", "--passes", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["cases"]) == {
        "out_of_cache_256_lists",
        "in_cache_8_lists",
        "as_decoded_256_lists",
    }
    for case in res["cases"].values():
        for method in ("read_floor", "kvplug_list", "kvplug_numpy"):
            ns = case["ns_per_token"][method]
            assert 0 < ns["min"] <= ns["median"] <= ns["max"] < 1000
        assert len(case["rounds"]) == 2


def test_the_read_loop_refuses_what_kvplug_refuses(tmp_path):
    """The loop checks what kvplug's reader checks: a bool or a big int is not a token."""
    import ctypes

    bench = _bench()
    dll = bench.build_floor(tmp_path)
    acc = ctypes.c_uint64(0)
    # the lists stay referenced while the loop reads them (it holds raw item pointers)
    for lists in ([[1, 2, True, 4]], [[1, 2, 3, 2**40]], [[1, 2, -3, 4]]):
        ptrs, lens = bench.item_pointers(lists)
        assert dll.read_lists(ptrs, lens, 1, ctypes.byref(acc)) == 0, lists
    good = [[0, 1, 2**30 - 1, 5, 7]]
    ptrs, lens = bench.item_pointers(good)
    assert dll.read_lists(ptrs, lens, 1, ctypes.byref(acc)) == 1
