"""Optional outputs of the planner: Chrome traces (no dependency) and matplotlib figures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["plot_simulations", "write_chrome_trace"]


def write_chrome_trace(
    spans: list[dict[str, Any]], path: str | Path, lane_key: str = "lane"
) -> Path:
    """Write spans ``{lane, name, start, end}`` (seconds) as a Chrome trace (chrome://tracing,
    Perfetto): one row per lane, times in microseconds."""
    lanes: dict[str, int] = {}
    events = []
    for sp in spans:
        lane = str(sp.get(lane_key, sp.get("call", "main")))
        tid = lanes.setdefault(lane, len(lanes) + 1)
        events.append(
            {
                "name": str(sp.get("name", sp.get("call", lane))),
                "ph": "X",
                "pid": 1,
                "tid": tid,
                "ts": float(sp["start"]) * 1e6,
                "dur": max(0.0, float(sp["end"]) - float(sp["start"])) * 1e6,
                "args": {k: v for k, v in sp.items() if k not in ("start", "end")},
            }
        )
    for lane, tid in lanes.items():
        events.append(
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}}
        )
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"traceEvents": events}))
    return p


def plot_simulations(results: list[tuple[str, Any]], out_dir: str | Path) -> list[Path]:
    """Utilisation-over-time and staleness-histogram PNGs for labelled ``SimResult`` s."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for label, r in results:
        ts = [t for t, _ in r.utilisation_timeline]
        us = [u for _, u in r.utilisation_timeline]
        ax.step(ts, us, where="post", label=label)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("running / slots")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    fig.tight_layout()
    p1 = out / "utilisation.png"
    fig.savefig(p1, dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / max(1, len(results))
    for j, (label, r) in enumerate(results):
        total = sum(r.staleness_hist.values()) or 1
        xs = [s + j * width for s in r.staleness_hist]
        ax.bar(xs, [c / total for c in r.staleness_hist.values()], width=width, label=label)
    ax.set_xlabel("token staleness (versions)")
    ax.set_ylabel("share of tokens")
    ax.legend(fontsize=7)
    fig.tight_layout()
    p2 = out / "staleness.png"
    fig.savefig(p2, dpi=120)
    plt.close(fig)
    return [p1, p2]
