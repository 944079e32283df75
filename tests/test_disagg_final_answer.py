"""A prefill answer that already is the whole answer (a stop on its one token) goes to the
client as it is, with no decode stage: vLLM-style stub engines (a prefill that stopped hands
off no ``kv_transfer_params``) and fake TRT-LLM context/generation servers (a context answer
whose ``finish_reason`` is not ``length``/``not_finished``), over real HTTP, for streaming and
non-streaming clients of completions and chat. The router's load must be back to zero."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
from aiohttp import web
from test_frontend_harness import MODEL, Harness, prompt, serving

from kvplug.adapters import PDContext, TrtllmHttpAdapter, VllmHttpAdapter
from kvplug.config import RouterConfig
from kvplug.disagg import final_answer_chunks, final_answer_sse
from kvplug.frontend.app import ServeSettings
from kvplug.frontend.config import spec_from_mapping
from kvplug.frontend.server import start_frontend
from kvplug.router import Router
from kvplug.workers import Role, Worker

pytestmark = pytest.mark.timeout(60)

PD = [
    {"id": "p0", "role": "prefill"},
    {"id": "p1", "role": "prefill"},
    {"id": "d0", "role": "decode"},
    {"id": "d1", "role": "decode"},
]
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
CTX_ANSWER = json.loads(
    (Path(__file__).parent / "data" / "trtllm" / "context_response.json").read_bytes()
)


def sse_chunks(raw: bytes) -> list[dict]:
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    return [json.loads(e[6:]) for e in events[:-1]]


def streamed_text(chunks: list[dict], chat: bool) -> str:
    key = "delta" if chat else None
    parts = []
    for c in chunks:
        for choice in c["choices"]:
            parts.append((choice[key].get("content") or "") if key else choice["text"])
    return "".join(parts)


def last_finish(chunks: list[dict]) -> str | None:
    reasons = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    return reasons[-1] if reasons else None


async def ask(h: Harness, path: str, stream: bool, **extra):
    body = {"model": MODEL, "stream": stream, "max_tokens": 5, **extra}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "hello there " * 4}]
    else:
        body["prompt"] = prompt(3, 21)
    return await h.post(path, body)


async def disagg_outcomes(h: Harness) -> str:
    async with h.session.get(h.url + "/metrics") as r:
        text = await r.text()
    return "\n".join(line for line in text.splitlines() if "disaggregated_requests_total{" in line)


# -- vLLM style (stub engines) ----------------------------------------------------------------


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True])
async def test_vllm_prefill_that_stopped_is_the_answer(path, stream):
    async with serving(PD) as h:
        for wid in ("p0", "p1"):
            h.engines[wid].eos_at = 1  # EOS is the first token
        resp, raw = await ask(h, path, stream)
        assert resp.status == 200, raw
        worker = resp.headers["x-kvplug-worker"]
        assert worker in ("p0", "p1") and resp.headers["x-kvplug-prefill-worker"] == worker
        assert resp.headers["x-kvplug-prefill-decision-id"] == resp.headers["x-kvplug-decision-id"]
        # one prefill hop, no decode hop anywhere, nothing left to pull
        assert len(h.engines[worker].requests) == 1
        assert not h.engines["d0"].requests and not h.engines["d1"].requests
        assert h.board.pulled == 0 and not h.board.pending
        chat = path == CHAT
        if stream:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            chunks = sse_chunks(raw)
            assert streamed_text(chunks, chat) == "t0 " and last_finish(chunks) == "stop"
            obj = "chat.completion.chunk" if chat else "text_completion"
            assert {c["object"] for c in chunks} == {obj}
            if chat:
                assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert all("usage" not in c for c in chunks)  # not asked for
        else:
            answer = json.loads(raw)
            # exactly what the prefill engine answered
            assert answer == json.loads(h.engines[worker].sent[resp.headers["X-Request-Id"]])
            choice = answer["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            assert text == "t0 " and choice["finish_reason"] == "stop"
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["stage"] == "prefill" and trace["outcome"] == "answered_by_prefill"
        assert trace["fallback_reason"] is None and trace["output_tokens"] == 1
        assert trace["related_decisions"] == []  # no decode decision was made
        assert 'outcome="answered_by_prefill"} 1.0' in await disagg_outcomes(h)
        h.assert_idle()
        # the next request continues normally: two stages, load back to zero again
        for wid in ("p0", "p1"):
            h.engines[wid].eos_at = None
        resp, raw = await ask(h, path, stream)
        assert resp.status == 200, raw
        assert resp.headers["x-kvplug-worker"] in ("d0", "d1") and h.board.pulled == 1
        h.assert_idle()


async def test_vllm_streamed_final_answer_with_usage():
    async with serving(PD) as h:
        for wid in ("p0", "p1"):
            h.engines[wid].eos_at = 1
        resp, raw = await ask(h, CHAT, True, stream_options={"include_usage": True})
        assert resp.status == 200, raw
        pre = h.engines[resp.headers["x-kvplug-worker"]].requests[0]["body"]
        assert "stream_options" not in pre and pre["stream"] is False
        chunks = sse_chunks(raw)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 1
        assert all("usage" not in c for c in chunks[:-1])
        h.assert_idle()


async def test_vllm_stop_without_the_clients_min_tokens_is_not_final():
    """The prefill hop drops min_tokens; its early stop is not the client's answer."""
    async with serving(PD) as h:
        for wid in ("p0", "p1"):
            h.engines[wid].eos_at = 1
        resp, raw = await ask(h, COMPLETIONS, True, min_tokens=3)
        assert resp.status == 200, raw
        assert resp.headers["x-kvplug-worker"] in ("d0", "d1")  # served whole there
        assert streamed_text(sse_chunks(raw), False) == "t0 t1 t2 t3 t4 "
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["stage"] == "aggregated" and "kv_transfer_params" in trace["fallback_reason"]
        h.assert_idle()


