"""The GIE endpoint picker (``kvplug serve --epp-port``) driven by a gRPC client that plays
Envoy's part as the protocol specifies: request headers, the body in chunks, then (after the
picker's answer) the request forwarded to the picked endpoint and the engine's response streamed
back through the ext_proc stream. Stub engines publish real KV events to the real router."""

from __future__ import annotations

import asyncio
import json
import subprocess
from typing import Any

import aiohttp
import pytest
from envoy_data_plane.envoy.config.core.v3 import HeaderMap, HeaderValue, Metadata
from envoy_data_plane.envoy.service.ext_proc.v3 import (
    ExternalProcessorAsyncStub,
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
)
from envoy_data_plane.google.protobuf import Struct
from grpclib.client import Channel
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from test_frontend_harness import MODEL, eventually, prompt, serving

from kvplug.frontend.app import ServeSettings
from kvplug.frontend.epp import DESTINATION, SERVED, endpoint_of, start_endpoint_picker

pytestmark = pytest.mark.timeout(60)


def _header_map(headers: dict[str, str]) -> HeaderMap:
    return HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()])


def _meta(namespace: str, value: dict[str, Any]) -> Metadata:
    return Metadata(filter_metadata={namespace: Struct.from_dict(value)})


class Envoy:
    """One HTTP request through a gateway whose ext_proc filter calls the picker
    (processing mode FULL_DUPLEX_STREAMED for request and response bodies)."""

    def __init__(self, channel: Channel, session: aiohttp.ClientSession):
        self.stub = ExternalProcessorAsyncStub(channel)
        self.session = session

    async def request(
        self,
        body: bytes,
        *,
        path: str = "/v1/completions",
        headers: dict[str, str] | None = None,
        subset: list[str] | None = None,
        chunk: int = 7,
        forward: bool = True,
    ) -> dict[str, Any]:
        outbox: asyncio.Queue[ProcessingRequest | None] = asyncio.Queue()

        async def messages():
            while (msg := await outbox.get()) is not None:
                yield msg

        meta = None
        if subset is not None:
            meta = _meta("envoy.lb.subset_hint", {"x-gateway-destination-endpoint-subset": subset})
        hdrs = {
            ":method": "POST",
            ":path": path,
            ":authority": "gateway",
            "content-type": "application/json",
            "x-request-id": f"envoy-{id(body)}",
            **(headers or {}),
        }
        outbox.put_nowait(
            ProcessingRequest(
                request_headers=HttpHeaders(headers=_header_map(hdrs)), metadata_context=meta
            )
        )
        pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
        for i, piece in enumerate(pieces):
            outbox.put_nowait(
                ProcessingRequest(
                    request_body=HttpBody(body=piece, end_of_stream=i == len(pieces) - 1),
                    metadata_context=meta,
                )
            )
        answers: list[ProcessingResponse] = []
        result: dict[str, Any] = {"answers": answers}
        replies = self.stub.process(messages()).__aiter__()
        first = await replies.__anext__()
        answers.append(first)
        if first.immediate_response is not None:
            outbox.put_nowait(None)
            imm = first.immediate_response
            result["status"] = int(imm.status.code)
            result["body"] = json.loads(imm.body)
            return result
        second = await replies.__anext__()
        answers.append(second)
        set_headers = {
            h.header.key: h.header.raw_value.decode()
            for h in first.request_headers.response.header_mutation.set_headers
        }
        result["headers"] = set_headers
        result["metadata"] = first.dynamic_metadata.to_dict()
        result["forwarded_body"] = second.request_body.response.body_mutation.streamed_response.body
        if not forward:  # the gateway gives up before the upstream answers
            outbox.put_nowait(None)
            return result
        endpoint = set_headers[DESTINATION]
        served = _meta("envoy.lb", {SERVED: endpoint})
        async with self.session.post(
            f"http://{endpoint}{path}",
            data=result["forwarded_body"],
            headers={"content-type": "application/json"},
        ) as resp:
            outbox.put_nowait(
                ProcessingRequest(
                    response_headers=HttpHeaders(
                        headers=_header_map(
                            {":status": str(resp.status), "content-type": resp.content_type}
                        )
                    ),
                    metadata_context=served,
                )
            )
            answers.append(await replies.__anext__())
            echoed = b""
            async for piece in resp.content.iter_any():
                outbox.put_nowait(
                    ProcessingRequest(response_body=HttpBody(body=piece, end_of_stream=False))
                )
                reply = await replies.__anext__()
                echoed += reply.response_body.response.body_mutation.streamed_response.body
            outbox.put_nowait(
                ProcessingRequest(response_body=HttpBody(body=b"", end_of_stream=True))
            )
            await replies.__anext__()
            outbox.put_nowait(None)
            result["status"] = resp.status
            result["response"] = echoed
        return result


async def _with_picker(h, fn):
    picker = await start_endpoint_picker(h.frontend)
    channel = Channel("127.0.0.1", picker.port)
    try:
        return await fn(Envoy(channel, h.session), picker, channel)
    finally:
        channel.close()
        await picker.close()


