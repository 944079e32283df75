"""The CI=true rule in tests/conftest.py: a skip fails unless the test is marked opt_in."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")


def _run(tmp_path: Path, ci: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(CONFTEST.read_text())
    (tmp_path / "test_x.py").write_text(
        textwrap.dedent(
            """
            import pytest

            def test_needs_component():
                pytest.skip("no engine")

            @pytest.mark.opt_in
            def test_opt_in():
                pytest.skip("set X=1")

            @pytest.mark.xfail(reason="known")
            def test_xfail():
                assert False

            def test_ok():
                pass
            """
        )
    )
    env = {"PATH": "/usr/bin:/bin", "CI": ci}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-W",
            "ignore",
            "-o",
            "markers=opt_in: x",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )


def test_a_skip_fails_under_ci(tmp_path):
    out = _run(tmp_path, "true")
    assert out.returncode == 1, out.stdout
    assert "1 failed" in out.stdout and "1 skipped" in out.stdout, out.stdout
    assert "skipped under CI=true" in out.stdout and "no engine" in out.stdout


def test_a_skip_is_a_skip_outside_ci(tmp_path):
    out = _run(tmp_path, "")
    assert out.returncode == 0, out.stdout
    assert "2 skipped" in out.stdout, out.stdout


def _run_module_skip(tmp_path: Path, ci: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(CONFTEST.read_text())
    (tmp_path / "test_y.py").write_text(
        "import pytest\n"
        "pytest.importorskip('kvplug_no_such_module')\n"
        "def test_never_collected():\n"
        "    pass\n"
    )
    (tmp_path / "test_z.py").write_text("def test_ok():\n    pass\n")
    env = {"PATH": "/usr/bin:/bin", "CI": ci}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
         str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip


def test_a_file_skipped_while_collected_fails_under_ci(tmp_path):
    out = _run_module_skip(tmp_path, "true")
    assert out.returncode != 0, out.stdout
    # a collection error: pytest stops before running anything
    assert "1 error" in out.stdout and "skipped under CI=true" in out.stdout, out.stdout
    assert "kvplug_no_such_module" in out.stdout, out.stdout


def test_a_file_skipped_while_collected_is_a_skip_outside_ci(tmp_path):
    out = _run_module_skip(tmp_path, "")
    assert out.returncode == 0 and "1 passed, 1 skipped" in out.stdout, out.stdout