def test_vllm_final_answer_rule():
    adapter = VllmHttpAdapter()
    pd = PDContext("r", COMPLETIONS, Worker("p0", role=Role.PREFILL))
    stop = {"choices": [{"index": 0, "text": "x", "finish_reason": "stop"}]}
    assert adapter.final_answer({}, stop, pd) is stop
    with_params = dict(stop, kv_transfer_params={"do_remote_prefill": True})
    assert adapter.final_answer({}, with_params, pd) is None  # decode runs, blocks freed
    nested = {"choices": [dict(stop["choices"][0], kv_transfer_params={"x": 1})]}
    assert adapter.final_answer({}, nested, pd) is None
    length = {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
    assert adapter.final_answer({}, length, pd) is None
    assert adapter.final_answer({}, {"choices": []}, pd) is None
    assert adapter.final_answer({"min_tokens": 2}, stop, pd) is None
    assert adapter.final_answer({"min_tokens": 1}, stop, pd) is stop


# -- SSE rendering ------------------------------------------------------------------------------


def test_chat_rendering_keeps_every_message_field_and_tool_call_indexes():
    answer = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 7,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "hmm",
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}],
                },
                "logprobs": None,
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
    body = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = final_answer_chunks(answer, body, chat=True)
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 3
    delta = chunks[1]["choices"][0]["delta"]
    assert delta == {
        "reasoning_content": "hmm",
        "tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f"}}],
    }
    assert chunks[1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(c["usage"] == answer["usage"] for c in chunks)  # continuous usage stats
    raw = final_answer_sse(answer, body, chat=True)
    assert [json.loads(e[6:]) for e in raw.decode().split("\n\n")[:-2]] == chunks


# -- TRT-LLM (fake context / generation servers) ------------------------------------------------


class FakeTrtllm:
    """A ``trtllm-serve`` worker's P/D side: a context server answers ``context_only`` requests
    with ``disaggregated_params`` and the given ``finish_reason``; a generation server serves
    ``generation_only`` requests that carry those params back (or a plain request whole)."""

    def __init__(self, role: str, finish: str = "stop") -> None:
        self.role = role
        self.finish = finish
        self.requests: list[tuple[str, dict]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    def _answer(self, path: str, text: str, finish: str, params: dict | None) -> dict:
        answer = copy.deepcopy(CTX_ANSWER)
        choice = answer["choices"][0]
        choice.update(finish_reason=finish, disaggregated_params=params)
        if path == CHAT:
            answer["object"] = "chat.completion"
            del choice["text"]
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return answer

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append((request.path, body))
        if "nvext" in body:
            return web.json_response({"message": "extra fields not permitted"}, status=400)
        params = body.get("disaggregated_params")
        if self.role == "context":
            if params != {"request_type": "context_only"} or body.get("stream"):
                return web.json_response({"message": "context_only, unstreamed"}, status=400)
            ctx_params = copy.deepcopy(CTX_ANSWER["choices"][0]["disaggregated_params"])
            return web.json_response(self._answer(request.path, " the", self.finish, ctx_params))
        if params is not None and params.get("request_type") != "generation_only":
            return web.json_response({"message": f"bad params {params}"}, status=400)
        if body.get("stream"):
            return web.json_response({"message": "this fake streams nothing"}, status=400)
        text = " the quick brown fox" if params else " whole"
        return web.json_response(self._answer(request.path, text, "stop", None))

    async def empty(self, request: web.Request) -> web.Response:
        return web.json_response([])

    async def ok(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post(COMPLETIONS, self.generate)
        app.router.add_post(CHAT, self.generate)
        app.router.add_post("/kv_cache_events", self.empty)
        app.router.add_get("/health", self.ok)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


class TrtllmFleet:
    def __init__(self, finish: str) -> None:
        self.ctx = FakeTrtllm("context", finish)
        self.gen = FakeTrtllm("generation")

    async def __aenter__(self) -> Harness:
        import aiohttp

        await self.ctx.start()
        await self.gen.start()
        specs = [
            spec_from_mapping(
                {"id": "ctx-0", "engine": "trtllm", "url": self.ctx.url, "role": "prefill"}, "ctx"
            ),
            spec_from_mapping(
                {"id": "gen-0", "engine": "trtllm", "url": self.gen.url, "role": "decode"}, "gen"
            ),
        ]
        router = Router(RouterConfig(kv_block_size=32), rng=random.Random(0))
        settings = ServeSettings(health_interval=0.2, health_timeout=5.0)
        self.running = await start_frontend(router, specs, settings, default_engine="trtllm")
        self.session = aiohttp.ClientSession()
        return Harness(router, self.running, {}, self.session, None)  # type: ignore[arg-type]

    async def __aexit__(self, *exc) -> None:
        await self.session.close()
        await self.running.close()
        await self.ctx.stop()
        await self.gen.stop()


def trt_body(path: str, stream: bool, **extra) -> dict:
    body = {"model": "llama", "stream": stream, "max_tokens": 16, **extra}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "The quick brown fox"}]
    else:
        body["prompt"] = "The quick brown fox"
    return body


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True])
async def test_trtllm_final_context_answer_gets_no_generation_hop(path, stream):
    fleet = TrtllmFleet("stop")
    async with fleet as h:
        resp, raw = await h.post(path, trt_body(path, stream))
        assert resp.status == 200, raw
        assert resp.headers["x-kvplug-worker"] == "ctx-0"
        assert resp.headers["x-kvplug-prefill-worker"] == "ctx-0"
        assert len(fleet.ctx.requests) == 1 and fleet.gen.requests == []
        chat = path == CHAT
        if stream:
            chunks = sse_chunks(raw)
            assert streamed_text(chunks, chat) == " the" and last_finish(chunks) == "stop"
            assert all("disaggregated_params" not in ch for c in chunks for ch in c["choices"])
        else:
            answer = json.loads(raw)
            choice = answer["choices"][0]
            assert (choice["message"]["content"] if chat else choice["text"]) == " the"
            assert choice["finish_reason"] == "stop" and "disaggregated_params" not in choice
            assert answer["usage"] == CTX_ANSWER["usage"]
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["stage"] == "prefill" and trace["outcome"] == "answered_by_prefill"
        assert trace["fallback_reason"] is None
        assert 'outcome="answered_by_prefill"} 1.0' in await disagg_outcomes(h)
        h.assert_idle()


