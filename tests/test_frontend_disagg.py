"""Disaggregated serving through the frontend: stub engines that emulate vLLM's NIXL pull
handshake (the prefill stub answers with ``kv_transfer_params``; the decode stub checks it got
them, with the same X-Request-Id, and "pulls" the prompt's KV from the prefill stub) and SGLang's
concurrent bootstrap (both hops carry one ``bootstrap_room``)."""

from __future__ import annotations

import json

import pytest
from test_frontend_harness import MODEL, prompt, serving

pytestmark = pytest.mark.timeout(60)

PD = [
    {"id": "p0", "role": "prefill"},
    {"id": "p1", "role": "prefill"},
    {"id": "d0", "role": "decode"},
    {"id": "d1", "role": "decode"},
]


@pytest.mark.parametrize("stream", [True, False])
async def test_vllm_style_two_stage_flow(stream):
    async with serving(PD) as h:
        p = prompt(4, 1)
        resp, raw = await h.complete(
            p, stream=stream, max_tokens=5, headers={"X-Request-Id": "pd-1"}
        )
        assert resp.status == 200, raw
        prefill_id = resp.headers["x-kvplug-prefill-worker"]
        decode_id = resp.headers["x-kvplug-worker"]
        assert prefill_id in ("p0", "p1") and decode_id in ("d0", "d1")

        pre = h.engines[prefill_id].requests[-1]
        assert pre["headers"]["X-Request-Id"] == "pd-1"
        assert pre["body"]["kv_transfer_params"]["do_remote_decode"] is True
        assert pre["body"]["stream"] is False and pre["body"]["max_tokens"] == 1
        dec = h.engines[decode_id].requests[-1]
        assert dec["headers"]["X-Request-Id"] == "pd-1"  # the same id on both hops
        params = dec["body"]["kv_transfer_params"]
        assert params["remote_engine_id"] == prefill_id and params["do_remote_prefill"] is True
        assert dec["body"]["stream"] is stream and dec["body"]["max_tokens"] == 5
        assert h.board.pulled == 1 and not h.board.pending  # the decode stub took the KV
        if stream:
            assert raw.endswith(b"data: [DONE]\n\n")
        else:
            assert json.loads(raw)["usage"]["completion_tokens"] == 5

        # both stages' decisions are traced and linked
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["stage"] == "decode" and trace["router"]["stage"] == "decode"
        pre_trace = await h.trace(resp.headers["x-kvplug-prefill-decision-id"])
        assert pre_trace["stage"] == "prefill" and pre_trace["worker_id"] == prefill_id
        assert pre_trace["decision_id"] in trace["related_decisions"]
        h.assert_idle()


async def test_prefill_stage_routes_by_prefix():
    async with serving(PD) as h:
        a = prompt(6, 2)
        await h.complete(a, headers={"x-kvplug-prefill-worker": "p1"})
        for _ in range(3):
            resp, _ = await h.complete(a + prompt(1, 3))
            assert resp.headers["x-kvplug-prefill-worker"] == "p1"
        h.assert_idle()


async def test_dead_prefill_worker_is_retried_on_the_next_one():
    async with serving(PD) as h:
        a = prompt(6, 4)
        await h.complete(a, headers={"x-kvplug-prefill-worker": "p0"})
        await h.engines["p0"].stop()
        resp, raw = await h.complete(a, stream=True)
        assert resp.status == 200, raw
        assert resp.headers["x-kvplug-prefill-worker"] == "p1"
        assert "p0" in h.frontend.fleet.unhealthy
        assert h.board.pulled == 2
        h.assert_idle()


async def test_no_prefill_worker_falls_back_to_a_decode_worker():
    async with serving(PD) as h:
        for wid in ("p0", "p1"):
            await h.engines[wid].stop()
        resp, raw = await h.complete(prompt(3, 5), stream=True)
        assert resp.status == 200, raw
        decode_id = resp.headers["x-kvplug-worker"]
        assert decode_id in ("d0", "d1") and "x-kvplug-prefill-worker" not in resp.headers
        # the decode worker got the client's plain request and served it whole
        assert "kv_transfer_params" not in h.engines[decode_id].requests[-1]["body"]
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["stage"] == "aggregated" and "prefill" in trace["fallback_reason"]
        h.assert_idle()
        async with h.session.get(h.url + "/metrics") as r:
            assert 'kvplug_disaggregated_requests_total{outcome="fallback"} 1.0' in await r.text()


async def test_prefill_errors_4xx_to_the_client_5xx_fall_back():
    async with serving(PD) as h:
        h.engines["p0"].fail = h.engines["p1"].fail = "http400"
        resp, raw = await h.complete(prompt(2, 6), stream=True)
        assert resp.status == 400
        err = json.loads(raw)["error"]
        assert err["code"] == "prefill_rejected" and "refuses" in err["message"]
        assert not h.engines["d0"].requests and not h.engines["d1"].requests
        h.assert_idle()
        h.engines["p0"].fail = h.engines["p1"].fail = "http500"
        resp, raw = await h.complete(prompt(2, 7))
        assert resp.status == 200  # a 5xx prefill falls back to decode-only
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert "HTTP 500" in trace["fallback_reason"]
        assert "x-kvplug-prefill-worker" not in resp.headers
        h.assert_idle()


