"""PNG plots of a bench report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np

from kvplug.sim.policies import DEMO_POLICIES
from kvplug.sim.transport import IDEAL, PRESETS


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _router_view(link: dict | None) -> str:
    """The preset the report's router view is (``ideal``, ``realistic``), else ``custom``."""
    if link is None:
        return IDEAL
    for name, preset in PRESETS.items():
        if asdict(preset) == link:
            return name
    return "custom"


def report_title(report: dict) -> str:
    """What a bench report's plots are titled with: the trace, the fleet, the router view, and
    for a report of several seeds what its points and whiskers are."""
    tr = report["trace"]
    n_eng = report["spec"]["n_engines"]
    title = f"{tr['requests']} requests, {n_eng} simulated engines (8B / H200 model)"
    view = _router_view(report["spec"].get("link"))
    if view != IDEAL:
        title += f", {view} router view"
    if "seeds" in report:
        title += f"\nmeans of {len(report['seeds'])} seeds; whiskers: their lowest to highest run"
    return title


def plot_report(report: dict, out_dir: str | Path, prefix: str = "sim") -> list[Path]:
    """Write ``{prefix}_ttft_cdf.png``, ``{prefix}_hit_rate.png``, ``{prefix}_load.png``."""
    plt = _plt()
    from matplotlib.ticker import PercentFormatter

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = report["results"]
    tr = report["trace"]
    title = report_title(report)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        t = np.asarray(r["series"]["ttft_s"])
        if len(t):
            ax.plot(t, np.arange(1, len(t) + 1) / len(t), label=r["policy"], lw=1.5)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF — " + title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / f"{prefix}_ttft_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [r["policy"] for r in results]
    dev = [r["hit_rate_device"] for r in results]
    host = [r["hit_rate_host"] for r in results]
    x = np.arange(len(names))
    ax.bar(x, dev, label="device hits", color="tab:blue")
    if any(host):
        ax.bar(x, host, bottom=dev, label="host-tier hits", color="tab:cyan")
    ax.axhline(
        tr["oracle_hit_rate"], color="k", ls="--", lw=1, label="oracle (infinite shared cache)"
    )
    ax.axhline(
        tr["fleet_lru_hit_rate"],
        color="tab:red",
        ls=":",
        lw=1.2,
        label="one shared LRU, fleet capacity",
    )
    for i, r in enumerate(results):
        ax.text(i, r["hit_rate"] + 0.005, f"{r['hit_rate']:.1%}", ha="center", fontsize=8)
    ax.set_xticks(x, names, rotation=25, ha="right", fontsize=8)
    # the axis in % like the bars' labels (the values are fractions)
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0, decimals=0))
    ax.set_ylabel("KV hit rate (% of prompt blocks reused)")
    ax.set_title("Prefix-cache hit rate — " + title, fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    paths.append(out / f"{prefix}_hit_rate.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    shown = _load_panels(results)
    if shown:
        fig, axes = plt.subplots(
            len(shown), 1, figsize=(7, 2.2 * len(shown) + 0.6), sharex=True, squeeze=False
        )
        ymax = max(max(max(s) for s in r["series"]["load"]) for r in shown) or 1
        for ax, r in zip(axes[:, 0], shown, strict=True):
            t = np.asarray(r["series"]["load_t"]) / 60.0
            load = np.asarray(r["series"]["load"])
            for j in range(load.shape[1]):  # engine j has the same colour in every panel
                ax.plot(t, load[:, j], lw=0.8, color=f"C{j % 10}", label=f"engine {j}")
            ax.set_ylim(0, ymax * 1.05)
            ax.set_ylabel("running+waiting", fontsize=8)
            ax.set_title(f"{r['policy']}: requests per engine over time", fontsize=8)
            ax.grid(True, alpha=0.3)
        axes[0, 0].legend(  # four to a row: eight in one ran past the panel's edge
            fontsize=6.5,
            ncol=min(load.shape[1], 4),
            loc="upper left",
            title="colour",
            title_fontsize=7,
        )
        axes[-1, 0].set_xlabel("trace time (min)")
        fig.tight_layout()
        paths.append(out / f"{prefix}_load.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    paths.append(plot_frontier([(title, report)], out / f"{prefix}_frontier.png"))
    return paths


def plot_sweep(sweep: dict, out_dir: str | Path, prefix: str = "sim_sweep") -> list[Path]:
    """Heatmaps of hit rate and TTFT p50 / p99 over the two swept parameters."""
    plt = _plt()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    xs, ys = sweep["x_values"], sweep["y_values"]
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (key, label, fmt) in zip(
        axes,
        (
            ("hit_rate", "hit rate", "{:.1%}"),
            ("ttft_p50_s", "TTFT p50 (s)", "{:.2f}"),
            ("ttft_p99_s", "TTFT p99 (s)", "{:.1f}"),
        ),
        strict=True,
    ):
        grid = np.array(
            [[sweep["grid"][i][j][key] for j in range(len(xs))] for i in range(len(ys))]
        )
        im = ax.imshow(
            grid,
            origin="lower",
            aspect="auto",
            cmap="viridis" if key == "hit_rate" else "viridis_r",
        )
        ax.set_xticks(range(len(xs)), [str(v) for v in xs])
        ax.set_yticks(range(len(ys)), [str(v) for v in ys])
        ax.set_xlabel(sweep["x_name"])
        ax.set_ylabel(sweep["y_name"])
        ax.set_title(label)
        for i in range(len(ys)):
            for j in range(len(xs)):
                ax.text(
                    j, i, fmt.format(grid[i, j]), ha="center", va="center", fontsize=7, color="w"
                )
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle(sweep.get("title", "kv policy sweep"), fontsize=9)
    fig.tight_layout()
    paths.append(out / f"{prefix}.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    if "report" in sweep:  # every sweep point (and the baseline) on the frontier plane
        paths.append(
            plot_frontier(
                [(sweep.get("title", "sweep"), sweep["report"])], out / f"{prefix}_frontier.png"
            )
        )
    return paths


MARKERS = "os^Dv<>pP*Xh"


def _load_panels(results: list[dict]) -> list[dict]:
    """The policies the load plot shows: the demo's (the default routing first), else the
    first three with a load series."""
    pick = {r["policy"]: r for r in results if r["series"]["load"]}
    return [pick[name] for name in DEMO_POLICIES if name in pick] or list(pick.values())[:3]


def _draw_policies(ax, results: list[dict], top: float, names_beside: bool = False) -> None:
    """Each policy's point (its colour and marker by its place in ``results``, so a zoom reads
    with the full view's legend), with whiskers over its runs for a report of several seeds; a
    point above ``top`` is drawn at the top edge with its value written next to it.
    ``names_beside`` writes each name beside its point."""
    by_hits = sorted(range(len(results)), key=lambda i: results[i]["hit_rate"])
    rank = {i: k for k, i in enumerate(by_hits)}
    for i, r in enumerate(results):
        name = r["policy"]
        y = min(r["ttft_p99_s"], top)
        colour = f"C{i % 10}"
        ax.scatter(
            r["hit_rate"],
            y,
            marker=MARKERS[i % len(MARKERS)],
            s=46,
            color=colour,
            label=name if y == r["ttft_p99_s"] else f"{name} (off scale)",
            zorder=3,
        )
        if "over_seeds" in r and y == r["ttft_p99_s"]:
            # a mean over seeds: whiskers from its lowest to its highest run on both axes
            (x_lo, x_hi), (y_lo, y_hi) = (r["over_seeds"][k] for k in ("hit_rate", "ttft_p99_s"))
            ax.errorbar(
                r["hit_rate"],
                y,
                # a mean of equal runs can sit an ulp outside them: no negative whisker
                xerr=[[max(r["hit_rate"] - x_lo, 0.0)], [max(x_hi - r["hit_rate"], 0.0)]],
                yerr=[[max(y - y_lo, 0.0)], [max(y_hi - y, 0.0)]],
                fmt="none",
                ecolor=colour,
                elinewidth=0.9,
                zorder=2,
            )
        if y < r["ttft_p99_s"]:
            ax.annotate(
                f"{r['ttft_p99_s']:.0f} s",
                (r["hit_rate"], y),
                textcoords="offset points",
                xytext=(6, -10),
                fontsize=7,
            )
        elif names_beside:
            # names on staggered levels above and below, in order of hit rate, each tied to its
            # point: close points' names then do not sit on one another
            level = rank[i] % 4
            ax.annotate(
                name,
                (r["hit_rate"], y),
                textcoords="offset points",
                xytext=(-10, (14, -18, 28, -32)[level]),
                fontsize=6.5,
                color=colour,
                arrowprops={"arrowstyle": "-", "color": colour, "lw": 0.5},
            )


def _bound_lines(ax, bound: float, legend: bool) -> None:
    ax.axvline(
        bound, color="k", ls="--", lw=1, label="one shared LRU (fleet memory)" if legend else None
    )
    ax.axvline(0.95 * bound, color="k", ls=":", lw=1, label="95 % of it" if legend else None)


def _over_runs(row: dict, key: str) -> tuple[float, float]:
    """A figure's lowest and highest run (a report of several seeds), else the figure twice."""
    lo, hi = row.get("over_seeds", {}).get(key, (row[key], row[key]))
    return lo, hi


def _near_the_bound(results: list[dict], bound: float) -> list[dict]:
    """The policies a frontier panel zooms on: within 10 % of the bound's hit rate, and of
    those the ones with a TTFT p99 within 10 % of the lowest (where the frontier is decided)."""
    near = [r for r in results if r["hit_rate"] >= 0.9 * bound]
    fastest = min((r["ttft_p99_s"] for r in near), default=0.0)
    return [r for r in near if r["ttft_p99_s"] <= 1.1 * fastest]


def plot_frontier(panels: list[tuple[str, dict]], path: str | Path, title: str = "") -> Path:
    """Hit rate against TTFT p99, one point per policy (or sweep point), one panel per
    ``(label, report)``: the frontier is the lower right. The one-shared-LRU bound is the dashed
    line; 95 % of it the dotted one. A report of several seeds (``kvplug bench --seeds``) draws
    each policy's means with whiskers over its runs' range. A report with two or more policies
    near the bound at about the same TTFT p99 (``_near_the_bound``) gets a zoomed panel beside
    its full view, each policy named, since at the full view's scale they sit on one another;
    when any report has one, each report is a row (full view, zoom)."""
    plt = _plt()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    zooms = []
    for _, report in panels:
        near = _near_the_bound(report["results"], report["trace"]["fleet_lru_hit_rate"])
        zooms.append(near if len(near) >= 2 else None)
    zoomed = any(zooms)
    cols = 2 if zoomed else min(len(panels), 2)
    rows = len(panels) if zoomed else -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 4.6 * rows), squeeze=False)
    # zoomed: each report's full view in the left column, its zoom (if any) beside it
    full_axes = list(axes[:, 0]) if zoomed else list(axes.flat)
    for ax, (label, report) in zip(full_axes, panels, strict=False):
        results = report["results"]
        p99 = [r["ttft_p99_s"] for r in results]
        # a collapsed policy (a queue growing all run) would squash the rest: draw it at the top
        # edge with its value written next to it
        top = 4.0 * float(np.median(p99)) if len(p99) > 2 else max(p99) * 1.1
        _draw_policies(ax, results, top)
        _bound_lines(ax, report["trace"]["fleet_lru_hit_rate"], legend=True)
        ax.set_ylim(0, top * 1.08)
        ax.set_xlabel("KV hit rate (reused prompt blocks / prompt blocks)")
        ax.set_ylabel("TTFT p99 (s)")
        ax.set_title(label, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6.5, loc="best")
    if zoomed:
        for row, ((_, report), zoom) in enumerate(zip(panels, zooms, strict=True)):
            if zoom:
                _draw_zoom(axes[row, 1], report, zoom)
            else:
                axes[row, 1].axis("off")
    else:
        for ax in full_axes[len(panels) :]:
            ax.axis("off")
    if title:
        # at a fixed distance from the top edge, and room for it above the panels' own titles
        # (tight_layout leaves a suptitle out; its default height is a share of a tall figure)
        height = 4.6 * rows
        fig.suptitle(title, fontsize=10, y=1 - 0.08 / height, va="top")
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.32 / height))
    else:
        fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def _draw_zoom(ax, report: dict, zoom: list[dict]) -> None:
    """The zoom on a report's policies near the bound (``zoom``), in the full view's colours and
    markers with each name beside its point, and kv's TTFT p99 as a line (the issue's bar)."""
    results = report["results"]
    bound = report["trace"]["fleet_lru_hit_rate"]
    # the same colours and markers as the full view: the others drawn but outside the limits
    _draw_policies(ax, results, float("inf"), names_beside=True)
    _bound_lines(ax, bound, legend=False)
    lo, hi = zip(*(_over_runs(r, "hit_rate") for r in zoom), strict=True)
    y_lo, y_hi = zip(*(_over_runs(r, "ttft_p99_s") for r in zoom), strict=True)
    kv = [(i, r["ttft_p99_s"]) for i, r in enumerate(results) if r["policy"] == "kv"]
    for i, kv_p99 in kv:  # issue 14's bar: a TTFT p99 no worse than kv's, in kv's colour
        line = ax.axhline(kv_p99, color=f"C{i % 10}", ls="-.", lw=0.8)
        ax.legend([line], ["kv's TTFT p99"], fontsize=6.5, loc="upper right")
    x0, x1 = min(lo), max(max(hi), bound)
    y0 = min([*y_lo, *(p for _, p in kv)])  # kv's line in view wherever it is
    y1 = max([*y_hi, *(p for _, p in kv)])
    dy = (y1 - y0) or 0.02 * abs(y0) or 1.0  # points at one p99 (a sweep): still a range
    ax.set_xlim(x0 - 0.08 * (x1 - x0), x1 + 0.08 * (x1 - x0))
    ax.set_ylim(y0 - 0.1 * dy, y1 + 0.15 * dy)
    ax.set_xlabel("KV hit rate (reused prompt blocks / prompt blocks)")
    ax.set_ylabel("TTFT p99 (s)")
    ax.set_title(
        f"zoomed: {len(zoom)} policies near the bound, at most 10 % over their lowest p99",
        fontsize=9,
    )
    ax.grid(True, alpha=0.3)
