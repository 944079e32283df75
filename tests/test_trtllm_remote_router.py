"""``kvplug serve`` as TRT-LLM's ``remote_http`` router (``trtllm-serve disaggregated`` with
``router: {type: remote_http, args: {remote_url: ...}}``).

Requests are sent the way upstream's ``RemoteHttpRouter.get_next_server`` sends them
(NVIDIA/TensorRT-LLM ``tensorrt_llm/serve/router.py``, the version with ``RemoteHttpRouter``):
``session.post(f"{remote_url}/get_next_server", json=payload)`` where ``payload`` is
``request.model_dump(exclude_none=True)`` plus ``exclude_server``; the payloads below are that
dump of ``CompletionRequest`` / ``DisaggregatedParams`` as declared in
``tensorrt_llm/serve/openai_protocol.py`` at 0076e9390e1ed11515f149eec356f5a03f4a00d8 (field
order and defaults). Answers are read as upstream reads them: ``body["server"]``,
``body.get("matched_blocks", 0)``, ``body.get("route_hint")``, and the worker URL the
orchestrator then posts to is ``f"http://{server}/v1/completions"``."""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
import pytest
from test_frontend_harness import MODEL, eventually, prompt, serving

from kvplug.frontend.app import ServeSettings

pytestmark = pytest.mark.timeout(60)

# a placement's booking outlives any test unless the test is about its end: the 1 s default
# could run out between a placement and the check of its load on a slow machine
LONG_BOOKING = ServeSettings(health_interval=0.2, health_timeout=5.0, trtllm_booking_seconds=600)
PD = [
    {"id": "p0", "role": "prefill"},
    {"id": "p1", "role": "prefill"},
    {"id": "d0", "role": "decode"},
    {"id": "d1", "role": "decode"},
]


def disagg_params_dump(request_type: str, **set_fields: Any) -> dict[str, Any]:
    """``DisaggregatedParams(...).model_dump(exclude_none=True)``: declared order, Nones out."""
    order = (
        "first_gen_tokens",
        "first_gen_log_probs",
        "first_gen_logits",
        "ctx_request_id",
        "encoded_opaque_state",
        "draft_tokens",
        "disagg_request_id",
        "ctx_dp_rank",
        "ctx_info_endpoint",
        "schedule_style",
        "ctx_usage",
    )
    out: dict[str, Any] = {"request_type": request_type}
    out.update({k: set_fields[k] for k in order if set_fields.get(k) is not None})
    out["return_prompt_token_ids_b64"] = set_fields.get("return_prompt_token_ids_b64", False)
    return out


def completion_dump(
    prompt_value: Any, max_tokens: int | None = None, disaggregated_params: dict | None = None
) -> dict[str, Any]:
    """``CompletionRequest(model, prompt, max_tokens, disaggregated_params)
    .model_dump(exclude_none=True)``: every non-None default, in declaration order."""
    out: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt_value,
        "echo": False,
        "frequency_penalty": 0.0,
    }
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    out.update(
        {
            "n": 1,
            "presence_penalty": 0.0,
            "stop": [],
            "stream": False,
            "prompt_ignore_length": 0,
            "use_beam_search": False,
            "top_k": 0,
            "top_p_min": 0.0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "stop_token_ids": [],
            "include_stop_str_in_output": False,
            "ignore_eos": False,
            "min_tokens": 0,
            "skip_special_tokens": True,
            "spaces_between_special_tokens": True,
            "return_context_logits": False,
            "detokenize": True,
            "add_special_tokens": True,
        }
    )
    if disaggregated_params is not None:
        out["disaggregated_params"] = disaggregated_params
    return out


async def get_next_server(
    session: aiohttp.ClientSession, remote_url: str, payload: dict, exclude_server=None
) -> tuple[str, int, dict | None]:
    """Upstream's RemoteHttpRouter.get_next_server, request and answer handling."""
    payload = dict(payload)
    if exclude_server is not None:
        payload["exclude_server"] = exclude_server
    async with session.post(f"{remote_url.rstrip('/')}/get_next_server", json=payload) as resp:
        if resp.status != 200:
            raise ValueError(f"remote router returned {resp.status}: {await resp.text()}")
        body = await resp.json()
    return body["server"], body.get("matched_blocks", 0), body.get("route_hint")


