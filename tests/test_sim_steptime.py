"""The step-time model against hand-computed cases and the calibration points it was fit from."""

import json
from importlib import resources

import pytest

from kvplug.sim.steptime import REFERENCE, StepTimeModel, capacity_blocks


def _calib():
    return json.loads(
        (resources.files("kvplug.sim") / "data" / "prefill_calib_h200.json").read_text()
    )


def test_cold_prefill_matches_the_stated_fit():
    m = REFERENCE
    # 0.0290*8192 + 4.15e-7*8192^2 = 237.568 + 27.850 = 265.42 ms
    assert m.prefill_ms(8192, 0) == pytest.approx(0.0290 * 8192 + 4.15e-7 * 8192**2)
    assert m.prefill_ms(8192, 0) == pytest.approx(265.42, abs=0.01)
    assert m.prefill_ms(0, 5000) == 0.0


def test_cold_fit_within_5_percent_of_measured_from_2k_to_32k():
    cold = _calib()["prefill_cold_ms"]
    for length in (2048, 4096, 8192, 16384, 32768):
        assert REFERENCE.prefill_ms(length, 0) == pytest.approx(cold[str(length)], rel=0.05)


def test_context_term_tracks_the_cached_points():
    cached = _calib()["prefill_cached_ms"]
    for p in (2048, 8192, 16384):
        measured = cached[f"P{p}_N2048"]
        assert REFERENCE.prefill_ms(2048, p) == pytest.approx(measured, rel=0.2), p
    # hand-computed: 2048 new on 8192 cached
    expect = 0.0290 * 2048 + 4.15e-7 * 2048**2 + 2.39e-6 * 2048 * 8192
    assert REFERENCE.prefill_ms(2048, 8192) == pytest.approx(expect)
    assert expect == pytest.approx(101.23, abs=0.01)


def test_decode_step_is_weights_plus_kv_read():
    # 32 sequences of 4k tokens: 3.7 + 0.0305 * 131072/1000 = 7.698 ms (the calibration note's 7.7)
    assert REFERENCE.step_ms(0.0, 32, 32 * 4096) == pytest.approx(7.6977, abs=1e-3)
    # a single sequence: weights read dominates the 0.029 ms of compute
    assert REFERENCE.step_ms(0.0, 1, 1000) == pytest.approx(3.7 + 0.0305)


def test_mixed_step_is_compute_bound():
    pre = REFERENCE.prefill_ms(4000, 0)  # 116 + 6.64 = 122.64 ms
    step = REFERENCE.step_ms(pre, 10, 20_000)
    assert step == pytest.approx(pre + 0.0290 * 10 + 0.0305 * 20)


def test_reload_and_overhead():
    m = StepTimeModel(overhead_ms=0.5, host_reload_gbps=50.0)
    # 512 tokens * 131072 B = 67.1 MB at 50 GB/s = 1.342 ms
    assert m.reload_ms(512) == pytest.approx(512 * 131072 / 50e9 * 1e3)
    assert m.step_ms(0.0, 1, 0, m.reload_ms(512)) == pytest.approx(
        3.7 + 0.029 * 0 + 1.342 + 0.5, abs=1e-3
    )


def test_capacity_of_the_reference_setup():
    assert capacity_blocks(512) == 1640
    assert capacity_blocks(16) == 52500