async def test_decode_stub_refuses_mismatched_transfer():
    """The stub's check is real: a decode hop with params for another request id fails."""
    async with serving(PD) as h:
        d0 = h.engines["d0"]
        params = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_request_id": "other"}
        async with h.session.post(
            d0.url + "/v1/completions",
            json={"model": MODEL, "prompt": [1, 2], "kv_transfer_params": params},
            headers={"X-Request-Id": "mine"},
        ) as r:
            assert r.status == 400
            assert "remote_request_id" in (await r.json())["error"]["message"]


async def test_sglang_style_concurrent_bootstrap():
    async with serving(PD, engine_kind="stub-sglang", stub_options={"pd": "sglang"}) as h:
        resp, raw = await h.complete(prompt(3, 8), stream=True, max_tokens=4)
        assert resp.status == 200, raw
        prefill_id = resp.headers["x-kvplug-prefill-worker"]
        decode_id = resp.headers["x-kvplug-worker"]
        pre = h.engines[prefill_id].requests[-1]["body"]
        dec = h.engines[decode_id].requests[-1]["body"]
        assert pre["bootstrap_room"] == dec["bootstrap_room"]
        assert pre["bootstrap_host"] == "127.0.0.1" and pre["bootstrap_port"] == 8998
        assert pre["stream"] is True  # SGLang sends the same body to both
        assert h.board.pulled == 1
        pre_trace = await h.trace(resp.headers["x-kvplug-prefill-decision-id"])
        assert pre_trace["outcome"] == "ok" and pre_trace["status"] == 200
        h.assert_idle()


async def test_a_failing_adapter_transform_falls_back():
    from kvplug.adapters import register_adapter, unregister_adapter
    from kvplug.frontend.stub_engine import StubAdapter

    class NoParams(StubAdapter):
        kind = "no-params"

        def decode_request(self, body, prefill_response, ctx):
            raise ValueError("prefill answer has no kv_transfer_params")

    register_adapter("no-params", NoParams)
    try:
        async with serving(PD, engine_kind="no-params") as h:
            resp, raw = await h.complete(prompt(2, 9), stream=True)
            assert resp.status == 200, raw
            trace = await h.trace(resp.headers["x-kvplug-decision-id"])
            assert trace["stage"] == "aggregated"
            assert trace["fallback_reason"] == (
                "ValueError: prefill answer has no kv_transfer_params"
            )
            h.assert_idle()
    finally:
        unregister_adapter("no-params")


async def test_a_both_role_worker_decodes_its_own_prefill_only_as_a_last_resort():
    workers = [
        {"id": "p0", "role": "prefill"},
        {"id": "x", "role": "both"},
        {"id": "d0", "role": "decode"},
    ]
    async with serving(workers) as h:
        a = prompt(6, 11)
        for _ in range(4):  # x prefills (pinned); the decode goes elsewhere, though x ties
            resp, raw = await h.complete(a, headers={"x-kvplug-prefill-worker": "x"})
            assert resp.status == 200, raw
            assert resp.headers["x-kvplug-prefill-worker"] == "x"
            assert resp.headers["x-kvplug-worker"] == "d0"
        await h.engines["d0"].stop()  # now only x can decode
        resp, raw = await h.complete(a, headers={"x-kvplug-prefill-worker": "x"})
        assert resp.status == 200, raw
        assert resp.headers["x-kvplug-worker"] == "x"
        assert h.board.pulled == 5
        h.assert_idle()


async def test_multi_rank_prefill_and_decode_workers_are_told_their_rank():
    """Both hops name the rank kvplug chose behind a multi-rank worker's URL
    (``X-Data-Parallel-Rank``, as for an aggregated request), each its own worker's."""
    workers = [
        {"id": "p0", "role": "prefill", "dp_size": 2},
        {"id": "d0", "role": "decode", "dp_start": 2, "dp_size": 2},
    ]
    async with serving(workers) as h:
        for i in range(4):
            resp, raw = await h.complete(prompt(5 + i, 1), max_tokens=3)
            assert resp.status == 200, raw
            pre_trace = await h.trace(resp.headers["x-kvplug-prefill-decision-id"])
            pre = h.engines["p0"].requests[-1]["headers"]
            assert pre.getall("X-Data-Parallel-Rank") == [str(pre_trace["dp_rank"])]
            dec = h.engines["d0"].requests[-1]["headers"]
            assert dec.getall("X-Data-Parallel-Rank") == [
                str(int(resp.headers["x-kvplug-dp-rank"]) - 2)
            ]
        h.assert_idle()
