"""The first hour (issue 44), the report's timeline of a long run: near-zero weight syncs do not
paint over the training bars, and the legend gives each kind of span its real total."""

from __future__ import annotations

import pytest


def test_near_zero_weight_syncs_do_not_paint_over_a_long_runs_timeline(tmp_path):
    """1000 steps of 1 s training, each followed by a 0.1 ms weight sync: the widened sync
    bars used to cover the whole row; now training's colour fills most of it."""
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from relayrl.telemetry.plots import PHASE_COLOURS, timeline_plot

    spans = []
    for i in range(1000):
        spans += [(i * 1.0001, 1.0, "train"), (i * 1.0001 + 1.0, 1e-4, "weight_sync")]
    png = timeline_plot(tmp_path / "t.png", [("run", {"trainer": spans})])
    pixels = (imread(png)[..., :3] * 255).round().astype(int)

    def count(name: str) -> int:
        rgb = [int(PHASE_COLOURS[name][i : i + 2], 16) for i in (1, 3, 5)]
        return int((abs(pixels - rgb).sum(axis=-1) <= 6).sum())

    assert count("train") > 10 * count("weight_sync")


def test_the_timelines_legend_gives_each_kind_of_span_its_real_total():
    """The widened near-zero bars are labelled with how little time they really took:
    train 1000 x 1 s = 1000 s, weight_sync 1000 x 0.1 ms = 0.1 s, share 0.1 / 1000.1."""
    from relayrl.telemetry.plots import timeline_labels

    spans = [(i * 1.0001, 1.0, "train") for i in range(1000)]
    spans += [(i * 1.0001 + 1.0, 1e-4, "weight_sync") for i in range(1000)]
    runs = [("a", {"trainer": spans}), ("b", {"rollout": [(0.0, 999.9, "generate")]})]
    assert timeline_labels(runs) == {
        "train": "train: 1,000 s (50%)",
        "weight_sync": "weight_sync: 0.1 s (0.005%)",
        "generate": "generate: 1,000 s (50%)",
    }
