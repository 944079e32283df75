"""``kvplug serve`` against a hostile client (issue 9 §3): every malformed request is a 4xx with
an OpenAI-style error body, never a 5xx, and slow clients are timed out by the server."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import time
import zlib

import pytest
from test_frontend_harness import MODEL, prompt, serving

from kvplug.frontend.app import ServeSettings
from kvplug.frontend.native_lane import available as native_available

pytestmark = pytest.mark.timeout(60)
TOKEN = "admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DEEP = b"[" * 1000 + b"]" * 1000
# a client's failures counted the same with kvplug's compiled data path (kvplug/_lane.pyx)
DATA_PATHS = pytest.mark.parametrize(
    "data_path",
    [
        "python",
        pytest.param(
            "native",
            marks=pytest.mark.skipif(not native_available(), reason="kvplug._lane not built"),
        ),
    ],
)


def _error(raw: bytes, code: str) -> dict:
    err = json.loads(raw)["error"]
    assert err["code"] == code and err["message"] and err["type"], err
    return err


async def raw_http(url: str, request: bytes, read_timeout: float = 5.0) -> bytes:
    """Send exact bytes (headers aiohttp's client would refuse to send) and read the answer."""
    host, port = url.split("//")[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), read_timeout)
    finally:
        writer.close()


