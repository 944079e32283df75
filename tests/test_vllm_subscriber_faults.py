"""Subscriber faults with figures (benchmarks/fault_subscriber.py, short runs): a subscriber
behind the publisher's high-water mark misses nothing (gap, replay, blocks missed = 0), and a
replay endpoint that does not answer costs the rank's index (cleared, counted), never stale
blocks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(180)


def run(tmp_path, *args):
    out = tmp_path / "fault.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "fault_subscriber.py"),
            *args,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_subscriber_behind_the_high_water_mark_misses_nothing(tmp_path):
    """6000 batches while the consumer stalls: ZMQ drops most of them, the replay (longer than
    the engine's ROUTER queue: it drops replies too, so the subscriber asks again from the
    first missing one) brings them back; late live copies are duplicates, not a restart."""
    # a replay of ~6000 batches takes longer than the 0.2 s replay timeout: a replay that
    # keeps delivering must not be cut short (the timeout is for silence)
    got = run(
        tmp_path,
        *("--scenario", "hwm", "--batches", "6000", "--hwm", "50", "--replay-timeout", "0.2"),
    )["hwm"]
    fig, base = got["with_replay"], got["baseline_no_replay_endpoint"]
    assert fig["batches_dropped_by_zmq"] > 0 and fig["gaps_detected"] >= 1
    assert fig["batches_replayed"] >= fig["batches_dropped_by_zmq"]
    assert (fig["blocks_missed"], fig["stale_blocks"], fig["batches_missed"]) == (0, 0, 0)
    assert (fig["rank_clears"], fig["restarts_misread"], fig["subscriber_internal_errors"]) == (
        0,
        0,
        0,
    )
    assert fig["converged_seconds"] is not None
    # the baseline shows what the replay saves: without it every gap clears the rank
    assert base["rank_clears"] >= 1 and base["blocks_missed"] > 0 and base["stale_blocks"] == 0


def test_replay_endpoint_down_clears_the_rank_counted_nothing_stale(tmp_path):
    got = run(tmp_path, "--scenario", "replay-down", "--batches", "400", "--replay-timeout", "0.5")[
        "replay_down"
    ]
    assert (got["gaps_detected"], got["replay_failures"], got["batches_missed"]) == (1, 1, 1)
    assert got["rank_clears"] == 1 and got["stale_blocks"] == 0
    assert 0.5 <= got["seconds_gap_to_clear"] < 5
    # what is lost: blocks stored before the gap (the index no longer offers them)
    assert 0 < got["blocks_lost_from_index"] == got["of_which_pre_gap_blocks"]
    assert got["indexed_blocks"] + got["blocks_lost_from_index"] == got["engine_blocks"]