def posted_url(server: str) -> str:
    """Where the orchestrator then sends the request (openai_client._send_request)."""
    return f"http://{server}/v1/completions"


def engine_of(h, server: str) -> str:
    for wid, engine in h.engines.items():
        if posted_url(server) == engine.url + "/v1/completions":
            return wid
    raise AssertionError(f"{server!r} is no engine's host:port: {h.engines}")


async def test_context_router_follows_the_cached_prefix_and_honours_exclude_server():
    async with serving(PD) as h:
        cached = prompt(6, 2)
        # p1 holds the prefix: an ordinary request through kvplug pinned there
        resp, raw = await h.complete(cached, headers={"x-kvplug-prefill-worker": "p1"})
        assert resp.status == 200, raw
        remote = h.url + "/trtllm/context"
        ctx = completion_dump(
            cached + prompt(1, 3),
            max_tokens=1,
            disaggregated_params=disagg_params_dump("context_only"),
        )
        for _ in range(3):
            server, matched, hint = await get_next_server(h.session, remote, ctx)
            assert engine_of(h, server) == "p1"
            assert matched == 6  # whole blocks of the prompt p1 holds
            assert hint is None  # one DP rank: no per-rank hint (upstream's legacy answer)
        # the orchestrator retries elsewhere: p1 is excluded by its TRT-LLM name
        p1_name = server
        server, matched, _ = await get_next_server(h.session, remote, ctx, exclude_server=p1_name)
        assert engine_of(h, server) == "p0" and matched == 0
        # the scheme-qualified spelling of the same server is excluded too
        server, _, _ = await get_next_server(
            h.session, remote, ctx, exclude_server=f"http://{p1_name}/"
        )
        assert engine_of(h, server) == "p0"


async def test_generation_router_answers_only_generation_servers():
    async with serving(PD) as h:
        remote = h.url + "/trtllm/generation"
        ids = prompt(3, 4)
        gen = completion_dump(
            ids,
            max_tokens=8,
            disaggregated_params=disagg_params_dump(
                "generation_only",
                first_gen_tokens=[7],
                ctx_request_id=1234,
                encoded_opaque_state="b3BhcXVl",
                disagg_request_id=99,
                ctx_dp_rank=0,
            ),
        )
        # conditional disaggregation: the context phase was skipped, no disaggregated_params
        bypass = completion_dump(ids, max_tokens=8)
        seen = set()
        for payload in (gen, bypass, gen, bypass):
            server, _, hint = await get_next_server(h.session, remote, payload)
            seen.add(engine_of(h, server))
            assert hint is None
        assert seen <= {"d0", "d1"}


async def test_booked_load_spreads_a_burst_and_is_released_after_the_booking_time():
    # 2 s: the four placements below must all fall within the first one's booking
    settings = ServeSettings(health_interval=0.2, health_timeout=5.0, trtllm_booking_seconds=2.0)
    async with serving(PD, settings=settings) as h:
        remote = h.url + "/trtllm/context"
        chosen = []
        t0 = time.monotonic()
        for seed in range(4):  # nothing cached anywhere: load decides
            ctx = completion_dump(prompt(4, 10 + seed), 1, disagg_params_dump("context_only"))
            server, matched, _ = await get_next_server(h.session, remote, ctx)
            chosen.append(engine_of(h, server))
            assert matched == 0
        assert sorted(chosen) == ["p0", "p0", "p1", "p1"], chosen
        assert h.router.stats()["active_requests"] == 4
        await eventually(lambda: h.router.stats()["active_requests"] == 0)
        assert time.monotonic() - t0 >= 1.9  # released by the booking's timer, not before
        h.assert_idle()


