"""``kvplug serve --processes N``: N serving processes on one port, under one supervisor.

The shape of uvicorn's and gunicorn's multi-process servers and vLLM's ``--api-server-count``:
a parent that serves nothing and N children that each run the whole frontend. What differs:

* **One port, ``SO_REUSEPORT``** (Linux): every child opens its own listening socket on the
  same host:port and the kernel spreads new connections over them, so no accept lock and no
  process takes the lion's share. The parent binds the port first, without listening, so a
  busy port is refused before anything starts, ``--port 0`` resolves to one port for all, and
  the port stays reserved while a child restarts.
* **Each child is a full router**: it subscribes to every engine's KV events itself (an
  engine's PUB socket fans out to every subscriber; its replay ROUTER socket answers each
  DEALER by its own identity) and keeps its own index, as router replicas do.
* **Load shared**: the children tell each other their requests' lifecycle
  (:mod:`kvplug.local_sync`, the replicas' events over Unix sockets), so N processes do not
  all send to the worker each sees idle.
* **One view**: ``/metrics`` and decision lookups gather from every child
  (:mod:`kvplug.frontend.peers`).

Lifecycle. The parent starts N children (fork) and waits until each serves; if one fails to
start, the others are stopped and ``kvplug serve`` exits with that child's code (2 for a
configuration error). Once serving, a child that dies is logged and restarted (its peers
release its load when its connections close); more than ``MAX_RESTARTS`` deaths within
``RESTART_WINDOW_S`` is a crash loop, and the whole serve stops with exit code 1. SIGTERM or
SIGINT stop every child (each closes as a single ``kvplug serve`` does) and the parent exits
0; a child that has not stopped after ``STOP_GRACE_S`` is killed. Children stop on their own
when the parent dies (they watch its pipe), so a killed supervisor leaves nothing behind.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from kvplug.cli import RunError, UsageError

log = logging.getLogger("kvplug.serve")

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
STOP_GRACE_S = 30.0
START_TIMEOUT_S = 600.0  # a child waits for its workers' event streams before it serves

# flags whose state lives in one process and cannot be shared by N: refused, with the reason
_SINGLE_PROCESS_ONLY = {
    "admin_token": (
        "--admin-token",
        "the admin API changes the fleet of the one process that receives the call, and "
        "the other processes would keep routing to the old fleet; use --worker-config with "
        "--discovery (every process watches it) or run one process",
    ),
    "epp_port": (
        "--epp-port",
        "the endpoint picker is a gRPC server of its own; run it as a separate "
        "single-process kvplug serve",
    ),
    "replica_sync": (
        "--replica-sync",
        "the processes of one serve share load over local sockets, not NATS; run one "
        "process per replica",
    ),
}


def check_args(args: argparse.Namespace) -> None:
    if args.processes < 1:
        raise UsageError("--processes must be >= 1")
    if args.processes == 1:
        return
    if not sys.platform.startswith("linux"):
        raise UsageError("--processes > 1 needs Linux (SO_REUSEPORT spreads connections)")
    for name, (flag, why) in _SINGLE_PROCESS_ONLY.items():
        if getattr(args, name, None):
            raise UsageError(f"--processes > 1 cannot be used with {flag}: {why}")


def reserve_port(host: str, port: int) -> socket.socket:
    """Bind (without listening) host:port with SO_REUSEPORT: refuses a busy port now, turns
    port 0 into one port for every child, and keeps the port ours between child restarts.
    A socket that does not listen takes no connections."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise RunError(f"--host: cannot resolve {host!r}: {exc}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise RunError(f"--port: port {port} on {host} is already in use") from None
        raise RunError(f"--port: cannot listen on {host}:{port}: {exc}") from None
    return sock


@dataclass
class ProcessGroup:
    """What a child knows about its serve: its index, how many there are, the private
    directory of their sockets, and the pipes to its parent."""

    index: int
    count: int
    directory: str
    ready_fd: int
    parent_sentinel: int | None = None

    def notify_ready(self) -> None:
        os.write(self.ready_fd, b"r")
        os.close(self.ready_fd)

    def leave(self) -> None:
        """After this process has closed its sockets: if the supervisor died (it removes the
        directory otherwise), the last process out removes it."""
        parent = multiprocessing.parent_process()
        if parent is not None and not parent.is_alive():
            with contextlib.suppress(OSError):  # not empty: another process is still closing
                os.rmdir(self.directory)


@dataclass
class _Child:
    index: int
    process: Any = None  # multiprocessing.Process
    ready_r: int = -1
    ready: bool = False
    started_at: float = 0.0
    deaths: list[float] = field(default_factory=list)


