"""The step-time model against hand-computed cases and the calibration points it was fit from."""

import json
from importlib import resources

import pytest

from kvplug.sim import steptime
from kvplug.sim.calibration import fit_prefill
from kvplug.sim.steptime import REFERENCE, StepTimeModel, capacity_blocks, parse_steptime


def _calib():
    return json.loads(
        (resources.files("kvplug.sim") / "data" / "prefill_calib_h200.json").read_text()
    )


def test_cold_prefill_matches_the_stated_fit():
    m = REFERENCE
    # 0.0282*8192 + 4.36e-7*8192^2 = 231.014 + 29.260 = 260.27 ms
    assert m.prefill_ms(8192, 0) == pytest.approx(0.0282 * 8192 + 4.36e-7 * 8192**2)
    assert m.prefill_ms(8192, 0) == pytest.approx(260.27, abs=0.01)
    assert m.prefill_ms(0, 5000) == 0.0


def test_cold_fit_within_5_percent_of_measured_from_2k_to_32k():
    cold = _calib()["prefill_cold_ms"]
    for length in (2048, 4096, 8192, 16384, 32768):
        assert REFERENCE.prefill_ms(length, 0) == pytest.approx(cold[str(length)], rel=0.05)


def test_cached_preset_tracks_the_cached_points():
    cached = _calib()["prefill_cached_ms"]
    high = parse_steptime("cached")
    for p in (2048, 8192, 16384):
        measured = cached[f"P{p}_N2048"]
        assert high.prefill_ms(2048, p) == pytest.approx(measured, rel=0.2), p
    # hand-computed: 2048 new on 8192 cached
    expect = 0.0282 * 2048 + 4.36e-7 * 2048**2 + 2.45e-6 * 2048 * 8192
    assert high.prefill_ms(2048, 8192) == pytest.approx(expect)
    assert expect == pytest.approx(100.69, abs=0.01)


def test_default_context_rate_is_the_causal_rate():
    # a cached pair costs what a pair inside the prompt's causal triangle costs: prefilling L
    # tokens in two chunks costs (almost) what one chunk does, not 2.8x more for the second half
    assert REFERENCE.ctx_ms == pytest.approx(2 * REFERENCE.quad_ms, rel=1e-3)
    whole = REFERENCE.prefill_ms(16384, 0)
    chunked = REFERENCE.prefill_ms(8192, 0) + REFERENCE.prefill_ms(8192, 8192)
    assert chunked == pytest.approx(whole, rel=0.01)


def test_constants_are_the_calibration_fit():
    fit = fit_prefill(_calib())
    assert steptime.LINEAR_MS == pytest.approx(fit.linear_ms, rel=0.01)
    assert steptime.QUAD_MS == pytest.approx(fit.quad_ms, rel=0.01)
    assert steptime.CTX_CAUSAL_MS == pytest.approx(fit.ctx_causal_ms, rel=0.01)
    assert steptime.CTX_CACHED_MS == pytest.approx(fit.ctx_cached_ms, rel=0.01)
    assert fit.cold_max_rel_err < 0.02
    assert 2.5 < fit.cached_over_causal < 3.1  # the gap the --steptime range spans


def test_parse_steptime():
    assert parse_steptime("causal").ctx_ms == steptime.CTX_CAUSAL_MS
    assert parse_steptime("cached").ctx_ms == steptime.CTX_CACHED_MS
    assert parse_steptime("ctx=1e-6").ctx_ms == 1e-6
    for bad in ("fast", "ctx=", "ctx=-1", "ctx=abc", "quad=1"):
        with pytest.raises(ValueError):
            parse_steptime(bad)


def test_decode_step_is_weights_plus_kv_read():
    # 32 sequences of 4k tokens: 3.7 + 0.0305 * 131072/1000 = 7.698 ms (the calibration note's 7.7)
    assert REFERENCE.step_ms(0.0, 32, 32 * 4096) == pytest.approx(7.6977, abs=1e-3)
    # a single sequence: weights read dominates the 0.0282 ms of compute
    assert REFERENCE.step_ms(0.0, 1, 1000) == pytest.approx(3.7 + 0.0305)


def test_mixed_step_is_compute_bound():
    pre = REFERENCE.prefill_ms(4000, 0)  # 112.8 + 6.98 = 119.78 ms
    step = REFERENCE.step_ms(pre, 10, 20_000)
    assert step == pytest.approx(pre + 0.0282 * 10 + 0.0305 * 20)


