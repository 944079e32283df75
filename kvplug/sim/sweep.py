"""Parameter sweep of the ``kv`` policy over a grid of two router settings (e.g. overlap credit x
temperature), each point a full replay; used to look for better defaults."""

from __future__ import annotations

from dataclasses import replace

from kvplug.sim.bench import BenchSpec, run_bench
from kvplug.sim.policies import ALIASES


def parse_axis(text: str) -> tuple[str, list[float]]:
    """``credit=0,0.5,1`` -> ("credit", [0.0, 0.5, 1.0])."""
    name, sep, raw = text.partition("=")
    if not sep or not raw:
        raise ValueError(f"sweep axis {text!r} is not NAME=V1,V2,...")
    try:
        values = [float(v) for v in raw.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"sweep axis {text!r}: values must be numbers") from None
    return name.strip(), values


def _fmt(v: float) -> str:
    return f"{v:g}"


def run_sweep(
    spec: BenchSpec,
    x_axis: str,
    y_axis: str,
    jobs: int = 1,
    base: str = "kv",
    progress: bool = True,
) -> dict:
    x_name, xs = parse_axis(x_axis)
    y_name, ys = parse_axis(y_axis)
    sep = "," if ":" in base else ":"
    points = [[f"{base}{sep}{x_name}={_fmt(x)},{y_name}={_fmt(y)}" for x in xs] for y in ys]
    flat = [p for row in points for p in row]
    report = run_bench(replace(spec, policies=flat + ["round-robin"]), jobs=jobs, progress=progress)
    by_name = {r["policy"]: r for r in report["results"]}
    keys = ("hit_rate", "ttft_p50_s", "ttft_p99_s", "e2e_p99_s", "imbalance_busy")
    grid = [[{k: by_name[p][k] for k in keys} for p in row] for row in points]
    best_p50 = min(flat, key=lambda p: by_name[p]["ttft_p50_s"])
    best_p99 = min(flat, key=lambda p: by_name[p]["ttft_p99_s"])
    best_hit = max(flat, key=lambda p: by_name[p]["hit_rate"])
    return {
        "x_name": ALIASES.get(x_name, x_name),
        "y_name": ALIASES.get(y_name, y_name),
        "x_values": xs,
        "y_values": ys,
        "grid": grid,
        "best": {"ttft_p50": best_p50, "ttft_p99": best_p99, "hit_rate": best_hit},
        "round_robin": {k: by_name["round-robin"][k] for k in keys},
        "report": report,
        "title": f"kv policy sweep: {report['trace']['requests']} requests, "
        f"{spec.n_engines} engines"
        + (f", arrivals x{spec.speedup:g}" if spec.speedup != 1 else ""),
    }


def format_sweep(sweep: dict) -> str:
    xs, ys = sweep["x_values"], sweep["y_values"]
    lines = []
    for key, label, fmt in (
        ("hit_rate", "hit rate", "{:.1%}"),
        ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
        ("ttft_p99_s", "TTFT p99 s", "{:.2f}"),
    ):
        lines.append(f"{label}: rows {sweep['y_name']}, columns {sweep['x_name']}")
        lines.append("".ljust(10) + "".join(_fmt(x).rjust(10) for x in xs))
        for i, y in enumerate(ys):
            lines.append(
                _fmt(y).ljust(10)
                + "".join(fmt.format(sweep["grid"][i][j][key]).rjust(10) for j in range(len(xs)))
            )
        lines.append("")
    rr = sweep["round_robin"]
    lines.append(
        f"round-robin: hit {rr['hit_rate']:.1%}, TTFT p50 {rr['ttft_p50_s']:.3f} s, "
        f"p99 {rr['ttft_p99_s']:.2f} s"
    )
    lines.append("best: " + ", ".join(f"{k} -> {v}" for k, v in sweep["best"].items()))
    return "\n".join(lines)
