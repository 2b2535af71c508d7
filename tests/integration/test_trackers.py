"""Experiment trackers for real: a GRPO run logged to TensorBoard, W&B (offline) and MLflow
(a local file store), every scalar read back from each backend's own files / API; then a
resume that continues the same tracker runs."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_config
from relayrl.cluster.local import build_local_roles
from relayrl.config import ConfigError, RunConfig, load_config
from relayrl.controller.trainer import train
from relayrl.model import build_tiny_model
from relayrl.telemetry import read_metrics
from relayrl.telemetry.summary import summary_scalars
from relayrl.telemetry.trackers import TRACKERS_FILE, TrackerError, flatten_config, make_trackers

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None or importlib.util.find_spec("mlflow") is None,
    reason="needs relayrl[trackers]",
)

TINY = [
    "algo.prompts_per_step=2",
    "algo.group_size=2",
    "rollout.max_tokens=4",
    "data.eval_size=2",
    "logging.backends=[tensorboard,wandb,mlflow]",
    "logging.tensorboard=true",
    "logging.run_name=tracked",
]


def _train(cfg: RunConfig, resume: bool = False) -> dict:
    return train(cfg, lambda a, c: build_local_roles(cfg, a, c), resume=resume)


def _tensorboard(run_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value}, the last event file's value winning (as TensorBoard shows it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def _wandb_records(offline_run: Path) -> list[dict]:
    """The records of an offline run, read by wandb's own reader (``wandb leet inspect``)."""
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(offline_run)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def _wandb_history(records: list[dict]) -> dict[str, dict[int, float]]:
    hist: dict[str, dict[int, float]] = {}
    for r in records:
        if r["type"] == "history":
            step = int(r["history"]["step"]["num"])
            for k, v in r["history"]["item"].items():
                if not k.startswith("_"):
                    hist.setdefault(k, {})[step] = v
    return hist


def _same(a: float, b: float | None) -> bool:
    if b is None or isinstance(b, str):  # NaN may come back as a string or null
        return math.isnan(a)
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9) or (math.isnan(a) and math.isnan(b))


def test_grpo_run_logged_to_all_three_backends_and_resumed(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "m", hidden_size=16, seed=0)
    run_dir = tmp_path / "run"
    cfg = run_config(model, run_dir, "train.steps=2", *TINY)
    result = _train(cfg)

    logged = read_metrics(run_dir)
    by_step: dict[int, dict] = {}
    for rec in logged:
        by_step.setdefault(rec["step"], {}).update(rec)
    assert sorted(by_step) == [0, 1, 2]
    scalars = {(s, k): v for s, rec in by_step.items() for k, v in rec.items() if k != "step"}
    assert len(scalars) > 50  # rewards, losses, KL, timings, eval ...

    # TensorBoard: every logged scalar at its step, and the summary
    tb = _tensorboard(run_dir)
    for (step, key), value in scalars.items():
        assert _same(value, tb[key][step]), (key, step)
    assert _same(result["eval_after"], tb["summary/eval_after"][2])

    # W&B offline: history, config, run name and summary from the .wandb file
    state = json.loads((run_dir / TRACKERS_FILE).read_text())
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{state['wandb']['id']}"))
    assert len(runs) == 1
    records = _wandb_records(runs[0])
    hist = _wandb_history(records)
    for (step, key), value in scalars.items():
        assert _same(value, hist[key].get(step)), (key, step)
    run_rec = next(r["run"] for r in records if r["type"] == "run")
    assert run_rec["display_name"] == "tracked"
    config = run_rec["config"]["update"]
    assert config["algo"]["group_size"] == 2 and config["train"]["steps"] == 2
    summary: dict = {}
    for r in records:
        if r["type"] == "summary":
            summary.update(r["summary"].get("update", {}))
    assert _same(result["eval_after"], summary["summary/eval_after"])
    assert "summary/reward_mean/mean" in summary

    # MLflow: the client API on the file store
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=state["mlflow"]["tracking_uri"])
    run_id = state["mlflow"]["run_id"]
    run = client.get_run(run_id)
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert run.data.params["algo.group_size"] == "2"
    for key in {k for _, k in scalars}:
        history = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        for (step, k), value in scalars.items():
            if k == key:
                assert _same(value, history.get(step)), (key, step)
    assert _same(result["eval_after"], run.data.metrics["summary/eval_after"])

    # Resume to step 3: the same W&B id (a second offline fragment) and the same MLflow run
    cfg3 = run_config(model, run_dir, "train.steps=3", *TINY)
    _train(cfg3, resume=True)
    state3 = json.loads((run_dir / TRACKERS_FILE).read_text())
    assert state3 == state
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{state['wandb']['id']}"))
    assert len(runs) == 2
    assert 3 in _wandb_history(_wandb_records(runs[1]))["reward_mean"]
    steps = {m.step for m in client.get_metric_history(run_id, "reward_mean")}
    assert steps == {1, 2, 3}
    assert client.get_run(run_id).info.status == "FINISHED"
    assert 3 in _tensorboard(run_dir)["reward_mean"]


def test_backend_errors_are_one_line_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="logging.backends"):
        load_config(RunConfig, None, ["logging.backends=[tensorboard,neptune]"])
    with pytest.raises(TrackerError, match="unknown logging backend 'comet'"):
        make_trackers(tmp_path, ["comet"])
    (tmp_path / TRACKERS_FILE).write_text("{not json")
    with pytest.raises(TrackerError, match=TRACKERS_FILE):
        make_trackers(tmp_path, [], resume_step=3)


def test_flatten_config() -> None:
    flat = flatten_config({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}, "f": None})
    assert flat == {"a.b": 1, "a.c.d": [1, 2], "e": {}, "f": None}


def test_tensorboard_off_keeps_the_older_switch() -> None:
    cfg = load_config(RunConfig, None, ["logging.backends=[tensorboard,mlflow]"])
    assert cfg.logging.active_backends == ["tensorboard", "mlflow"]
    cfg = load_config(
        RunConfig, None, ["logging.backends=[tensorboard,mlflow]", "logging.tensorboard=false"]
    )
    assert cfg.logging.active_backends == ["mlflow"]
    assert load_config(RunConfig, None, []).logging.active_backends == ["tensorboard"]


def test_summary_scalars_flatten_the_run_summary() -> None:
    history = [{"step": 1, "a": 1.0}, {"step": 2, "a": 3.0, "b": math.nan}, {"step": 3, "a": 2.0}]
    got = summary_scalars(history, ["a", "b"])
    assert got == {"a/first": 1.0, "a/last": 2.0, "a/min": 1.0, "a/max": 3.0, "a/mean": 2.0}
