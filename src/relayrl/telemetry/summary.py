"""End-of-run summary: first / last / min / max / mean of chosen metrics."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["eval_table", "print_summary", "summarize", "summary_scalars", "summary_table"]

STATS = ("first", "last", "min", "max", "mean")


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    x = float(value)
    return x if math.isfinite(x) else None


def summarize(history: list[dict[str, Any]], keys: list[str]) -> dict[str, dict[str, float]]:
    """Per key, the first / last / min / max / mean of its finite values in step order
    of ``history``. Records without the key, and NaN / inf / null values, are skipped; a
    key with no values maps to ``{}``."""
    out: dict[str, dict[str, float]] = {}
    for key in keys:
        values = [x for r in history if (x := _finite(r.get(key))) is not None]
        if not values:
            out[key] = {}
            continue
        out[key] = {
            "first": values[0],
            "last": values[-1],
            "min": min(values),
            "max": max(values),
            "mean": math.fsum(values) / len(values),
        }
    return out


def summary_scalars(history: list[dict[str, Any]], keys: list[str]) -> dict[str, float]:
    """``summarize`` flattened for a tracker: ``{"reward_mean/last": ..., ...}`` (keys with
    no finite value are left out)."""
    return {
        f"{key}/{stat}": value
        for key, stats in summarize(history, keys).items()
        for stat, value in stats.items()
    }


def eval_table(rows: dict[str, dict[str, float]], title: str | None = None) -> Table:
    """A rich table of ``relayrl eval``: one row per dataset, columns prompts, n, pass@k and
    maj@k (ascending k, as percentages), mean reward."""
    keys: list[str] = []
    for metrics in rows.values():
        keys += [k for k in metrics if k.startswith(("pass@", "maj@")) and k not in keys]
    keys.sort(key=lambda k: (k.split("@")[0] != "pass", int(k.split("@")[1])))
    table = Table(title=title)
    table.add_column("dataset", style="bold")
    table.add_column("prompts", justify="right")
    table.add_column("n", justify="right")
    for key in keys:
        table.add_column(key, justify="right")
    table.add_column("reward mean", justify="right")
    for name, m in rows.items():
        cells = [f"{100 * m[k]:.1f}%" if k in m else "-" for k in keys]
        table.add_row(
            name, f"{m['prompts']:.0f}", f"{m['n']:.0f}", *cells, _fmt(m.get("reward_mean"))
        )
    return table


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def summary_table(
    history: list[dict[str, Any]], keys: list[str], title: str | None = None
) -> Table:
    """A rich table, one row per key: metric, first, last, min, max, mean (4 significant
    digits; ``-`` when the key has no finite value)."""
    table = Table(title=title)
    table.add_column("metric", style="bold")
    for stat in STATS:
        table.add_column(stat, justify="right")
    for key, stats in summarize(history, keys).items():
        table.add_row(key, *(_fmt(stats.get(stat)) for stat in STATS))
    return table


def print_summary(
    history: list[dict[str, Any]],
    keys: list[str],
    title: str = "Run summary",
    console: Console | None = None,
) -> None:
    """Print ``summary_table`` to ``console`` (rich's default console when None)."""
    (console or Console()).print(summary_table(history, keys, title=title))