def test_reload_and_overhead():
    m = StepTimeModel(overhead_ms=0.5, host_reload_gbps=50.0)
    # 512 tokens * 131072 B = 67.1 MB at 50 GB/s = 1.342 ms
    assert m.reload_ms(512) == pytest.approx(512 * 131072 / 50e9 * 1e3)
    assert m.step_ms(0.0, 1, 0, m.reload_ms(512)) == pytest.approx(
        3.7 + 0.0282 * 0 + 1.342 + 0.5, abs=1e-3
    )


def test_capacity_of_the_reference_setup():
    assert capacity_blocks(512) == 1640
    assert capacity_blocks(16) == 52500


def test_mocker_preset_adds_a_fixed_cost_per_prefill_and_per_decode_step():
    m = steptime.MOCKER
    assert parse_steptime("mocker") is m
    # a prefill step: Dynamo's mocker polynomial in its tokens, whatever the cached prefix
    pre = m.prefill_ms(4096, 30_000)
    assert pre == pytest.approx(0.015183 * 4096 + 4.21e-7 * 4096**2)
    assert m.step_ms(pre, 0, 0) == pytest.approx(16.50 + pre)
    # a decode-only step: fixed + per sequence + per 1,000 context tokens
    assert m.step_ms(0.0, 32, 32_000) == pytest.approx(5.86 + 0.015183 * 32 + 0.0432 * 32)
    assert m.decode_only_ms(32) + m.decode_kv_ms(32_000) == pytest.approx(
        m.step_ms(0.0, 32, 32_000)
    )
    # both in one step add up (the mocker's mixed steps cost the two apart)
    both = m.step_ms(pre, 32, 32_000)
    assert both == pytest.approx(16.50 + pre + 5.86 + 0.015183 * 32 + 0.0432 * 32)
    # the H200 model has neither fixed cost: its steps are unchanged
    assert REFERENCE.prefill_step_ms == REFERENCE.decode_step_ms == 0.0
    assert REFERENCE.decode_only_ms(0) == REFERENCE.weights_ms


def test_mocker_preset_matches_dynamos_mocker():
    """The preset against Dynamo's own mocker engine (ai-dynamo-runtime, the bench extra CI
    installs), measured as benchmarks/fit_mocker_steptime.py does: prefill exact, decode steps
    within 15 % (the mocker's decode time is concave in the context, the preset's linear)."""
    pytest.importorskip("dynamo._core")
    import importlib.util
    import os
    from pathlib import Path

    os.environ.setdefault("DYN_LOG", "warn")
    import dynamo._core as dynamo

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "fit_mocker_steptime.py"
    spec = importlib.util.spec_from_file_location("fit_mocker_steptime", path)
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    rows = fit.measure(dynamo)
    prefill = [r for r in rows if r["probe"].startswith("prefill")]
    decode = [r for r in rows if r["probe"].startswith("decode")]
    assert len(prefill) == 9 and len(decode) == 7
    for r in prefill:
        assert r["ratio"] == pytest.approx(1.0, abs=1e-3), r
    for r in decode:
        assert 0.85 <= r["ratio"] <= 1.15, r
    # and a preset with the H200 timing is far from it: the test can tell them apart
    h200 = fit.measure(dynamo, REFERENCE)
    assert max(abs(r["ratio"] - 1) for r in h200 if r["probe"].startswith("prefill")) > 0.3


def test_a_slower_engine_scales_every_compute_and_read_time_but_not_its_links():
    slow = REFERENCE.slowed(2.0)
    assert slow.prefill_ms(4096, 8192) == pytest.approx(2 * REFERENCE.prefill_ms(4096, 8192))
    assert slow.step_ms(30.0, 8, 50_000) == pytest.approx(2 * REFERENCE.step_ms(15.0, 8, 50_000))
    assert slow.decode_only_ms(64) == pytest.approx(2 * REFERENCE.decode_only_ms(64))
    assert slow.reload_ms(1000) == REFERENCE.reload_ms(1000)  # host and P/D links unchanged
    assert slow.transfer_ms(1000) == REFERENCE.transfer_ms(1000)
    assert REFERENCE.slowed(1.0) == REFERENCE
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="factor"):
            REFERENCE.slowed(bad)
