"""Build the C core with AddressSanitizer + UBSan (KVPLUG_SANITIZE=1) and run core tests on it.

The build goes to a temporary copy of the sources; the tests run in a subprocess with libasan
preloaded (the interpreter itself is not instrumented). Leak detection is off: CPython keeps
memory until exit by design.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = [
    "test_core_basic.py",
    "test_core_badinput.py",
    "test_core_pylists.py",
    "test_core_growth.py",
    "test_core_holders.py",
    "test_core_canonical.py",
    "test_hash_vectors.py",
    "test_index_events.py",
    "test_core_differential.py",
    "test_index_batch.py",
    "test_parsing_fastpath.py",  # kvplug/_token_json.pyx reads client bytes
    "test_native_lane.py",  # kvplug/_lane.pyx + csrc/lane.c: client and engine bytes
    "test_active_blocks_differential.py",  # _core.ActiveBlocks' pointers into hash arrays
    "test_affinity.py",  # _core.predicted_ttfts' tables and SlidingQuantile's blocks
]
TEST_HELPERS = ["core_tables.py", "test_router_helpers.py"]  # modules the tests above import
BENCH_HELPERS = ["instant_engine.py"]  # test_native_lane's engines


def _libasan() -> str | None:
    try:
        out = subprocess.run(
            ["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return out if os.path.isabs(out) and os.path.exists(out) else None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_core_under_asan_and_ubsan(tmp_path):
    libasan = _libasan()
    if libasan is None:
        pytest.skip("gcc with libasan is not available")
    src = tmp_path / "src"
    shutil.copytree(ROOT / "csrc", src / "csrc")
    shutil.copytree(
        ROOT / "kvplug",
        src / "kvplug",
        ignore=shutil.ignore_patterns(
            "*.so", "__pycache__", "_core.c", "_token_json.c", "_lane.c", "*.html"
        ),
    )
    shutil.copy(ROOT / "setup.py", src / "setup.py")
    shutil.copytree(ROOT / "tests" / "data", src / "tests" / "data")
    for name in (*TESTS, *TEST_HELPERS):
        shutil.copy(ROOT / "tests" / name, src / "tests" / name)
    (src / "benchmarks").mkdir()
    for name in BENCH_HELPERS:
        shutil.copy(ROOT / "benchmarks" / name, src / "benchmarks" / name)

    env = dict(os.environ, KVPLUG_SANITIZE="1")
    build = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace", "-j", "2"],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    for name in ("_core", "_lane"):
        built = list((src / "kvplug").glob(f"{name}*.so"))
        assert built and b"libasan" in built[0].read_bytes(), f"{name} is not sanitized"

    env.update(
        LD_PRELOAD=libasan,
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:halt_on_error=1",
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
        PYTHONPATH=str(src),
        KVPLUG_DIFF_EXAMPLES="150",
        KVPLUG_CORE="c",
    )
    run = subprocess.run(
        [
            sys.executable,
            *("-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "asyncio_mode=auto"),
            *TESTS,
        ],
        cwd=src / "tests",
        env=env,
        capture_output=True,
        text=True,
    )
    out = run.stdout[-5000:] + run.stderr[-5000:]
    assert "AddressSanitizer" not in out and "runtime error" not in out, out
    assert run.returncode == 0, out


@pytest.mark.timeout(300)
def test_c_api_stress_under_asan_ubsan_and_leak_checker(tmp_path):
    """csrc/test/stress.c drives the C API directly (no Python), so LeakSanitizer can be on."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not available")
    exe = tmp_path / "kvp_stress"
    flags = [
        "-std=c11",
        "-O1",
        "-g",
        "-fsanitize=address,undefined",
        "-fno-sanitize-recover=undefined",
        "-fno-omit-frame-pointer",
        # pool arrays move to their own mremap-grown mapping at 4 KiB instead of 1 MiB, so the
        # small indexes of the stress run exercise that path too
        "-DKVP_BIG_BYTES=4096",
    ]
    sources = [
        str(ROOT / "csrc" / "test" / "stress.c"),
        *map(str, sorted((ROOT / "csrc").glob("*.c"))),
    ]
    build = subprocess.run(
        ["gcc", *flags, "-I", str(ROOT / "csrc"), *sources, "-lm", "-o", str(exe)],
        capture_output=True,
        text=True,
    )
    if build.returncode != 0 and "asan" in build.stderr.lower():
        pytest.skip(f"gcc cannot link the sanitizers here: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr[-3000:]
    env = dict(
        os.environ,
        ASAN_OPTIONS="detect_leaks=1:halt_on_error=1",
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
    )
    env.pop("LD_PRELOAD", None)
    run = subprocess.run([str(exe), "20000"], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (
        run.stdout[-2000:] + run.stderr[-3000:]
    )
