"""kvplug's import hook for TRT-LLM builds without ``remote_http``: ``router: {type: kvplug}``
in ``trtllm-serve disaggregated``'s YAML. TensorRT-LLM needs CUDA, so the module it patches is
a stand-in written to the upstream interface at 00895e31 (``tests/data/trtllm/standin``);
kvplug serve and its engines are real (stub engines on loopback)."""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from kvplug.integrations.trtllm import hook
from test_frontend_harness import MODEL, prompt, serving

from kvplug.frontend.app import ServeSettings

ROOT = Path(__file__).resolve().parent.parent
STANDIN = Path(__file__).parent / "data" / "trtllm" / "standin"

pytestmark = pytest.mark.timeout(60)

PD = [
    {"id": "p0", "role": "prefill"},
    {"id": "p1", "role": "prefill"},
    {"id": "d0", "role": "decode"},
]
# a placement's booking outlives any test: its release is finish_request's doing (the 1 s
# default could run out between a placement and the check of its load on a slow machine)
LONG_BOOKING = ServeSettings(health_interval=0.2, health_timeout=5.0, trtllm_booking_seconds=600)


def _forget_trtllm() -> None:
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        del sys.modules[name]


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.syspath_prepend(str(STANDIN))
    _forget_trtllm()
    yield
    hook.uninstall()
    _forget_trtllm()


def _import():
    router = importlib.import_module("tensorrt_llm.serve.router")
    utils = importlib.import_module("tensorrt_llm.llmapi.disagg_utils")
    proto = importlib.import_module("tensorrt_llm.serve.openai_protocol")
    return router, utils, proto


async def test_kvplug_type_places_through_kvplug_serve_and_releases_on_finish(standin):
    hook.install()
    r, utils, proto = _import()
    async with serving(PD, settings=LONG_BOOKING) as h:
        cached = prompt(6, 2)
        resp, raw = await h.complete(cached, headers={"x-kvplug-prefill-worker": "p1"})
        assert resp.status == 200, raw
        config = utils.RouterConfig(
            type="kvplug", args={"url": h.url}, server_role=utils.ServerRole.CONTEXT
        )
        router = r.create_router(config, ["ignored:1"], None, None, None, 0)
        gen = None
        assert isinstance(router, r.Router) and type(router).__name__ == "KvplugRouter"
        try:
            request = proto.CompletionRequest(
                model=MODEL,
                prompt=cached + prompt(1, 9),
                max_tokens=1,
                disaggregated_params=proto.DisaggregatedParams(request_type="context_only"),
            )
            server, info = await router.get_next_server(request)
            assert f"http://{server}" == h.engines["p1"].url
            assert info["matched_blocks"] == 6
            assert h.router.stats()["active_requests"] == 1
            await router.finish_request(request)
            h.assert_idle()  # released at once, not after the booking time
            # the generation role's router only answers generation servers
            gen = r.create_router(
                utils.RouterConfig(
                    type="KVPLUG", args={"url": h.url}, server_role=utils.ServerRole.GENERATION
                ),
                [],
            )
            gen_request = proto.CompletionRequest(
                model=MODEL,
                prompt=cached + prompt(1, 9),
                disaggregated_params=proto.DisaggregatedParams(
                    request_type="generation_only", ctx_request_id=7, encoded_opaque_state="x"
                ),
            )
            server, _ = await gen.get_next_server(gen_request, exclude_server=None)
            assert f"http://{server}" == h.engines["d0"].url
            await gen.finish_request(gen_request)
            h.assert_idle()
            # kvplug refusing (no worker left) is the ValueError the orchestrator expects
            with pytest.raises(ValueError, match="kvplug returned 503"):
                await gen.get_next_server(gen_request, exclude_server=server)
        finally:
            await router.close()
            if gen is not None:
                await gen.close()


async def test_other_router_types_are_trtllms_own(standin):
    hook.install()
    r, utils, _ = _import()
    rr = r.create_router(utils.RouterConfig(type="round_robin"), ["a:1", "b:1"])
    assert type(rr) is r.RoundRobinRouter
    with pytest.raises(ValueError, match="Unsupported router type: nope"):
        r.create_router(utils.RouterConfig(type="nope"), ["a:1"])
    with pytest.raises(ValueError, match="needs args.url"):
        r.create_router(utils.RouterConfig(type="kvplug"), ["a:1"])


def test_install_after_import_patches_in_place_and_is_idempotent(standin):
    r, utils, _ = _import()
    assert not hasattr(r, "KvplugRouter")
    original = r.create_router
    hook.install()
    hook.install()
    assert r.create_router is not original and r.create_router.__wrapped__ is original
    assert hook.patch(r)  # already patched: nothing more
    assert r.create_router.__wrapped__ is original


def test_an_unknown_interface_is_left_untouched_with_a_warning(standin, caplog):
    module = types.ModuleType("tensorrt_llm.serve.router")

    class Router:  # a future Router without finish_request
        async def get_next_server(self, request, exclude_server=None): ...

        def _on_servers_updated(self, old, new): ...

    def create_router(router_config, servers):
        return "trtllm's own"

    module.Router, module.create_router = Router, create_router
    with caplog.at_level(logging.WARNING, logger="kvplug.trtllm.hook"):
        assert hook.patch(module) is False
    assert module.create_router is create_router and not hasattr(module, "KvplugRouter")
    assert "finish_request" in caplog.text and "unchanged" in caplog.text


def test_a_failing_patch_never_breaks_trtllms_import(standin, monkeypatch, caplog):
    def broken(module):
        raise RuntimeError("kvplug bug")

    monkeypatch.setattr(hook, "router_class", broken)
    hook.install()
    with caplog.at_level(logging.WARNING, logger="kvplug.trtllm.hook"):
        r, utils, _ = _import()  # imports fine
    assert not hasattr(r, "KvplugRouter")
    assert type(r.create_router(utils.RouterConfig(), ["a:1"])) is r.RoundRobinRouter
    assert "kvplug bug" in caplog.text


def test_without_trtllm_the_hook_changes_nothing():
    _forget_trtllm()
    hook.install()
    try:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("tensorrt_llm.serve.router")
        assert importlib.import_module("json").dumps([1]) == "[1]"
    finally:
        hook.uninstall()


@pytest.mark.parametrize("enabled", [True, False])
def test_the_pth_line_installs_the_hook_only_when_asked(enabled):
    """What site.py runs at interpreter start for ``kvplug_trtllm.pth``."""
    line = (ROOT / "kvplug_trtllm.pth").read_text()
    assert line.count("\n") == 1 and line.startswith("import ")  # one line site.py executes
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(STANDIN), str(ROOT)]))
    env.pop("KVPLUG_TRTLLM_HOOK", None)
    if enabled:
        env["KVPLUG_TRTLLM_HOOK"] = "1"
    code = (
        f"exec({line.strip()!r})\n"
        "import sys\n"
        "loaded = 'kvplug' in sys.modules\n"
        "import tensorrt_llm.serve.router as r\n"
        "print(loaded, hasattr(r, 'KvplugRouter'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ([str(enabled), str(enabled)])
