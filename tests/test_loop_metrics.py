"""kvplug.frontend.metrics.LoopMetric prints what prometheus_client's own metric of the same
kind prints for the same changes (the request path's series moved to it for speed)."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvplug.frontend.metrics import _LATENCY_BUCKETS, _ROUTE_BUCKETS, LoopMetric


def _text(registry: CollectorRegistry) -> str:
    # the _created timestamps differ by construction time
    return re.sub(r"(_created(\{[^}]*\})?) \S+", r"\1 T", generate_latest(registry).decode())


values = st.one_of(
    st.sampled_from(_LATENCY_BUCKETS + _ROUTE_BUCKETS),  # exactly on a bound
    st.floats(0, 200, allow_nan=False),
)
labels = st.sampled_from(["a", "b", "c/d", 'q"uote'])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(labels, values), max_size=40), st.sampled_from(["route", "latency"]))
def test_a_histogram_prints_as_prometheus_client_prints_it(observations, which):
    buckets = _ROUTE_BUCKETS if which == "route" else _LATENCY_BUCKETS
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    a = LoopMetric(ours, "histogram", "h_seconds", "help text", ["stage"], buckets)
    b = Histogram("h_seconds", "help text", ["stage"], buckets=buckets, registry=theirs)
    for label, value in observations:
        a.labels(label).observe(value)
        b.labels(label).observe(value)
    assert _text(ours) == _text(theirs)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(labels, labels, st.integers(0, 5)), max_size=40))
def test_counters_and_gauges_print_as_prometheus_client_prints_them(changes):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    c1 = LoopMetric(ours, "counter", "reqs", "requests", ["endpoint", "status"])
    c2 = Counter("reqs", "requests", ["endpoint", "status"], registry=theirs)
    g1 = LoopMetric(ours, "gauge", "inflight", "in flight")
    g2 = Gauge("inflight", "in flight", registry=theirs)
    for endpoint, status, n in changes:
        c1.labels(endpoint, status).inc(n)
        c2.labels(endpoint, status).inc(n)
        g1.inc(n)
        g2.inc(n)
        g1.dec()
        g2.dec()
    assert _text(ours) == _text(theirs)


def test_a_wrong_number_of_labels_is_refused():
    metric = LoopMetric(CollectorRegistry(), "counter", "x", "x", ["a", "b"])
    try:
        metric.labels("only-one")
    except ValueError as exc:
        assert "labels" in str(exc)
    else:
        raise AssertionError("one label value for two names was taken")
