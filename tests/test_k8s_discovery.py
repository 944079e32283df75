"""Kubernetes discovery against recorded API responses (tests/data/k8s/: an EndpointSliceList
and a watch stream as the API server sends them) served by a small aiohttp app that plays the
API server, including a watch history that expires (410) and forces a relist."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web
from test_frontend_harness import serving

from kvplug.discovery.kubernetes import (
    KubernetesDiscovery,
    parse_kubernetes_url,
    workers_from_slices,
)
from kvplug.errors import ConfigError
from kvplug.frontend.app import ServeSettings

pytestmark = pytest.mark.timeout(60)
DATA = Path(__file__).parent / "data" / "k8s"
LIST = json.loads((DATA / "endpointslices_list.json").read_text())
WATCH = (DATA / "endpointslices_watch.jsonl").read_bytes().splitlines(keepends=True)
PATH = "/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"


class ApiServer:
    """Answers list and watch requests with the recorded bodies, one watch event at a time."""

    def __init__(self) -> None:
        self.requests: list[dict[str, str]] = []
        self.release = asyncio.Queue()  # the test lets each recorded watch event out
        self.lists = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert request.headers.get("Authorization") == "Bearer test-token"
        params = dict(request.query)
        self.requests.append(params)
        assert params["labelSelector"] == "kubernetes.io/service-name=vllm"
        if params.get("watch") != "1":
            self.lists += 1
            return web.json_response(LIST)
        if params["resourceVersion"] != "48213":  # a resumed watch: quiet until the client goes
            while request.transport is not None and not request.transport.is_closing():
                await asyncio.sleep(0.05)
            return web.Response()
        resp = web.StreamResponse()
        await resp.prepare(request)
        for line in WATCH:
            await self.release.get()
            await resp.write(line)
        return resp


@pytest.fixture
async def api():
    server = ApiServer()
    app = web.Application()
    app.router.add_get(PATH, server.handle)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield server, f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def _until(cond, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def _ids(h) -> set[str]:
    return set(h.frontend.fleet.workers)


async def test_endpoint_slices_follow_the_recorded_list_and_watch(api):
    server, url = api
    # no health probes: the recorded pods' addresses (10.42.x.x) are not this machine's, and
    # a test reaches nothing beyond loopback
    async with serving(1, settings=ServeSettings(health_interval=0)) as h:
        disc = KubernetesDiscovery(
            h.frontend.fleet, api_url=url, namespace="llm", service="vllm", token="test-token",
            port_name="http", engine="stub",
        )  # fmt: skip
        await disc.start()
        try:
            # the list: two ready pods join (vllm-2 is not ready), on the named port, labelled
            assert _ids(h) == {"w0", "vllm-0", "vllm-1"}
            e0 = h.frontend.fleet.workers["vllm-0"]
            assert e0.spec.url == "http://10.42.0.17:8000"
            assert e0.spec.labels == {"zone": "us-east1-b", "node": "gpu-node-a"}
            # MODIFIED: vllm-1 terminating (still serving) is drained, vllm-2 became ready
            server.release.put_nowait(1)
            await _until(lambda: "vllm-2" in _ids(h))
            assert h.frontend.fleet.workers["vllm-1"].draining
            assert not h.frontend.fleet.workers["vllm-0"].draining
            server.release.put_nowait(1)  # BOOKMARK: nothing changes
            server.release.put_nowait(1)  # MODIFIED: vllm-1 gone from the slice
            await _until(lambda: "vllm-1" not in _ids(h))
            server.release.put_nowait(1)  # ADDED: a second slice with vllm-3
            await _until(lambda: "vllm-3" in _ids(h))
            server.release.put_nowait(1)  # DELETED: that slice again
            await _until(lambda: "vllm-3" not in _ids(h))
            assert _ids(h) == {"w0", "vllm-0", "vllm-2"}
            # ERROR 410 (history compacted): relist, which restores the list's state
            server.release.put_nowait(1)
            await _until(lambda: server.lists == 2)
            await _until(lambda: _ids(h) == {"w0", "vllm-0", "vllm-1"})
            watches = [r for r in server.requests if r.get("watch") == "1"]
            assert watches[0]["resourceVersion"] == "48213"
            assert watches[0]["allowWatchBookmarks"] == "true"
            assert disc.stats.invalid == 0 and disc.stats.drained == 1
            assert "w0" in _ids(h)  # the static worker was never touched
        finally:
            await disc.close()


def test_slices_to_workers():
    slices = {LIST["items"][0]["metadata"]["name"]: LIST["items"][0]}
    first_port = workers_from_slices(slices, None, "http", None)  # no name: the first port
    assert first_port["vllm-0"][0]["url"] == "http://10.42.0.17:9090"
    assert set(first_port) == {"vllm-0", "vllm-1"}
    missing = workers_from_slices(slices, "grpc", "http", None)
    assert missing == {}
    ipv6 = {"s": {"ports": [{"port": 80}], "endpoints": [{"addresses": ["fd00::5"]}]}}
    ((wid, (mapping, draining)),) = workers_from_slices(ipv6, None, "https", "sglang").items()
    assert wid == "fd00::5:80" and mapping["url"] == "https://[fd00::5]:80"
    assert mapping["engine"] == "sglang" and not draining


def test_discovery_url_forms():
    assert parse_kubernetes_url("kubernetes://llm/vllm?port=http") == {
        "namespace": "llm", "service": "vllm", "port": "http"
    }  # fmt: skip
    for bad in ("kubernetes://llm", "kubernetes:///vllm", "k8s://a/b/c", "kubernetes://a/b?x=1"):
        with pytest.raises(ConfigError):
            parse_kubernetes_url(bad)


async def test_an_unreachable_api_server_fails_start_clearly():
    async with serving(1) as h:
        disc = KubernetesDiscovery(
            h.frontend.fleet, api_url="http://127.0.0.1:1", namespace="llm", service="vllm",
            timeout=1,
        )  # fmt: skip
        with pytest.raises(ConnectionError, match="cannot list EndpointSlices"):
            await disc.start()