def _split(answer: bytes) -> tuple[int, bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def test_deeply_nested_json_is_a_400_everywhere():
    async with serving(2, admin_token=TOKEN) as h:
        for path, body in (
            ("/v1/completions", b'{"model": "stub-model", "prompt": ' + DEEP + b"}"),
            ("/v1/chat/completions", b'{"model": "stub-model", "messages": ' + DEEP + b"}"),
            ("/v1/completions", DEEP),
            # under the decoder's recursion limit, over kvplug's documented one
            ("/v1/completions", b'{"model": "stub-model", "prompt": "x", "a": ' + b"[" * 200),
            (
                "/v1/completions",
                json.dumps({"model": MODEL, "prompt": "x", "x": [[[[[]]]]]})
                .encode()
                .replace(b"[[[[[]]]]]", b"[" * 200 + b"]" * 200),
            ),
        ):
            resp, raw = await h.post(path, None, raw=body)
            assert resp.status == 400, raw[:200]
            err = json.loads(raw)["error"]
            assert err["code"] in ("json_too_deep", "invalid_json"), err
        resp, raw = await h.post(
            "/v1/completions",
            None,
            raw=b'{"model": "stub-model", "prompt": "x", "x": ' + DEEP + b"}",
        )
        assert resp.status == 400 and _error(raw, "json_too_deep")
        for path in ("/admin/workers", "/admin/busy_threshold"):
            async with h.session.post(h.admin_url + path, data=DEEP, headers=AUTH) as r:
                assert r.status == 400
                _error(await r.read(), "json_too_deep")
        assert not any(e.requests for e in h.engines.values())
        h.assert_idle()


async def test_content_encodings():
    body = json.dumps({"model": MODEL, "prompt": prompt(1, 1), "max_tokens": 2}).encode()
    async with serving(1) as h:
        engine = h.engines["w0"]
        # valid gzip and deflate bodies: decoded once, forwarded decoded, without the coding
        for coding, data in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
            resp, raw = await h.post(
                "/v1/completions", None, {"Content-Encoding": coding}, raw=data
            )
            assert resp.status == 200, raw
            sent = engine.requests[-1]
            assert "Content-Encoding" not in sent["headers"], sent["headers"]
            assert sent["body"]["prompt"] == prompt(1, 1)
        # a body that is not in the coding it claims
        for coding in ("deflate", "gzip"):
            resp, raw = await h.post(
                "/v1/completions", None, {"Content-Encoding": coding}, raw=body
            )
            assert resp.status == 400, raw
            assert "Content-Encoding" in _error(raw, "invalid_body")["message"]
        # a coding kvplug cannot decode would reach the engine still encoded
        resp, raw = await h.post("/v1/completions", None, {"Content-Encoding": "x-foo"}, raw=body)
        assert resp.status == 415 and _error(raw, "unsupported_content_encoding")
        assert len(engine.requests) == 2
        h.assert_idle()


async def test_non_utf8_authorization_is_a_401():
    settings = ServeSettings(api_key="k", health_interval=0)
    async with serving(1, settings=settings, admin_token=TOKEN) as h:
        body = json.dumps({"model": MODEL, "prompt": [1, 2]}).encode()
        for url, path in ((h.url, "/v1/completions"), (h.admin_url, "/admin/workers")):
            answer = await raw_http(
                url,
                b"POST %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\x80\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close"
                b"\r\n\r\n%s" % (path.encode(), len(body), body),
            )
            status, raw = _split(answer)
            assert status == 401, answer[:300]
            assert json.loads(raw)["error"]["type"] == "authentication_error"
        assert not h.engines["w0"].requests


async def test_a_pin_to_a_dp_rank_no_worker_has_is_a_400_like_an_unknown_worker():
    workers = [{"id": "w0"}, {"id": "w1", "dp_size": 2}]
    async with serving(workers) as h:
        for headers, extra in (
            ({"x-kvplug-dp-rank": "2"}, {}),
            ({}, {"nvext": {"dp_rank": 7}}),
            ({"x-kvplug-worker": "w0", "x-kvplug-dp-rank": "1"}, {}),  # w0 has rank 0 only
        ):
            resp, raw = await h.complete([1, 2, 3], headers=headers, **extra)
            assert resp.status == 400, raw
            assert _error(raw, "unknown_dp_rank")["param"] == "dp_rank"
        resp, raw = await h.complete([1, 2, 3], headers={"x-kvplug-worker": "ghost"})
        assert resp.status == 400 and _error(raw, "unknown_worker")
        resp, _ = await h.complete([1, 2, 3], headers={"x-kvplug-dp-rank": "1"})
        assert resp.status == 200
        assert (resp.headers["x-kvplug-worker"], resp.headers["x-kvplug-dp-rank"]) == ("w1", "1")
        h.assert_idle()


async def test_busy_thresholds_must_be_finite():
    async with serving(1, admin_token=TOKEN) as h:
        for raw in (
            b'{"active_decode_blocks_threshold": NaN}',
            b'{"active_decode_blocks_threshold": Infinity}',
            b'{"active_prefill_tokens_threshold": -Infinity}',
            b'{"active_prefill_tokens_threshold_frac": 1e999}',
        ):
            async with h.session.post(
                h.admin_url + "/admin/busy_threshold", data=raw, headers=AUTH
            ) as r:
                assert r.status == 400, raw
                assert json.loads(await r.read())["error"]["code"] in (
                    "invalid_json",
                    "invalid_threshold",
                )
        thresholds = h.router.busy_thresholds
        assert thresholds.decode_frac is None and thresholds.prefill_tokens is None


async def test_dp_size_is_capped_with_a_clear_400_and_adding_ranks_is_linear():
    from kvplug.config import RouterConfig
    from kvplug.frontend.config import MAX_DP_SIZE
    from kvplug.router import Router
    from kvplug.workers import Worker

    async with serving(1, admin_token=TOKEN) as h:
        t0 = time.perf_counter()
        async with h.session.post(
            h.admin_url + "/admin/workers",
            json={"id": "huge", "url": "http://127.0.0.1:9", "engine": "stub", "dp_size": 200_000},
            headers=AUTH,
        ) as r:
            assert r.status == 400
            msg = _error(await r.read(), "invalid_worker")["message"]
        assert "dp_size" in msg and str(MAX_DP_SIZE) in msg
        assert time.perf_counter() - t0 < 5 and "huge" not in h.router.workers
    # the router itself: 16,000 ranks took 22 s when each rank copied every lookup table
    router = Router(RouterConfig(kv_block_size=16))
    t0 = time.perf_counter()
    router.add_worker(Worker(worker_id="wide", url="http://x:1", dp_size=16_000))
    router.remove_worker("wide")
    assert time.perf_counter() - t0 < 10  # ~0.1 s now, loaded machine or not


@DATA_PATHS
async def test_slow_loris_heads_and_bodies_are_timed_out(data_path):
    settings = ServeSettings(
        client_header_timeout=0.5, client_body_timeout=0.5, health_interval=0, data_path=data_path
    )
    async with serving(1, settings=settings) as h:
        host, port = h.url.split("//")[1].rsplit(":", 1)

        async def hold(first: bytes, drip: bytes = b"", every: float = 0.1) -> tuple[float, bytes]:
            """Connect, send ``first``, then one byte of ``drip`` every ``every`` seconds;
            return when the server closes the connection."""
            t0 = time.monotonic()
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(first)
            received = b""
            try:
                for i in range(100):
                    if i < len(drip):
                        writer.write(drip[i : i + 1])
                    try:
                        chunk = await asyncio.wait_for(reader.read(65536), every)
                    except asyncio.TimeoutError:
                        continue
                    except ConnectionError:  # a drip byte hit the closed socket: reset
                        break
                    if not chunk:
                        break
                    received += chunk
            finally:
                writer.close()
            return time.monotonic() - t0, received

        # nothing at all, then a head dripped one byte at a time (never finished)
        # 0.5 s timeouts; a drip that reset them would hold on for 6 s or more: 5 s between
        elapsed, answer = await hold(b"")
        assert elapsed < 5 and answer.startswith(b"HTTP/1.1 408"), answer
        elapsed, answer = await hold(b"POST /v1/completions HTTP/1.1\r\n", b"X-Slow: " + b"a" * 60)
        assert elapsed < 5 and answer.startswith(b"HTTP/1.1 408"), answer
        assert json.loads(_split(answer)[1])["error"]["code"] == "header_timeout"
        # a whole head, then a body that never ends
        elapsed, answer = await hold(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{",
            b'"model": "' + b"m" * 60,
        )
        assert elapsed < 5 and answer.startswith(b"HTTP/1.1 408"), answer
        assert json.loads(_split(answer)[1])["error"]["code"] == "body_timeout"
        # a kept-alive connection that sends a second head too slowly
        req = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"  # answered at once
        elapsed, answer = await hold(req, b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 60)
        assert elapsed < 5 and answer.count(b"HTTP/1.1 200") == 1, answer
        assert h.running.head_timeouts == 2
        metrics = h.frontend.metrics.render().decode()
        assert 'kvplug_requests_total{endpoint="/v1/completions",status="408"} 1.0' in metrics
        assert 'kvplug_rejected_requests_total{reason="body_timeout"} 1.0' in metrics
        assert not h.engines["w0"].requests
        # an ordinary client is unaffected
        resp, _ = await h.complete([1, 2, 3])
        assert resp.status == 200


@DATA_PATHS
async def test_a_client_hanging_up_mid_body_is_not_a_server_error(caplog, data_path):
    settings = ServeSettings(api_key="k", health_interval=0, data_path=data_path)
    async with serving(1, settings=settings) as h:
        host, port = h.url.split("//")[1].rsplit(":", 1)
        for _ in range(3):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                b'Content-Length: 500\r\n\r\n{"model": "stub-model", "pro'
            )
            await writer.drain()
            writer.close()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            metrics = h.frontend.metrics.render().decode()
            if 'status="499"} 3.0' in metrics:
                break
        assert 'kvplug_requests_total{endpoint="/v1/completions",status="499"} 3.0' in metrics
        assert 'status="500"' not in metrics
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        h.assert_idle()


async def test_a_worker_url_no_http_client_can_resolve_is_refused():
    """Found by benchmarks/fuzz_http.py: an admin-added worker at http://xxx...(300 chars) was
    accepted, and every request routed to it was a 500 (UnicodeError in the HTTP client)."""
    async with serving(1, admin_token=TOKEN) as h:
        for url in ("http://" + "x" * 300, "http://a..b:8000", "http://" + "y" * 64 + ".io"):
            async with h.session.post(
                h.admin_url + "/admin/workers",
                json={"id": "bad", "url": url, "engine": "stub"},
                headers=AUTH,
            ) as r:
                assert r.status == 400, url
                _error(await r.read(), "invalid_worker")
        assert list(h.frontend.fleet.workers) == ["w0"]