async def test_trtllm_unfinished_context_answer_still_gets_its_generation_hop():
    fleet = TrtllmFleet("length")
    async with fleet as h:
        resp, raw = await h.post(COMPLETIONS, trt_body(COMPLETIONS, False))
        assert resp.status == 200, raw
        assert resp.headers["x-kvplug-worker"] == "gen-0"
        assert json.loads(raw)["choices"][0]["text"] == " the quick brown fox"
        assert len(fleet.gen.requests) == 1
        assert fleet.gen.requests[0][1]["disaggregated_params"]["request_type"] == (
            "generation_only"
        )
        assert 'outcome="two_stage"} 1.0' in await disagg_outcomes(h)
        h.assert_idle()


async def test_trtllm_stop_without_the_clients_min_tokens_falls_back():
    fleet = TrtllmFleet("stop")
    async with fleet as h:
        resp, raw = await h.post(COMPLETIONS, trt_body(COMPLETIONS, False, min_tokens=4))
        assert resp.status == 200, raw
        assert fleet.ctx.requests[0][1]["max_tokens"] == 1
        assert "min_tokens" not in fleet.ctx.requests[0][1]
        # served whole by the generation worker, as a plain request
        assert json.loads(raw)["choices"][0]["text"] == " whole"
        assert "disaggregated_params" not in fleet.gen.requests[0][1]
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["stage"] == "aggregated" and "'stop'" in trace["fallback_reason"]
        h.assert_idle()


def test_builtin_trtllm_adapter_follows_the_same_rule():
    adapter = TrtllmHttpAdapter()
    pd = PDContext("r", COMPLETIONS, Worker("ctx-0", role=Role.PREFILL))
    final = copy.deepcopy(CTX_ANSWER)
    final["choices"][0]["finish_reason"] = "stop"
    out = adapter.final_answer({}, final, pd)
    assert out is not None and "disaggregated_params" not in out["choices"][0]
    assert "disaggregated_params" in final["choices"][0]  # input untouched
    assert adapter.final_answer({}, CTX_ANSWER, pd) is None
    assert adapter.final_answer({"min_tokens": 3}, final, pd) is None
    with pytest.raises(ValueError, match="min_tokens"):
        adapter.decode_request({"min_tokens": 3}, final, pd)