def _child_main(args: argparse.Namespace, group: ProcessGroup, reserved_fd: int) -> None:
    os.close(reserved_fd)  # the parent's; a child listens on a socket of its own
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # until the serve loop installs its own
    parent = multiprocessing.parent_process()
    group.parent_sentinel = parent.sentinel if parent is not None else None
    from kvplug.frontend.cli import run_child

    sys.exit(run_child(args, group))


class Supervisor:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.count = args.processes
        self.ctx = multiprocessing.get_context("fork")  # no threads yet: nothing to inherit
        self.children = [_Child(i) for i in range(self.count)]
        self.stopping = False
        self.directory = ""
        self.reserved: socket.socket | None = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stopping = True

    def _spawn(self, child: _Child) -> None:
        ready_r, ready_w = os.pipe()
        group = ProcessGroup(child.index, self.count, self.directory, ready_w)
        assert self.reserved is not None
        proc = self.ctx.Process(
            target=_child_main,
            args=(self.args, group, self.reserved.fileno()),
            name=f"kvplug-serve-p{child.index}",
        )
        proc.start()
        os.close(ready_w)
        child.process = proc
        child.ready_r = ready_r
        child.ready = False
        child.started_at = time.monotonic()
        log.info("process %d started (pid %d)", child.index, proc.pid)

    def _close_ready(self, child: _Child) -> None:
        if child.ready_r >= 0:
            os.close(child.ready_r)
            child.ready_r = -1

    def run(self) -> int:
        self.reserved = reserve_port(self.args.host, self.args.port)
        self.args.port = self.reserved.getsockname()[1]
        self.directory = tempfile.mkdtemp(prefix="kvplug-serve-")  # mode 0700
        log.info("processes share load and views over sockets in %s", self.directory)
        old = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._supervise()
        finally:
            self._stop_all()
            for sig, handler in old.items():
                signal.signal(sig, handler)
            self.reserved.close()
            shutil.rmtree(self.directory, ignore_errors=True)

    def _supervise(self) -> int:
        for child in self.children:
            self._spawn(child)
        announced = False
        while not self.stopping:
            waits: list[Any] = [c.process.sentinel for c in self.children]
            waits += [c.ready_r for c in self.children if not c.ready and c.ready_r >= 0]
            multiprocessing.connection.wait(waits, timeout=0.5)
            for child in self.children:
                if not child.ready and child.ready_r >= 0 and _readable(child.ready_r):
                    if os.read(child.ready_r, 1) == b"r":
                        child.ready = True
                    self._close_ready(child)
                if child.process.exitcode is None:
                    if not child.ready and time.monotonic() - child.started_at > START_TIMEOUT_S:
                        log.error(
                            "process %d did not start within %g s", child.index, START_TIMEOUT_S
                        )
                        return 1
                    continue
                code = self._died(child, announced)
                if code is not None:
                    return code
            if not announced and all(c.ready for c in self.children):
                announced = True
                log.info(
                    "kvplug serving on %s:%d with %d processes (SO_REUSEPORT)",
                    self.args.host,
                    self.args.port,
                    self.count,
                )
        log.info("stopping %d processes", self.count)
        return 0

    def _died(self, child: _Child, serving: bool) -> int | None:
        """A child exited on its own: the serve's exit code, or None once it is restarted."""
        if self.stopping:  # Ctrl-C reaches every process of the group: not a death
            return None
        code = child.process.exitcode
        was_ready = child.ready
        self._close_ready(child)
        if not serving and not was_ready:  # the first start failed: its message is logged
            log.error("process %d failed to start (exit code %s)", child.index, code)
            return code if isinstance(code, int) and code > 0 else 1
        now = time.monotonic()
        child.deaths = [t for t in child.deaths if now - t < RESTART_WINDOW_S] + [now]
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        if len(child.deaths) > MAX_RESTARTS:
            log.error(
                "process %d died %d times within %g s (last: %s): stopping the serve",
                child.index,
                len(child.deaths),
                RESTART_WINDOW_S,
                how,
            )
            return 1
        log.warning(
            "process %d (pid %d) died (%s): restarting it", child.index, child.process.pid, how
        )
        self._spawn(child)
        return None

    def _stop_all(self) -> None:
        alive = [c.process for c in self.children if c.process is not None and c.process.is_alive()]
        for proc in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in alive:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in alive:
            if proc.is_alive():
                log.warning("process %s did not stop within %g s: killed", proc.name, STOP_GRACE_S)
                proc.kill()
                proc.join()
        for child in self.children:
            self._close_ready(child)


def _readable(fd: int) -> bool:
    import select

    return bool(select.select([fd], [], [], 0)[0])


def run_processes(args: argparse.Namespace) -> int:
    """The parent of ``kvplug serve --processes N`` (N > 1); returns the exit code."""
    return Supervisor(args).run()