async def test_chat_request_routes_on_its_prompt_token_ids():
    async with serving(PD) as h:
        cached = prompt(5, 6)
        resp, raw = await h.complete(cached, headers={"x-kvplug-prefill-worker": "p0"})
        assert resp.status == 200, raw
        chat = {
            "messages": [{"role": "user", "content": "hi"}],
            "model": MODEL,
            "prompt_token_ids": cached + [1, 2, 3],
            "disaggregated_params": disagg_params_dump("context_only"),
        }
        server, matched, _ = await get_next_server(h.session, h.url + "/trtllm/context", chat)
        assert engine_of(h, server) == "p0" and matched == 5


async def test_route_hint_names_the_dp_rank_of_a_multi_rank_worker():
    workers = [
        {"id": "p0", "role": "prefill", "dp_size": 2},
        {"id": "d0", "role": "decode"},
    ]
    async with serving(workers) as h:
        ctx = completion_dump(prompt(2, 7), 1, disagg_params_dump("context_only"))
        server, _, hint = await get_next_server(h.session, h.url + "/trtllm/context", ctx)
        assert engine_of(h, server) == "p0"
        assert hint is not None and hint["dp_rank"] in (0, 1)
        # an aggregated request gets no hint: upstream would turn it into context_only
        server, _, hint = await get_next_server(
            h.session, h.url + "/trtllm/context", completion_dump(prompt(2, 7), 1)
        )
        assert hint is None


@pytest.mark.parametrize(
    "path,raw,status,code",
    [
        ("/trtllm/context/get_next_server", b"{not json", 400, "invalid_json"),
        ("/trtllm/context/get_next_server", b"[1, 2]", 400, "invalid_json"),
        (
            "/trtllm/context/get_next_server",
            json.dumps({"model": MODEL, "prompt": [1, 2], "exclude_server": 5}).encode(),
            400,
            "invalid_request",
        ),
        (
            "/get_next_server",
            json.dumps(
                {"model": MODEL, "prompt": [1], "disaggregated_params": {"request_type": "x"}}
            ).encode(),
            400,
            "invalid_request",
        ),
        (
            "/get_next_server",
            json.dumps({"model": MODEL, "prompt": [-1]}).encode(),
            400,
            "invalid_prompt",
        ),
        ("/trtllm/encoder/get_next_server", b"{}", 404, "not_found"),
    ],
)
async def test_bad_requests_get_a_clear_4xx(path, raw, status, code):
    async with serving(PD) as h:
        resp, body = await h.post(path, None, {"Content-Type": "application/json"}, raw=raw)
        assert resp.status == status, body
        err = json.loads(body)["error"]
        assert err["code"] == code, err
        h.assert_idle()


async def test_no_worker_left_is_503_which_upstream_raises_as_valueerror():
    async with serving([{"id": "p0", "role": "prefill"}, {"id": "d0", "role": "decode"}]) as h:
        remote = h.url + "/trtllm/context"
        ctx = completion_dump(prompt(1, 8), 1, disagg_params_dump("context_only"))
        server, _, _ = await get_next_server(h.session, remote, ctx)
        with pytest.raises(ValueError, match="remote router returned 503"):
            await get_next_server(h.session, remote, ctx, exclude_server=server)


async def test_finish_request_releases_a_placement_once():
    async with serving(PD, settings=LONG_BOOKING) as h:
        ctx = completion_dump(prompt(2, 11), 1, disagg_params_dump("context_only"))
        async with h.session.post(h.url + "/trtllm/context/get_next_server", json=ctx) as resp:
            placement = (await resp.json())["request_id"]
        assert h.router.stats()["active_requests"] == 1
        for released in (True, False):  # the second report finds nothing left to release
            resp, raw = await h.post("/trtllm/finish_request", {"request_id": placement})
            assert resp.status == 200 and json.loads(raw) == {"released": released}
            h.assert_idle()
        resp, raw = await h.post("/trtllm/finish_request", {"request_id": 5})
        assert resp.status == 400 and json.loads(raw)["error"]["param"] == "request_id"
