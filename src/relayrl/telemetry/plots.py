"""PNG plots of training runs: one figure per quantity, every run on the same axes.

Needs matplotlib (``pip install relayrl[plots]``); ``require_matplotlib`` says so in one line.
Figures are drawn with ``matplotlib.figure.Figure`` (no pyplot, no global state, no display).
Each run keeps one colour in every figure; held-out evals are dashed with markers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "PHASE_COLOURS",
    "PlotsUnavailable",
    "Series",
    "line_plot",
    "require_matplotlib",
    "time_split_plot",
    "timeline_plot",
]

DPI = 120
RUN_COLOURS = [
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#7f7f7f",
    "#bcbd22",
]
PHASE_COLOURS = {
    "generate": "#4c72b0",
    "score": "#dd8452",
    "train": "#55a868",
    "weight_sync": "#c44e52",
    "wait": "#8172b3",
    "checkpoint": "#937860",
    "other": "#bbbbbb",
}


class PlotsUnavailable(ImportError):
    """matplotlib is not installed."""


def require_matplotlib() -> Any:
    """The ``matplotlib.figure`` module, or ``PlotsUnavailable`` naming the extra to install."""
    try:
        import matplotlib.figure
    except ImportError as e:
        raise PlotsUnavailable(
            "relayrl report draws its plots with matplotlib, which is not installed: "
            "pip install relayrl[plots]"
        ) from e
    return matplotlib.figure


def run_colour(index: int) -> str:
    return RUN_COLOURS[index % len(RUN_COLOURS)]


@dataclass
class Series:
    """One line: x and y values (NaN gaps allowed), its legend label and look."""

    x: Sequence[float]
    y: Sequence[float]
    label: str
    colour: str
    style: str = "-"
    marker: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _smooth(values: Sequence[float], k: int) -> list[float]:
    """Trailing moving average over the finite values of the last ``k`` points."""
    out = []
    for i in range(len(values)):
        window = [v for v in values[max(0, i - k + 1) : i + 1] if math.isfinite(v)]
        out.append(math.fsum(window) / len(window) if window else math.nan)
    return out


def line_plot(
    path: Path,
    series: Sequence[Series],
    title: str,
    ylabel: str,
    xlabel: str = "training step",
    ylim: tuple[float | None, float | None] | None = None,
    percent: bool = False,
    smooth_over: int = 40,
) -> Path:
    """Lines of ``series`` on one axes. Series longer than ``smooth_over`` points are drawn
    faint with a moving average (window n/20) over them, so trends stay readable."""
    figure = require_matplotlib()
    fig = figure.Figure(figsize=(8.6, 3.8), dpi=DPI)
    ax = fig.subplots()
    for s in series:
        n = len(s.y)
        if n > smooth_over and s.marker is None:
            ax.plot(s.x, s.y, s.style, color=s.colour, alpha=0.25, linewidth=0.8)
            k = max(2, n // 20)
            ax.plot(s.x, _smooth(s.y, k), s.style, color=s.colour, label=f"{s.label} (avg {k})")
        else:
            marker = s.marker or ("o" if n <= 12 else None)
            ax.plot(s.x, s.y, s.style, color=s.colour, marker=marker, markersize=4, label=s.label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    if percent:
        from matplotlib.ticker import PercentFormatter

        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if series:  # beside the axes: never over the data
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path)
    return path


def time_split_plot(
    path: Path, runs: Sequence[tuple[str, list[int], dict[str, list[float]]]]
) -> Path:
    """Stacked bars of seconds per step by phase, one panel per run, shared y axis.

    ``runs``: (name, steps, {phase: seconds per step}), phases in stacking order."""
    figure = require_matplotlib()
    from matplotlib.ticker import MaxNLocator

    cols = min(len(runs), 3)
    rows = math.ceil(len(runs) / cols)
    fig = figure.Figure(figsize=(4.4 * cols + 1.6, 3.4 * rows), dpi=DPI)
    axes = fig.subplots(rows, cols, sharey=True, squeeze=False)
    handles: dict[str, Any] = {}
    for i, (name, steps, phases) in enumerate(runs):
        ax = axes[i // cols][i % cols]
        bottom = [0.0] * len(steps)
        gap = min((b - a for a, b in zip(steps, steps[1:], strict=False)), default=1)
        width = (1.0 if len(steps) > 60 else 0.8) * gap  # many steps: bars touch
        for phase, secs in phases.items():
            vals = [v if math.isfinite(v) else 0.0 for v in secs]
            colour = PHASE_COLOURS.get(phase, "#333333")
            bars = ax.bar(steps, vals, width, bottom=bottom, color=colour, label=phase, linewidth=0)
            handles.setdefault(phase, bars)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if i % cols == 0:
            ax.set_ylabel("seconds per step")
        ax.grid(alpha=0.3, axis="y")
    for j in range(len(runs), rows * cols):
        axes[j // cols][j % cols].set_visible(False)
    order = sorted(
        handles, key=lambda p: list(PHASE_COLOURS).index(p) if p in PHASE_COLOURS else 99
    )
    fig.legend([handles[p] for p in order], order, loc="center right", fontsize=8, title="phase")
    fig.suptitle("Where each step's time went (trainer's view)")
    fig.tight_layout(rect=(0, 0, 1 - 1.3 / (4.4 * cols + 1.6), 1))
    fig.savefig(path)
    return path


def timeline_labels(
    runs: Sequence[tuple[str, dict[str, list[tuple[float, float, str]]]]],
) -> dict[str, str]:
    """Legend label per span name: the name, its real total duration over every run and role
    (seconds: whole ones from 100 s, else 3 significant digits) and its share of all the
    spans' time, e.g. ``weight_sync: 0.1 s (0.005%)``. The bars of near-zero spans are widened
    to stay visible; the label says how little time they really took."""
    totals: dict[str, float] = {}
    for _, roles in runs:
        for spans in roles.values():
            for _, dur, span in spans:
                totals[span] = totals.get(span, 0.0) + dur
    whole = sum(totals.values()) or 1.0

    def secs(v: float) -> str:
        return f"{v:,.0f} s" if v >= 100 else f"{v:.3g} s"

    return {k: f"{k}: {secs(v)} ({100 * v / whole:.2g}%)" for k, v in totals.items()}


def timeline_plot(
    path: Path, runs: Sequence[tuple[str, dict[str, list[tuple[float, float, str]]]]]
) -> Path:
    """Gantt chart per run: one row per role, a bar per span (start s, duration s, name),
    coloured by span name; shared x axis in seconds since the run's first span.

    A span shorter than a pixel is widened to one, so that it stays visible, but the shorter
    a kind of span really is, the lower it is drawn: on a long run the thousands of near-zero
    weight syncs show only in the gaps between the phases that take the time, instead of
    painting over them; the legend gives each kind's real total (``timeline_labels``)."""
    figure = require_matplotlib()
    fig = figure.Figure(figsize=(8.5, 1.0 + 1.6 * len(runs)), dpi=DPI)
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False)
    handles: dict[str, Any] = {}
    extent = max((s + d for _, roles in runs for v in roles.values() for s, d, _ in v), default=1)
    min_w = extent / 700  # a sub-millisecond span stays visible (about one pixel)
    for i, (name, roles) in enumerate(runs):
        ax = axes[i][0]
        order = sorted(roles)
        for row, role in enumerate(order):
            by_name: dict[tuple[str, bool], list[tuple[float, float, float]]] = {}
            for start, dur, span in roles[role]:
                by_name.setdefault((span, dur < min_w), []).append((start, max(dur, min_w), dur))
            for (span, widened), bars in by_name.items():
                colour = PHASE_COLOURS.get(span, "#333333")
                typical = sorted(d for _, _, d in bars)[len(bars) // 2]  # the real median
                h = ax.broken_barh(
                    [(s, w) for s, w, _ in bars],
                    (row - 0.38, 0.76),
                    facecolors=colour,
                    label=span,
                    zorder=1 + typical / min_w if widened else 2,  # shorter: lower
                )
                handles.setdefault(span, h)
        ax.set_yticks(range(len(order)), order)
        ax.set_ylim(-0.6, len(order) - 0.4)
        ax.set_title(name, fontsize=10, loc="left")
        ax.grid(alpha=0.3, axis="x")
    axes[-1][0].set_xlabel("wall time since the first span (s)")
    labels = timeline_labels(runs)
    fig.legend(
        list(handles.values()),
        [labels[k] for k in handles],
        loc="upper right",
        fontsize=8,
        ncols=min(len(handles), 3),
    )
    fig.suptitle("Timeline: what each role was doing", x=0.02, ha="left")
    legend_rows = -(-len(handles) // 3)
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.05 + 0.2 * legend_rows) / fig.get_figheight()))
    fig.savefig(path)
    return path
