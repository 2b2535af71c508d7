"""MetricsLogger / read_metrics: JSONL round trip, NaN handling, TensorBoard events, resume."""

import ast
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import relayrl.telemetry
from relayrl.telemetry import MetricsLogger, read_metrics


def test_jsonl_round_trip_without_tensorboard(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path / "run", tensorboard=False) as logger:
        logger.log(1, {"reward_mean": 0.5, "pass_rate": 1, "kl": np.float32(0.25)})
        logger.log(2, {"reward_mean": torch.tensor(0.75), "len_max": np.int64(12)})
        # Lines are flushed at once: readable before close.
        assert len(read_metrics(tmp_path / "run")) == 2
        assert logger.history == [
            {"step": 1, "reward_mean": 0.5, "pass_rate": 1.0, "kl": 0.25},
            {"step": 2, "reward_mean": 0.75, "len_max": 12.0},
        ]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"step": 1, "reward_mean": 0.5, "pass_rate": 1.0, "kl": 0.25},
        {"step": 2, "reward_mean": 0.75, "len_max": 12.0},
    ]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows == logger.history
    assert all(type(v) is float for r in rows for k, v in r.items() if k != "step")
    assert all(type(r["step"]) is int for r in rows)
    assert not (tmp_path / "run" / "tb").exists()


def test_nan_and_inf_written_as_null(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(0, {"a": float("nan"), "b": float("inf"), "c": np.float64("nan"), "d": 1.0})
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line) == {"step": 0, "a": None, "b": None, "c": None, "d": 1.0}
    assert "NaN" not in line and "Infinity" not in line
    (row,) = read_metrics(tmp_path)
    assert math.isnan(row["a"]) and math.isnan(row["b"]) and row["d"] == 1.0


def test_tensorboard_event_file(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=True) as logger:
        for step in range(3):
            logger.log(step, {"reward_mean": step / 2, "kl": np.float32(0.1)})
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"reward_mean", "kl"}
    scalars = acc.Scalars("reward_mean")
    assert [(s.step, s.value) for s in scalars] == [(0, 0.0), (1, 0.5), (2, 1.0)]


@pytest.mark.parametrize(
    ("metrics", "error", "fragment"),
    [
        ({"a": "1.0"}, TypeError, "'a'"),
        ({"a": None}, TypeError, "'a'"),
        ({"a": [1.0]}, TypeError, "'a'"),
        ({"a": torch.ones(2)}, TypeError, "'a'"),
        ({"step": 1.0}, ValueError, "reserved"),
        ({1: 1.0}, TypeError, "1"),
    ],
)
def test_bad_metrics_rejected(tmp_path: Path, metrics: dict, error: type, fragment: str) -> None:
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        with pytest.raises(error, match=fragment):
            logger.log(1, metrics)
    assert read_metrics(tmp_path) == []


def test_step_types(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(np.int64(3), {"a": 1.0})
        for bad in (1.5, True, "3"):
            with pytest.raises(TypeError, match="step"):
                logger.log(bad, {"a": 1.0})  # type: ignore[arg-type]
    assert read_metrics(tmp_path) == [{"step": 3, "a": 1.0}]


def test_log_after_close_raises(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.close()
    logger.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(1, {"a": 1.0})


def test_reopen_appends_and_resume_drops_later_steps(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(1, 6):
            logger.log(step, {"a": float(step)})
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        assert [r["step"] for r in logger.history] == [1, 2, 3, 4, 5]
        logger.log(6, {"a": 6.0})
    # Resume from a checkpoint at step 3: steps 4..6 of the interrupted run are dropped.
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=3) as logger:
        assert [r["step"] for r in logger.history] == [1, 2, 3]
        logger.log(4, {"a": 40.0})
    assert read_metrics(tmp_path) == [
        {"step": 1, "a": 1.0},
        {"step": 2, "a": 2.0},
        {"step": 3, "a": 3.0},
        {"step": 4, "a": 40.0},
    ]


def test_torn_last_line_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a"')
    with pytest.warns(UserWarning, match="line 2 is torn"):
        assert read_metrics(tmp_path) == [{"step": 1, "a": 1.0}]
    with pytest.warns(UserWarning, match="line 2 is torn"):  # its read of what is there
        with MetricsLogger(tmp_path, tensorboard=False) as logger:
            logger.log(2, {"a": 2.0})
    assert read_metrics(tmp_path) == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}]


def test_corrupt_middle_line_raises(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(tmp_path)


def test_telemetry_imports_only_utilities() -> None:
    allowed = {"__future__", "json", "math", "operator", "pathlib", "typing", "numpy", "rich"}
    allowed |= {"torch", "tensorboard", "collections", "relayrl", "threading", "time", "contextlib"}
    allowed |= {"os"}  # progress.py: the interval of plain progress lines from the environment
    allowed |= {"logging", "statistics"}  # mismatch.py: the warning when the mismatch jumps
    allowed |= {"re", "secrets", "string", "dataclasses", "wandb", "mlflow"}  # trackers.py
    allowed |= {"matplotlib", "yaml"}  # plots.py, report.py (config.yaml of a run)
    allowed |= {"functools", "sys", "warnings"}  # host_syncs.py: counting CUDA sync warnings
    for path in Path(relayrl.telemetry.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"
                if name.startswith("relayrl") and name != "relayrl.durable":  # the base module
                    assert name.startswith("relayrl.telemetry"), f"{path.name} imports {name}"
