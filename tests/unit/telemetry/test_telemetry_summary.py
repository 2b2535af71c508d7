"""Summary table values and the progress bar."""

import io
import math

from rich.console import Console

from relayrl.telemetry import StepProgress, format_fields, print_summary, summarize, summary_table

HISTORY = [
    {"step": 1, "reward": 0.2, "kl": 0.0},
    {"step": 2, "reward": 0.6, "kl": float("nan")},
    {"step": 3, "reward": 0.1},
    {"step": 4, "reward": 0.5, "kl": 0.3},
]


def test_summarize_hand_computed() -> None:
    stats = summarize(HISTORY, ["reward", "kl", "missing"])
    reward = stats["reward"]
    assert reward["first"] == 0.2 and reward["last"] == 0.5
    assert reward["min"] == 0.1 and reward["max"] == 0.6
    assert math.isclose(reward["mean"], 1.4 / 4)
    # NaN and absent values are skipped.
    assert stats["kl"] == {"first": 0.0, "last": 0.3, "min": 0.0, "max": 0.3, "mean": 0.15}
    assert stats["missing"] == {}


def _cells(table) -> list[list[str]]:
    columns = [list(c.cells) for c in table.columns]
    return [list(row) for row in zip(*columns, strict=True)]


def test_summary_table_cells() -> None:
    table = summary_table(HISTORY, ["reward", "kl", "missing"], title="T")
    assert [c.header for c in table.columns] == ["metric", "first", "last", "min", "max", "mean"]
    assert _cells(table) == [
        ["reward", "0.2", "0.5", "0.1", "0.6", "0.35"],
        ["kl", "0", "0.3", "0", "0.3", "0.15"],
        ["missing", "-", "-", "-", "-", "-"],
    ]
    assert table.title == "T"


def test_summary_table_four_significant_digits() -> None:
    table = summary_table([{"x": 1234.5678}, {"x": 0.000123456}], ["x"])
    assert _cells(table) == [["x", "1235", "0.0001235", "0.0001235", "1235", "617.3"]]


def test_print_summary() -> None:
    buf = io.StringIO()
    print_summary(HISTORY, ["reward"], "Final", console=Console(file=buf, width=100))
    out = buf.getvalue()
    assert "Final" in out and "reward" in out and "0.35" in out


def test_format_fields() -> None:
    assert format_fields({"reward": 0.51234, "pass": 0.75, "step": 3}) == (
        "reward=0.512 pass=0.75 step=3"
    )


def test_step_progress_renders_fields() -> None:
    buf = io.StringIO()
    console = Console(file=buf, width=160, force_terminal=False)
    with StepProgress(10, "grpo", console=console) as bar:
        for step in range(1, 11):
            bar.update(step, reward=step / 10, pass_rate=0.5)
    out = buf.getvalue()
    assert "grpo" in out and "10/10" in out and "reward=1" in out and "pass_rate=0.5" in out


def test_step_progress_disabled_is_silent() -> None:
    with StepProgress(5, "x", enabled=False) as bar:
        bar.update(3, reward=0.1)
    assert bar.last_fields == {"reward": 0.1}
