"""How the benchmarks save their plots: laid out, the folder made, 110 dpi, the figure closed."""

from __future__ import annotations

from pathlib import Path


def save_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
