"""``router: {type: kvplug}`` as the generation router of TRT-LLM's conditional disaggregation,
and with the coordinator-era router interface (``req_id``).

TensorRT-LLM cannot be installed here (PyPI's ``tensorrt-llm`` is an sdist that downloads its
wheel from NVIDIA's own index at install time), so upstream's modules are stood in for:

* ``CoordinatorEraRouterModule``: kvplug-made, to the interface of
  ``tensorrt_llm/serve/router.py`` in the form with the disagg coordinator (the search index's
  file id 54957247436; the index does not report its commit): ``Router(server_role, servers,
  metadata_server_cfg, metadata_server, server_preparation_func=None, **kwargs)``,
  ``get_next_server(request, exclude_server=None, req_id=None)``, ``finish_request(request,
  session=None, success=True, req_id=None)``, a ``KvCacheAwareRouter`` ABC subclass with
  ``get_next_server_by_key``, ``CoordinatorDelegatingRouter`` (``_local``) and
  ``create_router``'s four types.
* The conditional-disaggregation checks, rewritten from upstream's (not copied; same gate,
  same call, same keys, same decision), one per form read:
  ``coordinator_form_check``: ``OpenAIDisaggregatedService._check_conditional_disagg(request,
  req_id)`` of ``openai_disagg_service.py`` (index file id 60331329338, commit not reported):
  ``TypeError`` unless the (unwrapped) generation router is a ``KvCacheAwareRouter``, then
  ``get_next_server(request, req_id=req_id)``, ``info["match_length"]``, ``info["num_tokens"]``.
  ``service_form_check``: the same method at 00bb903d965ffe9710a457d5848065d7d1b8f60a and
  319f5114a2744b322286be6be2721f782e7eee8a: ``assert isinstance(gen_router,
  KvCacheAwareRouter)``, ``get_next_server(request)``, ``sum(info["matches"])``,
  ``sum(len(t) for t in info["token_lists"])``. ``server_start_gate``: the older
  ``openai_disagg_server.py``'s ``ValueError`` at start (index file ids 2626628095,
  922016668), whose per-request check is the service form's.
  All decide ``need_ctx = match == 0 or total - match > max_local_prefill_length``.
* ``coordinator_client_delegates``: ``CoordinatorClient._maybe_delegate``'s test
  (``disagg_coordinator.py``, index file id 56147781372): a router with
  ``get_next_server_by_key`` is wrapped and its placements go to TRT-LLM's coordinator.

kvplug serve and its engines are real (stub engines on loopback)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

import pytest
from kvplug.integrations.trtllm import hook
from test_frontend_harness import MODEL, prompt, serving
from test_trtllm_hook import STANDIN, _forget_trtllm

from kvplug.frontend.app import ServeSettings

COORDINATOR_ERA = Path(__file__).parent / "data" / "trtllm" / "coordinator_era_router.py"
BS = 16  # the harness's block size

pytestmark = pytest.mark.timeout(60)

PD = [
    {"id": "p0", "role": "prefill"},
    {"id": "d0", "role": "decode"},
    {"id": "d1", "role": "decode"},
]
# a placement's booking outlives any test: its release is finish_request's doing
LONG_BOOKING = ServeSettings(health_interval=0.2, health_timeout=5.0, trtllm_booking_seconds=600)


@pytest.fixture
def upstream(monkeypatch):
    """(patched coordinator-era router module, disagg_utils, openai_protocol)."""
    monkeypatch.syspath_prepend(str(STANDIN))
    _forget_trtllm()
    utils = importlib.import_module("tensorrt_llm.llmapi.disagg_utils")
    proto = importlib.import_module("tensorrt_llm.serve.openai_protocol")
    spec = importlib.util.spec_from_file_location("tensorrt_llm.serve.router", COORDINATOR_ERA)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert hook.patch(module)
    yield module, utils, proto
    _forget_trtllm()


# -- the upstream checks, rewritten ----------------------------------------------------------


async def coordinator_form_check(service_gen_router, router_module, request, req_id, limit):
    local = (
        service_gen_router._local
        if isinstance(service_gen_router, router_module.CoordinatorDelegatingRouter)
        else service_gen_router
    )
    if not isinstance(local, router_module.KvCacheAwareRouter):
        raise TypeError("conditional disaggregation requires a KV-cache-aware generation router")
    server, info = await service_gen_router.get_next_server(request, req_id=req_id)
    match, total = info["match_length"], info["num_tokens"]
    return server, match == 0 or total - match > limit


async def service_form_check(gen_router, router_module, request, limit):
    assert isinstance(gen_router, router_module.KvCacheAwareRouter)
    server, info = await gen_router.get_next_server(request)
    match = sum(info["matches"])
    total = sum(len(token_list) for token_list in info["token_lists"])
    return server, match == 0 or total - match > limit


def server_start_gate(gen_router, router_module) -> None:
    if not isinstance(gen_router, router_module.KvCacheAwareRouter):
        raise ValueError(
            "Generation router must be a KvCacheAwareRouter to enable conditional disaggregation"
        )


def coordinator_client_delegates(local_router) -> bool:
    return hasattr(local_router, "get_next_server_by_key")


def _router(module, utils, role, url):
    config = utils.RouterConfig(type="kvplug", args={"url": url}, server_role=role)
    return module.create_router(config, [], None, None, None, 0)


def _engine_of(h, server: str) -> str:
    return next(wid for wid, e in h.engines.items() if e.url == f"http://{server}")


async def _cache_on_a_decode_worker(h, ids: list[int]) -> str:
    """An ordinary disaggregated request through kvplug: the decode stub that serves it
    holds the prompt's blocks afterwards."""
    resp, raw = await h.complete(ids)
    assert resp.status == 200, raw
    h.assert_idle()
    return resp.headers["x-kvplug-worker"]


