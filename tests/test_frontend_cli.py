"""``kvplug serve`` as a user runs it: --help documents every flag, and a real process serves a
fleet given as a workers YAML file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from kvplug.cli import build_parser
from kvplug.frontend.stub_engine import StubEngine
from kvplug.testing import free_ports, serve_command, stop_process, wait_ready_async

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(90)


def test_help_documents_every_flag():
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    text = serve.format_help()
    for action in serve._actions:
        for flag in action.option_strings:
            assert flag in text
        if action.option_strings and action.help != "==SUPPRESS==":
            assert action.help, f"{action.option_strings} has no help text"
    for flag in (
        "--worker",
        "--worker-config",
        "--tokenizer",
        "--admin-token",
        "--admin-host",
        "--max-prompt-tokens",
        "--max-body-bytes",
        "--router-mode",
        "--kv-block-size",
        "--router-kv-overlap-score-credit",
        "--router-temperature",
    ):
        assert flag in text


def test_bad_worker_config_exits_with_a_message(tmp_path):
    cfg = tmp_path / "w.yaml"
    cfg.write_text("workers:\n  - {url: 'http://127.0.0.1:1', role: sideways}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kvplug.cli", "serve", "--worker-config", str(cfg), "--port", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 2 and "role" in proc.stderr


async def test_serve_process_with_a_worker_config(tmp_path):
    engines = [StubEngine(f"e{i}", model="m1") for i in range(2)]
    for e in engines:
        await e.start()
    cfg = tmp_path / "workers.yaml"
    cfg.write_text(
        "workers:\n"
        + "".join(
            f"  - {{id: e{i}, url: '{e.url}', engine: openai, labels: {{n: '{i}'}}}}\n"
            for i, e in enumerate(engines)
        )
    )
    port, admin_port = free_ports(2)
    env = {**os.environ, "KVPLUG_ADMIN_TOKEN": "tok"}
    cmd = serve_command(
        port,
        "--worker-config",
        str(cfg),
        "--kv-block-size",
        "16",
        "--log-level",
        "warning",
        admin_port=admin_port,
    )
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready_async(url + "/ready", proc=proc, timeout=60)
        async with aiohttp.ClientSession() as s:
            body = {"model": "m1", "prompt": list(range(64)), "max_tokens": 3, "stream": True}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
                assert r.headers["x-kvplug-worker"] in ("e0", "e1")
                assert (await r.read()).endswith(b"data: [DONE]\n\n")
            async with s.get(url + "/v1/models") as r:
                assert [m["id"] for m in (await r.json())["data"]] == ["m1"]
            admin = f"http://127.0.0.1:{admin_port}/admin/workers"
            async with s.get(admin, headers={"Authorization": "Bearer tok"}) as r:
                workers = (await r.json())["workers"]
                assert [w["id"] for w in workers] == ["e0", "e1"]
                assert workers[1]["labels"] == {"n": "1"}
            async with s.post(url + "/v1/completions", data=b"{") as r:
                assert r.status == 400 and json.loads(await r.read())["error"]["code"]
    finally:
        stop_process(proc)
        for e in engines:
            await e.stop()
    assert proc.returncode == 0
