"""End to end: ``kvplug serve`` (a real process) in front of a TRT-LLM context worker and a
generation worker (fake ``trtllm-serve`` endpoints built from TRT-LLM's documented protocol:
request models that forbid unknown fields, context-only answers with
``disaggregated_params`` and ``prompt_token_ids``, generation-only requests that must carry
them back verbatim)."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web

from kvplug.testing import free_ports, serve_command, stop_process, wait_ready_async

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data" / "trtllm"
CTX_ANSWER = json.loads((DATA / "context_response.json").read_bytes())

# CompletionRequest / DisaggregatedParams fields of trtllm-serve 1.2 (extra="forbid")
COMPLETION_FIELDS = {
    "model",
    "prompt",
    "best_of",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "suffix",
    "temperature",
    "top_p",
    "user",
    "lora_request",
    "prompt_ignore_length",
    "use_beam_search",
    "top_k",
    "top_p_min",
    "min_p",
    "repetition_penalty",
    "length_penalty",
    "early_stopping",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "return_context_logits",
    "detokenize",
    "add_special_tokens",
    "response_format",
    "disaggregated_params",
}
DISAGG_FIELDS = {
    "request_type",
    "first_gen_tokens",
    "ctx_request_id",
    "encoded_opaque_state",
    "draft_tokens",
    "disagg_request_id",
    "ctx_dp_rank",
    "ctx_info_endpoint",
    "schedule_style",
}


class FakeTrtllmServe:
    def __init__(self, role: str) -> None:
        self.role = role
        self.final_next = False
        self.requests: list[dict] = []
        self.runner = None
        self.url = ""

    def _invalid(self, body: dict) -> str | None:
        extra = set(body) - COMPLETION_FIELDS
        if extra:
            return f"extra fields not permitted: {sorted(extra)}"
        params = body.get("disaggregated_params")
        if params is not None and set(params) - DISAGG_FIELDS:
            return f"extra disaggregated_params fields: {sorted(set(params) - DISAGG_FIELDS)}"
        return None

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        why = self._invalid(body)
        if why:
            return web.json_response(
                {"object": "error", "message": why, "type": "BadRequest", "code": 400}, status=400
            )
        params = body.get("disaggregated_params") or {}
        if self.role == "context":
            if params.get("request_type") != "context_only" or body.get("stream"):
                return web.json_response(
                    {"message": "context server: context_only, stream=false expected", "code": 400},
                    status=400,
                )
            answer = copy.deepcopy(CTX_ANSWER)
            if self.final_next:  # EOS as the first token: the context answer is complete
                self.final_next = False
                answer["choices"][0]["finish_reason"] = "stop"
            return web.json_response(answer)
        if not params:  # a plain (context_and_generation) request: served whole
            answer = copy.deepcopy(CTX_ANSWER)
            answer["choices"][0].update(
                text=" whole", finish_reason="stop", disaggregated_params=None
            )
            return web.json_response(answer)
        ctx_params = CTX_ANSWER["choices"][0]["disaggregated_params"]
        if params != {**ctx_params, "request_type": "generation_only"}:
            return web.json_response({"message": f"bad params {params}", "code": 400}, status=400)
        if body.get("prompt") != CTX_ANSWER["prompt_token_ids"]:
            return web.json_response(
                {"message": "prompt is not the context's token ids", "code": 400}, status=400
            )
        if body.get("stream"):  # trtllm-serve's SSE: one chunk per piece, then [DONE]
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i, piece in enumerate([" the", " quick", " brown", " fox"]):
                chunk = {
                    "id": "cmpl-gen",
                    "object": "text_completion",
                    "model": "llama",
                    "choices": [
                        {"index": 0, "text": piece, "finish_reason": "stop" if i == 3 else None}
                    ],
                }
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        answer = copy.deepcopy(CTX_ANSWER)
        answer["choices"][0].update(
            text=" the quick brown fox", finish_reason="stop", disaggregated_params=None
        )
        answer.pop("prompt_token_ids")
        return web.json_response(answer)

    async def kv_cache_events(self, request: web.Request) -> web.Response:
        return web.json_response([])

    async def ok(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": "llama", "object": "model", "owned_by": "tensorrt_llm"}],
            }
        )

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/kv_cache_events", self.kv_cache_events)
        app.router.add_get("/health", self.ok)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        await self.runner.cleanup()


@pytest.mark.timeout(120)
async def test_disaggregated_request_through_kvplug_serve(tmp_path):
    ctx, gen = FakeTrtllmServe("context"), FakeTrtllmServe("generation")
    await ctx.start()
    await gen.start()
    config = tmp_path / "workers.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "workers": [
                    {"id": "ctx-0", "engine": "trtllm", "url": ctx.url, "role": "prefill"},
                    {"id": "gen-0", "engine": "trtllm", "url": gen.url, "role": "decode"},
                ]
            }
        )
    )
    port, admin_port = free_ports(2)
    log = tmp_path / "log"
    proc = subprocess.Popen(
        serve_command(
            port, "--worker-config", str(config), "--kv-block-size", "32", admin_port=admin_port
        ),
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=subprocess.DEVNULL,
        stderr=open(log, "w"),
    )
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_ready_async(base + "/health", proc=proc, timeout=90, interval=0.1, log=log)
        async with aiohttp.ClientSession() as session:
            body = {
                "model": "llama",
                "prompt": "The quick brown fox",
                "max_tokens": 16,
                "temperature": 0.0,
            }
            async with session.post(base + "/v1/completions", json=body) as resp:
                answer = await resp.json(content_type=None)
                assert resp.status == 200, (
                    answer,
                    ctx.requests,
                    gen.requests,
                    (tmp_path / "log").read_text()[-4000:],
                )
            assert answer["choices"][0]["text"] == " the quick brown fox"
            assert len(ctx.requests) == 1 and len(gen.requests) == 1
            assert ctx.requests[0]["disaggregated_params"] == {"request_type": "context_only"}
            assert ctx.requests[0]["max_tokens"] == 1 and ctx.requests[0]["stream"] is False
            assert gen.requests[0]["max_tokens"] == 16
            # a context answer that is already complete is the client's answer: no
            # generation hop at all (PROTOCOLS.md §3.5 step 3)
            ctx.final_next = True
            async with session.post(base + "/v1/completions", json=body) as resp:
                answer = await resp.json(content_type=None)
                assert resp.status == 200, answer
            assert len(ctx.requests) == 2 and len(gen.requests) == 1
            assert answer["choices"][0]["text"] == " the"
            assert answer["choices"][0]["finish_reason"] == "stop"
            assert "disaggregated_params" not in answer["choices"][0]
            # a streaming client: the context hop is still one JSON answer, the generation
            # hop streams back through kvplug chunk by chunk
            stream_body = dict(body, stream=True)
            async with session.post(base + "/v1/completions", json=stream_body) as resp:
                raw = await resp.read()
                assert resp.status == 200, raw
            assert ctx.requests[2]["stream"] is False and gen.requests[1]["stream"] is True
            texts = [
                json.loads(line[6:])["choices"][0]["text"]
                for line in raw.decode().split("\n")
                if line.startswith("data: {")
            ]
            assert "".join(texts) == " the quick brown fox" and raw.rstrip().endswith(b"[DONE]")
    finally:
        stop_process(proc, timeout=10, sig=signal.SIGTERM)
        await ctx.stop()
        await gen.stop()