# -- tests -----------------------------------------------------------------------------------


async def test_kvplug_router_takes_the_coordinator_era_req_id_and_is_never_delegated(upstream):
    module, utils, proto = upstream
    async with serving(PD, settings=LONG_BOOKING) as h:
        cached = prompt(6, 2)
        resp, raw = await h.complete(cached)
        assert resp.status == 200, raw
        ctx = _router(module, utils, utils.ServerRole.CONTEXT, h.url)
        try:
            assert type(ctx).__name__ == "KvplugRouter" and isinstance(ctx, module.Router)
            # TRT-LLM's CoordinatorClient would hand a router with get_next_server_by_key to
            # its own coordinator; kvplug's places through kvplug serve in every process
            assert coordinator_client_delegates(module.KvCacheAwareRouter)
            assert not coordinator_client_delegates(ctx)
            request = proto.CompletionRequest(
                model=MODEL,
                prompt=cached + prompt(1, 9),
                max_tokens=1,
                disaggregated_params=proto.DisaggregatedParams(request_type="context_only"),
            )
            server, info = await ctx.get_next_server(request, exclude_server=None, req_id=4242)
            assert _engine_of(h, server) == "p0" and info["matched_blocks"] == 6
            assert h.router.stats()["active_requests"] == 1
            await ctx.finish_request(request, session=None, success=True, req_id=4242)
            h.assert_idle()  # released at once, not after the booking time
        finally:
            await ctx.close()


async def test_kvplug_generation_router_answers_the_coordinator_forms_check(upstream):
    module, utils, proto = upstream
    async with serving(PD, settings=LONG_BOOKING) as h:
        first = prompt(6, 3)
        holder = await _cache_on_a_decode_worker(h, first)
        gen = _router(module, utils, utils.ServerRole.GENERATION, h.url)
        try:
            follow_up = proto.CompletionRequest(model=MODEL, prompt=first + prompt(1, 4))
            # 7 blocks asked, the 6 cached on `holder`: 16 tokens to prefill locally
            server, need_ctx = await coordinator_form_check(gen, module, follow_up, 1, limit=32)
            assert _engine_of(h, server) == holder and need_ctx is False
            await gen.finish_request(follow_up, req_id=1)
            server, need_ctx = await coordinator_form_check(gen, module, follow_up, 2, limit=8)
            assert need_ctx is True  # 16 > 8: the context phase runs
            await gen.finish_request(follow_up, req_id=2)
            fresh = proto.CompletionRequest(model=MODEL, prompt=prompt(2, 5))
            _, need_ctx = await coordinator_form_check(gen, module, fresh, 3, limit=10**6)
            assert need_ctx is True  # nothing cached anywhere
            await gen.finish_request(fresh, req_id=3)
            # a client request carrying upstream's synthetic context_only params (a
            # conversation id): scored as the whole request on a generation server
            tagged = proto.CompletionRequest(
                model=MODEL,
                prompt=first + prompt(1, 4),
                disaggregated_params=proto.DisaggregatedParams(request_type="context_only"),
            )
            server, need_ctx = await coordinator_form_check(gen, module, tagged, 4, limit=32)
            assert _engine_of(h, server) == holder and need_ctx is False
            await gen.finish_request(tagged, req_id=4)
            h.assert_idle()
            # the gate is real: TRT-LLM's own round-robin router fails it
            rr = module.create_router(utils.RouterConfig(type="round_robin"), ["a:1"])
            with pytest.raises(TypeError, match="KV-cache-aware"):
                await coordinator_form_check(rr, module, follow_up, 5, limit=32)
        finally:
            await gen.close()


