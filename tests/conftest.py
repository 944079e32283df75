"""Suite-wide rule: under ``CI=true`` a skipped test is a failed test.

A test that skips for want of a component (the real vLLM engine, the compiled core, gcc with
the sanitizers) once let CI pass with the real engine never started. In CI every such
component is installed by ``.ci/run``, so a skip there means the set-up broke. Tests that are
skipped on purpose carry ``@pytest.mark.opt_in`` (the P/D test, which runs only with
``KVPLUG_REAL_PD=1``) and keep skipping. A whole file that skips while it is collected (a
module-level ``pytest.importorskip`` of the native lane, say) fails too: those skips never
reach a test's report.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

# Hypothesis measures the machine as well as the code: on a loaded CI runner drawing examples
# is slow, and its too_slow health check (or a per-example deadline) fails a correct test.
# Settings given on a test still win; this is the default for those that give none.
settings.register_profile("kvplug", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvplug")


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _fail_the_skip(report) -> None:
    """A test's or a file's skip report turned into a failure that says why."""
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped under CI=true (a component CI installs is missing): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and _in_ci()) or item.get_closest_marker("opt_in"):
        return
    if hasattr(report, "wasxfail"):
        return  # an expected failure is not a missing component
    _fail_the_skip(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _in_ci():
        _fail_the_skip(report)
