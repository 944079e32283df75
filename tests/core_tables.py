"""The C index's table growth as the tests model it (csrc/index.c's constants)."""

from __future__ import annotations

MIN_CAP, LOAD_NUM, LOAD_DEN = 16, 17, 20  # csrc/index.c


def resize_points(limit: int) -> list[int]:
    """Entry counts at which a table grows (storing the n-th entry resizes it)."""
    cap, points = MIN_CAP, []
    for need in range(1, limit + 1):
        if need * LOAD_DEN > cap * LOAD_NUM:
            while need * LOAD_DEN > cap * LOAD_NUM:
                cap = cap + cap // 2 + MIN_CAP
            points.append(need)
    return points
