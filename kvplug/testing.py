"""Run `kvplug serve` (or an engine) as a subprocess and wait until it answers.

Used by kvplug's own process-level tests and benchmarks; also handy in a deployment's smoke
tests. Readiness is polled (with a deadline), never slept for, and a child that exits while we
wait fails fast with the tail of its log instead of running into the timeout.
"""

from __future__ import annotations

import asyncio
import functools
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp

__all__ = [
    "free_port",
    "free_port_run",
    "free_port_runs",
    "free_ports",
    "raise_if_exited",
    "serve_command",
    "stop_process",
    "wait_listening",
    "wait_ready",
    "wait_ready_async",
]


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (held open together, so no two are the same)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_listening(port: int, proc: subprocess.Popen | None = None, timeout: float = 20.0) -> None:
    """Block until something accepts TCP connections on 127.0.0.1:port (a server we started).

    A fixture that yields before its server listens makes the first client connect take its
    retry path (nats-py waits 2 s before retrying), which is what made CI runs flaky.
    """
    deadline = time.monotonic() + timeout
    while True:
        raise_if_exited(proc, f"the server meant for port {port}", None)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"nothing listened on 127.0.0.1:{port} within {timeout:g} s"
                ) from exc
            time.sleep(0.05)


@functools.cache
def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux's default if
    unreadable)."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port_run(n: int) -> int:
    """A base port p with p .. p + n - 1 all free (engines of a fleet or DP ranks use p + i).

    Chosen below the ephemeral range when there is room: the runs are bound some time after
    they are found free, and any outgoing connection may take a port of that range meanwhile
    (seen in CI: a simulated fleet's port taken between the probe and the bind)."""
    return free_port_runs(n, 1)[0]


def free_port_runs(n: int, count: int) -> list[int]:
    """count disjoint runs of n free ports (HTTP, events and replay ports of one fleet).

    Each run is held bound while the next is picked, so no two overlap; separate
    free_port_run calls could hand out overlapping runs."""
    lo, _ = ephemeral_port_range()
    below = lo - 10_000 > n + 1
    held: list[socket.socket] = []
    bases: list[int] = []
    try:
        for _ in range(200 * count):
            if len(bases) == count:
                break
            base = random.randrange(10_000, lo - n) if below else free_port()
            socks = _bound_run(base, n) if base + n <= 65535 else None
            if socks is not None:
                held += socks
                bases.append(base)
    finally:
        for s in held:
            s.close()
    if len(bases) < count:
        raise RuntimeError(f"no {count} runs of {n} free ports")
    return bases


def _bound_run(base: int, n: int) -> list[socket.socket] | None:
    """Sockets bound to base .. base + n - 1, or None (nothing left bound) if one is taken."""
    socks: list[socket.socket] = []
    try:
        for i in range(n):
            socks.append(socket.socket())
            socks[-1].bind(("127.0.0.1", base + i))
    except OSError:
        for s in socks:
            s.close()
        return None
    return socks


def serve_command(
    port: int, *args: str, admin_port: int = -1, host: str = "127.0.0.1"
) -> list[str]:
    """argv for `python -m kvplug.cli serve` on host:port (admin API off unless admin_port)."""
    return [
        sys.executable,
        "-m",
        "kvplug.cli",
        "serve",
        "--host",
        host,
        "--port",
        str(port),
        "--admin-port",
        str(admin_port),
        *args,
    ]


def raise_if_exited(proc: subprocess.Popen | None, what: str, log: Path | None) -> None:
    """RuntimeError quoting the end of ``log`` (the child's output) if ``proc`` has exited."""
    if proc is not None and proc.poll() is not None:
        tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
        raise RuntimeError(f"{what}: process exited with {proc.returncode} while starting\n{tail}")


def wait_ready(
    url: str,
    *,
    proc: subprocess.Popen | None = None,
    timeout: float = 60.0,
    interval: float = 0.2,
    log: Path | None = None,
) -> None:
    """Poll GET url until it answers 200 (blocking). Raises RuntimeError if proc exits first or
    the deadline passes; log (the child's output file) is quoted in the error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        raise_if_exited(proc, url, log)
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):  # refused, 503 while starting, reset
            pass
        time.sleep(interval)
    raise_if_exited(proc, url, log)
    raise RuntimeError(f"{url} not ready within {timeout}s")


async def wait_ready_async(
    url: str,
    *,
    proc: subprocess.Popen | None = None,
    timeout: float = 60.0,
    interval: float = 0.2,
    log: Path | None = None,
    json_body: bytes | None = None,
) -> None:
    """wait_ready for an event loop that must keep running (e.g. it serves stub engines).
    With json_body the probe is a POST of that body (ready = a request goes through)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            raise_if_exited(proc, url, log)
            try:
                if json_body is None:
                    probe = session.get(url)
                else:
                    probe = session.post(
                        url, data=json_body, headers={"Content-Type": "application/json"}
                    )
                async with probe as r:
                    await r.read()
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(interval)
    raise_if_exited(proc, url, log)
    raise RuntimeError(f"{url} not ready within {timeout}s")


def stop_process(
    proc: subprocess.Popen | None, timeout: float = 15.0, sig: int = signal.SIGINT
) -> None:
    """Ask proc to stop (SIGINT: kvplug serve shuts down cleanly), kill it after timeout."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
