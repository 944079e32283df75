"""Faults over real processes: two ``kvplug sim`` engines, ``kvplug serve`` and a reference
``kvplug serve`` (``benchmarks/fault_engines.py``, its short run). One test per fault; each
starts from a healthy fleet and leaves one behind, so they share one lab."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import fault_engines as fe  # noqa: E402

pytestmark = pytest.mark.timeout(120)

# The bounds below say each recovery happens, and in seconds, not that it is fast: the figures
# are benchmarks/fault_engines.py's (quiet machine). A loaded CI runner takes seconds to start
# a Python process or answer a probe, so the bounds leave it several times its quiet time.


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    loop = asyncio.new_event_loop()
    the_lab = fe.Lab(tmp_path_factory.mktemp("faults"))
    # Engine a's port is taken after it was picked. On one CI run an engine exited with 1 at
    # start (its log was not kept; a taken port is the sim's exit-1 cause) and every test here
    # errored: the lab now starts that engine on fresh ports.
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", the_lab.engines["a"].http))
    squatter.listen()
    taken = the_lab.engines["a"].http
    try:
        loop.run_until_complete(the_lab.start())
        squatter.close()
        assert the_lab.engines["a"].http != taken
        yield loop, the_lab
    finally:
        squatter.close()
        loop.run_until_complete(the_lab.close())
        loop.close()


def test_engine_sigkilled_mid_stream_then_restarted(lab):
    loop, the_lab = lab
    killed, restarted = loop.run_until_complete(fe.engine_killed_and_restarted(the_lab, True))
    # only the streams on the killed engine are lost (their bytes were out: no retry)
    assert killed["streams_on_killed_engine"] >= 1
    assert killed["streams_lost"] == killed["streams_on_killed_engine"]
    assert killed["streams_lost_on_other_engine"] == 0
    # no request that had not started answering is lost: retried on the other engine
    assert killed["requests_after_kill"] > 0 and killed["requests_failed"] == 0
    assert killed["time_to_mark_down_s"] < 10.0
    assert killed["routed_to_killed_after_down"] == 0  # its blocks are excluded from then on
    # the restarted engine (empty cache) is back, its stale blocks purged, nothing failed
    assert restarted["time_to_healthy_s"] < 25.0  # a new engine process starts first
    assert restarted["time_to_purge_stale_blocks_s"] < 25.0
    assert restarted["time_to_first_served_s"] is not None
    assert restarted["blocks_after"] < restarted["stale_blocks_before"]
    assert restarted["requests_failed"] == 0


def test_metrics_endpoint_timing_out(lab):
    loop, the_lab = lab
    row = loop.run_until_complete(fe.metrics_timeout(the_lab, True))
    assert row["requests"] > 0 and row["requests_failed"] == 0
    assert row["routed_to_it_while_down"] == 0
    assert row["time_to_mark_down_s"] < 20.0
    assert row["time_to_back_after_metrics_answer_s"] < 15.0


def test_router_restarted_rebuilds_the_engines_index(lab):
    loop, the_lab = lab
    row = loop.run_until_complete(fe.router_restarted(the_lab, True))
    assert row["time_to_ready_s"] < 50.0  # a new kvplug serve process starts first
    assert row["time_to_index_match_s"] is not None
    assert row["index_matches"], row
    assert row["engine_requests_failed"] == 0


def test_engine_hung_by_sigstop(lab):
    loop, the_lab = lab
    row = loop.run_until_complete(fe.engine_hung(the_lab, True))
    # attempts on the silent engine give up after --per-try-timeout 1 and go to the other one
    assert row["requests"] > 0 and row["requests_failed"] == 0
    assert row["slowest_answer_s"] < 5.0
    assert row["time_to_mark_down_s"] < 20.0
    assert row["time_to_back_after_sigcont_s"] < 20.0
