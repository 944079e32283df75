"""kvplug.testing: the subprocess helpers the process-level tests and benchmarks rely on."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from kvplug.testing import (
    free_port,
    free_port_run,
    free_ports,
    serve_command,
    stop_process,
    wait_ready,
    wait_ready_async,
)

pytestmark = pytest.mark.timeout(60)


def test_wait_ready_fails_fast_with_the_log_when_the_child_exits(tmp_path):
    log = tmp_path / "log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; print('bad flag --x'); sys.exit(3)"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with 3") as err:
        wait_ready(f"http://127.0.0.1:{free_port()}/ready", proc=proc, timeout=30, log=log)
    assert "bad flag --x" in str(err.value)
    assert time.monotonic() - t0 < 15  # did not sit out the timeout


def test_wait_ready_gives_up_at_the_deadline():
    with pytest.raises(RuntimeError, match="not ready within"):
        wait_ready(f"http://127.0.0.1:{free_port()}/ready", timeout=0.5, interval=0.05)


async def test_wait_ready_async_then_stop(tmp_path):
    (tmp_path / "ok").write_text("ok")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        await wait_ready_async(f"http://127.0.0.1:{port}/ok", proc=proc, timeout=30)
        wait_ready(f"http://127.0.0.1:{port}/ok", proc=proc, timeout=5)
        with pytest.raises(RuntimeError, match="not ready within"):  # 404 is not ready
            await wait_ready_async(f"http://127.0.0.1:{port}/missing", proc=proc, timeout=0.5)
    finally:
        stop_process(proc, timeout=5)
    assert proc.returncode is not None
    stop_process(proc)  # already gone: nothing to do


def test_ports_and_command():
    a, b, c = free_ports(3)
    assert len({a, b, c}) == 3
    base = free_port_run(3)
    socks = [socket.socket() for _ in range(3)]
    try:
        for i, s in enumerate(socks):
            s.bind(("127.0.0.1", base + i))  # all three were free
    finally:
        for s in socks:
            s.close()
    cmd = serve_command(8123, "--kv-block-size", "16", admin_port=8124)
    assert cmd[0] == sys.executable and cmd[1:4] == ["-m", "kvplug.cli", "serve"]
    assert cmd[cmd.index("--port") + 1] == "8123" and cmd[cmd.index("--admin-port") + 1] == "8124"
    assert cmd[-2:] == ["--kv-block-size", "16"]


def test_port_runs_come_from_outside_the_ephemeral_range():
    """Outgoing connections draw local ports from the ephemeral range: a run found free there
    can be taken before the fleet binds it (a CI failure), so runs are taken below it."""
    import socket

    from kvplug.testing import ephemeral_port_range, free_port_run

    lo, hi = ephemeral_port_range()
    for n in (1, 3, 8):
        base = free_port_run(n)
        assert base + n <= lo or base > hi
        socks = [socket.socket() for _ in range(n)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", base + i))  # every port of the run is free
        finally:
            for s in socks:
                s.close()


def test_port_runs_taken_together_do_not_overlap(monkeypatch):
    """Three separate free_port_run calls could hand out overlapping runs (each is released
    before the next is picked); free_port_runs holds each run while picking the next. Forced
    here by a port picker that offers overlapping bases inside a free run of 8."""
    import random

    from kvplug import testing

    b = testing.free_port_run(8)
    offered = iter([b, b + 1, b, b + 2, b + 3, b + 4, b + 5, b + 6])
    monkeypatch.setattr(random, "randrange", lambda *_: next(offered))
    bases = testing.free_port_runs(2, 3)
    assert bases == [b, b + 2, b + 4]  # b + 1 and b + 3 overlap a run already held
