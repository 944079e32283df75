"""``kvplug serve --processes 2``: real processes on one port in front of stub engines.

Which process serves a connection is the kernel's choice (SO_REUSEPORT hashes it), so the
tests open connections until they hold one on each process, and learn a connection's process
from the decision trace of a request sent on it (the trace names the process that decided).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvplug.frontend.stub_engine import StubEngine
from kvplug.testing import free_port, serve_command, stop_process

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
PROMPT = list(range(1, 65))


async def _until(cond, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = await cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not met within {timeout} s"
        await asyncio.sleep(0.05)


async def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return {
        (smp.name, tuple(sorted(smp.labels.items()))): smp.value
        for fam in text_string_to_metric_families(text)
        for smp in fam.samples
    }


def _prefill(metrics: dict, process: int, worker: str) -> float:
    key = (
        "kvplug_worker_active_prefill_tokens",
        (("process", str(process)), ("worker", worker)),
    )
    return metrics.get(key, 0.0)


class Serve:
    """Two stub engines and ``kvplug serve --processes 2`` in front of them."""

    def __init__(self, tmp_path: Path, processes: int = 2) -> None:
        self.tmp_path = tmp_path
        self.processes = processes
        self.engines = [StubEngine(f"e{i}") for i in range(2)]
        self.proc: subprocess.Popen | None = None
        self.log = tmp_path / "serve.log"
        self.url = ""
        self.sessions: list[aiohttp.ClientSession] = []

    async def __aenter__(self) -> Serve:
        for e in self.engines:
            await e.start()
        self.workers = {e.url.rsplit("/", 1)[-1]: e for e in self.engines}  # type: ignore[union-attr]
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = serve_command(
            port,
            "--processes",
            str(self.processes),
            "--worker-engine",
            "openai",
            *(a for e in self.engines for a in ("--worker", str(e.url))),
            "--kv-block-size",
            "16",
        )
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal would give it
        )

        async def all_up():
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            with contextlib.suppress(aiohttp.ClientError, AssertionError):
                if self.processes == 1:
                    async with aiohttp.ClientSession() as s, s.get(self.url + "/ready") as r:
                        return r.status == 200
                m = await _metrics(self.url)
                up = [m.get(("kvplug_process_up", (("process", str(i)),))) for i in range(2)]
                return up == [1.0, 1.0]
            return False

        await _until(all_up, what="both processes serving")
        return self

    async def __aexit__(self, *exc) -> None:
        for s in self.sessions:
            await s.close()
        stop_process(self.proc, sig=signal.SIGTERM)
        for e in self.engines:
            e.gate = None
            await e.stop()

    def connection(self) -> aiohttp.ClientSession:
        """A client that keeps one connection (so one process) for all its requests."""
        s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        self.sessions.append(s)
        return s

    async def decide(self, session: aiohttp.ClientSession) -> dict:
        """Send one request; its decision trace (with the process that routed it)."""
        body = {"model": "stub-model", "prompt": PROMPT, "max_tokens": 2}
        async with session.post(self.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            decision_id = r.headers["x-kvplug-decision-id"]
            await r.read()
        async with session.get(self.url + "/kvplug/decisions/" + decision_id) as r:
            assert r.status == 200
            return await r.json()

    async def one_connection_per_process(self) -> dict[int, aiohttp.ClientSession]:
        found: dict[int, aiohttp.ClientSession] = {}
        for _ in range(200):
            s = self.connection()
            index = (await self.decide(s))["process"]["index"]
            found.setdefault(index, s)
            if len(found) == self.processes:
                return found
        raise AssertionError(f"every connection landed on processes {sorted(found)}")

    def recorded(self) -> int:
        return sum(len(e.requests) for e in self.engines)


async def _send_held(serve: Serve, session: aiohttp.ClientSession) -> tuple[asyncio.Task, str]:
    """Send a request the engines hold (gated); the worker it reached."""
    before = {w: len(e.requests) for w, e in serve.workers.items()}
    body = {"model": "stub-model", "prompt": PROMPT, "max_tokens": 2}

    async def post():
        async with session.post(serve.url + "/v1/completions", json=body) as r:
            return r.status, r.headers.get("x-kvplug-worker")

    task = asyncio.create_task(post())

    async def reached():
        got = [w for w, e in serve.workers.items() if len(e.requests) > before[w]]
        return got[0] if got else None

    return task, await _until(reached, what="the held request reaching an engine")


async def test_two_processes_answer_and_a_worker_busy_via_one_is_avoided_by_the_other(tmp_path):
    async with Serve(tmp_path) as serve:
        conns = await serve.one_connection_per_process()
        pids = {(await serve.decide(s))["process"]["pid"] for s in conns.values()}
        assert len(pids) == 2
        for pid in pids:  # both are children of the one serve
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            assert ppid == serve.proc.pid
        # on 5 fresh pairs: a request held via process A makes process B pick the other worker
        for trial in range(5):
            a, b = (0, 1) if trial % 2 == 0 else (1, 0)
            for e in serve.engines:
                e.gate = asyncio.Event()
            held, busy = await _send_held(serve, conns[a])

            async def b_sees_it(busy=busy, b=b):
                return _prefill(await _metrics(serve.url), b, busy) > 0

            await _until(b_sees_it, what=f"process {b} seeing process {a}'s request on {busy}")
            second, other = await _send_held(serve, conns[b])
            assert other != busy, f"trial {trial}: process {b} sent to the busy worker {busy}"
            for e in serve.engines:
                assert e.gate is not None
                e.gate.set()
            assert (await held)[0] == 200 and (await second)[0] == 200

            async def released(busy=busy, other=other):
                m = await _metrics(serve.url)
                return all(_prefill(m, p, w) == 0 for p in (0, 1) for w in (busy, other))

            await _until(released, what="load released on both processes")
        # the merged /metrics counts each process's own requests under its label
        m = await _metrics(serve.url)
        assert m[("kvplug_process_up", (("process", "0"),))] == 1.0


async def test_a_killed_process_is_restarted_and_its_load_released(tmp_path):
    async with Serve(tmp_path) as serve:
        conns = await serve.one_connection_per_process()
        victim = await serve.decide(conns[0])
        old_pid = victim["process"]["pid"]
        for e in serve.engines:
            e.gate = asyncio.Event()
        held, busy = await _send_held(serve, conns[0])

        async def seen_by_1():
            return _prefill(await _metrics(serve.url), 1, busy) > 0

        await _until(seen_by_1, what="process 1 seeing process 0's request")
        kept, kept_on = await _send_held(serve, conns[1])  # process 1's, across the restart
        os.kill(old_pid, signal.SIGKILL)
        status = None
        with contextlib.suppress(aiohttp.ClientError):
            status = (await held)[0]
        assert status is None  # its client lost the connection with the process

        async def released_and_back():
            try:
                m = await _metrics(serve.url)
            except aiohttp.ClientError:
                # a connection the kernel queued at the killed process's listener is reset
                # (docs/frontend.md, Lifecycle): not yet, ask again
                return False
            back = m.get(("kvplug_process_up", (("process", "0"),))) == 1.0
            # process 1 dropped the dead one's request; the new process 0 was told of 1's
            return back and _prefill(m, 1, busy) == 0 and _prefill(m, 0, kept_on) > 0

        await _until(released_and_back, what="load released and process 0 back")
        for e in serve.engines:
            assert e.gate is not None
            e.gate.set()
            e.gate = None
        assert (await kept)[0] == 200
        died = f"process 0 (pid {old_pid}) died (signal 9): restarting it"
        assert died in serve.log.read_text()
        new = await _until(
            lambda: _pid_of(serve, 0), what="a request answered by the restarted process"
        )
        assert new != old_pid and serve.proc.poll() is None


async def _pid_of(serve: Serve, index: int) -> int | None:
    trace = await serve.decide(serve.connection())
    return trace["process"]["pid"] if trace["process"]["index"] == index else None


async def test_sigterm_stops_every_process(tmp_path):
    async with Serve(tmp_path) as serve:
        conns = await serve.one_connection_per_process()
        pids = [(await serve.decide(s))["process"]["pid"] for s in conns.values()]
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.proc.wait(60) == 0
        for pid in pids:  # reaped by the supervisor: gone, not zombies
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        text = serve.log.read_text()
        assert "[supervisor] kvplug.serve: stopping 2 processes" in text
        found = re.search(r"over sockets in (\S+)", text)
        assert found is not None and not Path(found.group(1)).exists()
        assert text.count("kvplug.serve: shutting down") == 2
        assert "[p0/" in text and "[p1/" in text  # every child's line names its process


async def test_ctrl_c_to_the_whole_group_stops_without_restarts(tmp_path):
    """A terminal's Ctrl-C sends SIGINT to every process of the group at once: the children
    stopping must not read as deaths to restart."""
    async with Serve(tmp_path) as serve:
        assert serve.proc is not None
        os.killpg(serve.proc.pid, signal.SIGINT)
        assert serve.proc.wait(60) == 0
        text = serve.log.read_text()
        assert "restarting" not in text and text.count("kvplug.serve: shutting down") == 2


async def test_children_stop_when_the_supervisor_is_killed(tmp_path):
    async with Serve(tmp_path) as serve:
        conns = await serve.one_connection_per_process()
        pids = [(await serve.decide(s))["process"]["pid"] for s in conns.values()]
        serve.proc.kill()
        serve.proc.wait(30)

        async def all_gone():
            alive = []
            for pid in pids:
                try:
                    os.kill(pid, 0)
                    alive.append(pid)
                except ProcessLookupError:
                    pass
            return not alive

        # orphans are reaped by init (or pytest's subreaper): they vanish once they exit
        await _until(all_gone, what="the children exiting after their supervisor died")
        # and the last one out removed the sockets' directory the supervisor could not
        found = re.search(r"over sockets in (\S+)", serve.log.read_text())
        assert found is not None
        assert not Path(found.group(1)).exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--processes", "2", "--admin-token", "t"], "cannot be used with --admin-token"),
        (["--processes", "2", "--epp-port", "1"], "cannot be used with --epp-port"),
        (["--processes", "0"], "--processes must be >= 1"),
    ],
)
def test_what_processes_cannot_share_is_refused_with_a_reason(flags, message):
    cmd = serve_command(free_port(), "--worker", "http://127.0.0.1:9", *flags)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_a_busy_port_is_refused_before_any_process_starts():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = serve_command(port, "--processes", "2", "--worker", "http://127.0.0.1:9")
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "already in use" in proc.stderr, proc.stderr
    assert "started" not in proc.stderr


async def test_one_process_is_unchanged(tmp_path):
    """The default: no process label in /metrics, no process in traces."""
    async with Serve(tmp_path, processes=1) as serve:
        s = serve.connection()
        body = {"model": "stub-model", "prompt": PROMPT, "max_tokens": 2}
        async with s.post(serve.url + "/v1/completions", json=body) as r:
            decision_id = r.headers["x-kvplug-decision-id"]
        async with s.get(serve.url + "/kvplug/decisions/" + decision_id) as r:
            assert "process" not in await r.json()
        async with s.get(serve.url + "/metrics") as r:
            text = await r.text()
        assert "process=" not in text and "kvplug_process_up" not in text
        assert "[supervisor]" not in serve.log.read_text()


async def test_a_process_that_keeps_dying_stops_the_serve(tmp_path):
    """A crash loop (more than 5 deaths of one process within 60 s) is not restarted forever:
    the supervisor stops everything and exits 1."""
    async with Serve(tmp_path) as serve:
        assert serve.proc is not None
        deadline = time.monotonic() + 90
        seen: set[int] = set()
        while serve.proc.poll() is None:
            assert time.monotonic() < deadline, "the supervisor kept restarting"
            for pid in _children(serve.proc.pid):
                seen.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.05)
        assert serve.proc.returncode == 1
        assert "times within 60 s" in serve.log.read_text()
        assert len(seen) > 5  # it did restart, up to the limit
        for pid in seen:  # and left nothing running
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry.name}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
    return out


def test_a_process_that_cannot_start_stops_the_serve_with_its_exit_code():
    cmd = serve_command(free_port(), "--processes", "2", "--worker", "openai:not-a-url")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr  # a configuration error, as with one process
    assert "kvplug serve [p" in proc.stderr and "--worker openai:not-a-url" in proc.stderr
    assert "failed to start (exit code 2)" in proc.stderr