async def test_kvplug_generation_router_answers_the_older_forms_check(upstream):
    module, utils, proto = upstream
    async with serving(PD, settings=LONG_BOOKING) as h:
        first = prompt(5, 6)
        holder = await _cache_on_a_decode_worker(h, first)
        gen = _router(module, utils, utils.ServerRole.GENERATION, h.url)
        try:
            server_start_gate(gen, module)  # the older server's start-time ValueError
            follow_up = proto.CompletionRequest(model=MODEL, prompt=first + prompt(2, 7))
            server, need_ctx = await service_form_check(gen, module, follow_up, limit=32)
            assert _engine_of(h, server) == holder and need_ctx is False  # 32 ≤ 32
            await gen.finish_request(follow_up)
            _, need_ctx = await service_form_check(gen, module, follow_up, limit=31)
            assert need_ctx is True
            await gen.finish_request(follow_up)
            h.assert_idle()
            rr = module.create_router(utils.RouterConfig(type="round_robin"), ["a:1"])
            with pytest.raises(ValueError, match="KvCacheAwareRouter"):
                server_start_gate(rr, module)
        finally:
            await gen.close()


async def test_only_a_generation_router_asked_before_prefill_fetches_the_prompt_tokens(upstream):
    module, utils, proto = upstream
    async with serving(PD, settings=LONG_BOOKING) as h:
        ids = prompt(3, 8)
        gen = _router(module, utils, utils.ServerRole.GENERATION, h.url)
        ctx = _router(module, utils, utils.ServerRole.CONTEXT, h.url)
        try:
            client = proto.CompletionRequest(model=MODEL, prompt=ids)
            _, info = await gen.get_next_server(client)
            assert info["token_lists"] == [ids] and info["num_tokens"] == len(ids)
            assert info["match_length"] == 0 and info["matches"] == [0]
            await gen.finish_request(client)
            # the generation hop proper (after a context server) and the context router:
            # counts only, no tokens sent back
            hop = proto.CompletionRequest(
                model=MODEL,
                prompt=ids,
                disaggregated_params=proto.DisaggregatedParams(
                    request_type="generation_only", ctx_request_id=5, encoded_opaque_state="x"
                ),
            )
            _, info = await gen.get_next_server(hop)
            assert info["token_lists"] == [] and info["num_tokens"] == len(ids)
            await gen.finish_request(hop)
            ctx_request = proto.CompletionRequest(
                model=MODEL,
                prompt=ids,
                disaggregated_params=proto.DisaggregatedParams(request_type="context_only"),
            )
            _, info = await ctx.get_next_server(ctx_request)
            assert info["token_lists"] == [] and info["num_tokens"] == len(ids)
            await ctx.finish_request(ctx_request)
            h.assert_idle()
        finally:
            await gen.close()
            await ctx.close()


async def test_kvplug_serve_states_the_prefix_match_in_tokens():
    """The fields kvplug serve adds to upstream's answer, as the hook reads them."""
    async with serving(PD, settings=LONG_BOOKING) as h:
        first = prompt(4, 11)
        holder = await _cache_on_a_decode_worker(h, first)
        body: dict[str, Any] = {"model": MODEL, "prompt": first + prompt(1, 12), "max_tokens": 4}
        url = h.url + "/trtllm/generation/get_next_server"
        async with h.session.post(url, json=body, params={"token_ids": "1"}) as resp:
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
        assert answer["worker_id"] == holder
        assert answer["matched_blocks"] == 4 and answer["matched_tokens"] == 4 * BS
        assert answer["num_tokens"] == 5 * BS and answer["token_ids"] == body["prompt"]
        async with h.session.post(url, json=body) as resp:
            plain = await resp.json()
        assert "token_ids" not in plain and plain["num_tokens"] == 5 * BS
        # a context-only request on the generation path is the whole request there; on the
        # context path it stays a prefill (kvplug's decode workers cannot take it)
        tagged = {**body, "disaggregated_params": {"request_type": "context_only"}}
        async with h.session.post(url, json=tagged) as resp:
            assert resp.status == 200, await resp.text()
            on_generation = await resp.json()
        assert on_generation["worker_id"] == holder
        ctx_url = h.url + "/trtllm/context/get_next_server"
        async with h.session.post(ctx_url, json=tagged) as resp:
            assert resp.status == 200, await resp.text()
            on_context = await resp.json()
        assert on_context["worker_id"] == "p0"
        for placement in (answer, plain, on_generation, on_context):
            async with h.session.post(
                h.url + "/trtllm/finish_request", json={"request_id": placement["request_id"]}
            ) as resp:
                assert (await resp.json())["released"] is True
        h.assert_idle()


def test_a_router_module_without_kv_cache_aware_router_still_gets_the_kvplug_type(
    monkeypatch, caplog
):
    """The 00895e31 stand-in has no ``KvCacheAwareRouter``: the type works, the
    conditional-disaggregation gate is simply not passed (and said so)."""
    monkeypatch.syspath_prepend(str(STANDIN))
    _forget_trtllm()
    try:
        module = importlib.import_module("tensorrt_llm.serve.router")
        assert not hasattr(module, "KvCacheAwareRouter")
        with caplog.at_level("INFO", logger="kvplug.trtllm.hook"):
            assert hook.patch(module)
        assert hasattr(module, "KvplugRouter")
        assert "conditional disaggregation" in caplog.text
    finally:
        _forget_trtllm()
