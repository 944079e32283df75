"""What a benchmark records about the machine it ran on: the figures move with the host (the
same build measured 6.2-14.3x Dynamo's apply on one 2-vCPU machine and 3.2-4.4x on another,
and a routing decision 12 us on one host and 25-33 us on the next)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (Linux), else what ``platform`` knows, else "unknown"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