def _body(tokens: list[int], **extra: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": tokens, "max_tokens": 4, **extra}).encode()


async def test_picks_by_prefix_and_sets_both_destination_forms():
    async with serving(3) as h:
        a, b = prompt(8, 1), prompt(8, 2)
        for p, w in ((a, "w0"), (b, "w2")):  # seed the caches through kvplug's own API
            resp, _ = await h.complete(p, headers={"x-kvplug-worker": w})
            assert resp.status == 200
        h.assert_idle()

        async def run(envoy, picker, _channel):
            for p, w in ((a + prompt(2, 9), "w0"), (b + prompt(3, 8), "w2")):
                out = await envoy.request(_body(p))
                endpoint = endpoint_of(h.frontend.fleet.workers[w].url_base)
                assert out["headers"][DESTINATION] == endpoint
                assert out["metadata"] == {"envoy.lb": {DESTINATION: endpoint}}
                assert out["headers"]["content-length"] == str(len(_body(p)))
                assert out["forwarded_body"] == _body(p)  # the body goes on unchanged
                assert out["status"] == 200
                assert json.loads(out["response"])["object"] == "text_completion"
                trace = await h.trace(out["headers"]["x-kvplug-decision-id"])
                assert trace["worker_id"] == w and trace["router"]["overlap_blocks"] >= 4
                assert trace["outcome"] == "ok"
                h.assert_idle()  # the response's end released the load
            assert picker.picker.picks == 2

        await _with_picker(h, run)


async def test_streamed_response_passes_through_and_load_is_held_until_its_end():
    async with serving(2, stub_options={"token_delay": 0.02}) as h:

        async def run(envoy, _picker, _channel):
            body = _body(prompt(4, 3), stream=True, max_tokens=5)
            out = await envoy.request(body)
            assert out["status"] == 200
            assert out["response"].endswith(b"data: [DONE]\n\n")
            h.assert_idle()
            # a gateway that closes the stream before the upstream answers releases the load too
            out = await envoy.request(_body(prompt(4, 4)), forward=False)
            assert DESTINATION in out["headers"]
            await eventually(lambda: h.active()["active_requests"] == 0)
            h.assert_idle()

        await _with_picker(h, run)


async def test_subset_hint_limits_the_pick_and_an_unknown_subset_is_503():
    async with serving(3) as h:
        cached = prompt(8, 5)
        resp, _ = await h.complete(cached, headers={"x-kvplug-worker": "w1"})
        assert resp.status == 200

        async def run(envoy, _picker, _channel):
            only = endpoint_of(h.frontend.fleet.workers["w2"].url_base)
            out = await envoy.request(_body(cached), subset=[only])
            assert out["headers"][DESTINATION] == only  # not w1, although w1 holds the prefix
            out = await envoy.request(_body(cached), subset=["10.9.9.9:1"])
            assert out["status"] == 503 and out["body"]["error"]["code"] == "empty_subset"
            out = await envoy.request(_body(cached), subset=[])
            assert out["status"] == 503
            h.assert_idle()

        await _with_picker(h, run)


async def test_client_mistakes_are_4xx_immediate_responses():
    async with serving(2, settings=ServeSettings(api_key="sesame", health_interval=0.2)) as h:
        auth = {"authorization": "Bearer sesame"}

        async def run(envoy, picker, _channel):
            cases = [
                (b"{not json", "/v1/completions", auth, 400),
                (json.dumps({"prompt": [1]}).encode(), "/v1/completions", auth, 400),
                (_body([1, 2, 3]), "/v1/embeddings", auth, 404),
                (_body([1, 2, 3]), "/v1/completions", {}, 401),
                (_body([1, 2, 3]), "/v1/completions", {"authorization": "Bearer no"}, 401),
                (_body([1, 2, 3], model="other"), "/v1/completions", auth, 404),
            ]
            for raw, path, headers, status in cases:
                out = await envoy.request(raw, path=path, headers=headers)
                assert out["status"] == status, (raw, out)
                assert set(out["body"]["error"]) >= {"message", "type", "code"}
            assert picker.picker.rejects == len(cases) and picker.picker.picks == 0
            out = await envoy.request(_body([1, 2, 3]), headers=auth)
            assert out["status"] == 200
            h.assert_idle()

        await _with_picker(h, run)


async def _check(channel: Channel, service: str) -> int:
    return (await HealthStub(channel).Check(HealthCheckRequest(service=service))).status


async def test_grpc_health_follows_readiness_and_no_ready_endpoint_is_503():
    async with serving(1) as h:

        async def run(envoy, _picker, channel):
            for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                assert await _check(channel, service) == HealthCheckResponse.SERVING, service
            await h.engines["w0"].stop()  # the only engine goes away; the prober notices
            await eventually(lambda: not h.frontend.fleet.ready()[0])
            out = await envoy.request(_body([1, 2, 3]))
            assert out["status"] == 503, out
            await asyncio.sleep(1.1)  # the readiness check's cached verdict expires
            assert await _check(channel, "readiness") == HealthCheckResponse.NOT_SERVING
            assert await _check(channel, "liveness") == HealthCheckResponse.SERVING

        await _with_picker(h, run)


def test_endpoint_of():
    assert endpoint_of("http://10.0.0.7:8000") == "10.0.0.7:8000"
    assert endpoint_of("http://[::1]:9000/") == "[::1]:9000"
    assert endpoint_of("https://engine.local") == "engine.local:443"


async def test_kvplug_serve_epp_port_serves_the_picker(tmp_path):
    from kvplug.testing import (
        free_ports,
        serve_command,
        stop_process,
        wait_listening,
        wait_ready_async,
    )

    http_port, epp_port = free_ports(2)
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            serve_command(http_port, "--epp-port", str(epp_port)), stdout=out, stderr=out
        )
    try:
        await wait_ready_async(f"http://127.0.0.1:{http_port}/health", proc=proc, log=log)
        await asyncio.to_thread(wait_listening, epp_port, proc)
        channel = Channel("127.0.0.1", epp_port)
        try:
            assert await _check(channel, "liveness") == HealthCheckResponse.SERVING
            # no workers yet: alive, not ready (GIE readiness = able to pick)
            assert await _check(channel, "readiness") == HealthCheckResponse.NOT_SERVING
        finally:
            channel.close()
        assert f"endpoint picker (ext_proc gRPC) on 127.0.0.1:{epp_port}" in log.read_text()
    finally:
        stop_process(proc)
