"""Experiment trackers behind ``MetricsLogger``: TensorBoard, Weights & Biases, MLflow.

``logging.backends`` names the ones a run writes to (``[tensorboard]`` by default). Each gets
the run name and the resolved config when it starts, every step's scalars, and the end-of-run
summary. Everything stays inside the run directory unless asked otherwise:

- ``tensorboard``: event files in ``run_dir/tb``; config and summary as text, summary values
  also as ``summary/*`` scalars at the last step.
- ``wandb``: offline mode by default (``logging.wandb_mode``): the run's files go to
  ``run_dir/wandb/offline-run-*``; no network, no login prompt. Read them back with
  ``wandb leet inspect --json RUN_DIR/wandb/offline-run-...`` (wandb's own offline reader) or
  upload them later with ``wandb sync``. The config is the run's config; the summary goes to
  ``run.summary``.
- ``mlflow``: a file store at ``run_dir/mlruns`` by default (``logging.mlflow_tracking_uri``).
  MLflow 3 refuses the file store unless ``MLFLOW_ALLOW_FILE_STORE=true``; for a ``file:``
  URI this module sets that variable (when unset) for this process. The config is logged as
  flattened params (``algo.kl_coef``, ...) and as the artifact ``config.json``, the summary
  as ``summary/*`` metrics and the artifact ``summary.json``. (The sqlite store would need
  sqlalchemy and alembic, which relayrl does not depend on.) MLflow's usage telemetry is
  turned off (``MLFLOW_DISABLE_TELEMETRY=true`` unless set): a local run sends nothing.

Resume (``resume_step`` > 0): the ids of the tracker runs are kept in ``run_dir/trackers.json``.
TensorBoard purges events past the checkpoint step (``purge_step``); W&B continues the same
run id (offline, each resume is a new ``offline-run-*`` directory of that id: ``wandb sync``
uploads them in order as one run); MLflow continues the same run (status RUNNING again;
values logged past the checkpoint by the interrupted run stay in its history, the resumed
ones are appended at the same steps).

Import cost: wandb and mlflow are imported only when named (their import times are in
docs/measurements.md); the default TensorBoard-only run imports neither.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import string
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BACKENDS",
    "TRACKERS_FILE",
    "MLflowTracker",
    "TensorBoardTracker",
    "Tracker",
    "TrackerError",
    "TrackerOptions",
    "WandbTracker",
    "flatten_config",
    "make_trackers",
]

BACKENDS = ("tensorboard", "wandb", "mlflow")
TRACKERS_FILE = "trackers.json"
"""Ids of the W&B / MLflow runs of a run directory, so a resume continues them."""

_INSTALL = {"wandb": "wandb", "mlflow": "mlflow-skinny"}


class TrackerError(ValueError):
    """A tracker cannot start (package missing, bad option): one line naming the backend."""


@dataclass(frozen=True)
class TrackerOptions:
    """Where the trackers write and under which names (``logging.*`` in the run config).

    ``project`` is the W&B project and the MLflow experiment; ``run_name`` the tracker runs'
    display name (default: the run directory's name)."""

    project: str = "relayrl"
    run_name: str | None = None
    wandb_mode: str = "offline"
    mlflow_tracking_uri: str | None = None


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"algo": {"kl_coef": 0.1}}`` -> ``{"algo.kl_coef": 0.1}`` (lists stay values)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten_config(value, name + "."))
        else:
            out[name] = value
    return out


def _read_state(run_dir: Path) -> dict[str, Any]:
    path = run_dir / TRACKERS_FILE
    if not path.exists():
        return {}
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TrackerError(
            f"{path}: not valid JSON ({e.msg}); remove it to start new tracker runs"
        ) from e
    return state if isinstance(state, dict) else {}


def _write_state(run_dir: Path, state: dict[str, Any]) -> None:
    path = run_dir / TRACKERS_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True), encoding="utf-8")
    tmp.replace(path)


def _import(backend: str) -> Any:
    try:
        if backend == "wandb":
            import wandb

            return wandb
        from mlflow.tracking import MlflowClient

        return MlflowClient
    except ImportError as e:
        raise TrackerError(
            f"logging.backends includes {backend}, but {_INSTALL[backend]} is not installed: "
            "pip install relayrl[trackers]"
        ) from e


class Tracker:
    """One backend. ``log`` takes float scalars of one step; ``close(failed)`` ends the run."""

    name = "tracker"

    def log(self, step: int, values: Mapping[str, float]) -> None:
        raise NotImplementedError

    def log_summary(self, summary: Mapping[str, float], step: int) -> None:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """What a resume needs to continue this tracker's run (saved in ``trackers.json``)."""
        return {}

    def flush(self) -> None:
        pass

    def close(self, failed: bool = False) -> None:
        pass


def _summary_markdown(summary: Mapping[str, float]) -> str:
    rows = "\n".join(f"| {k} | {v:.6g} |" for k, v in summary.items())
    return f"| summary | value |\n|---|---|\n{rows}"


class TensorBoardTracker(Tracker):
    """Scalars in ``run_dir/tb``; config and run name as text (tag ``config``)."""

    name = "tensorboard"

    def __init__(
        self, run_dir: Path, run_name: str, config: Mapping[str, Any] | None, resume_step: int
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter  # heavy import: only when used

        purge = resume_step + 1 if resume_step > 0 else None
        self.writer = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=purge)
        if config is not None and resume_step <= 0:
            text = json.dumps(dict(config), indent=2, default=str)
            self.writer.add_text("config", f"run **{run_name}**\n\n```json\n{text}\n```", 0)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)

    def log_summary(self, summary: Mapping[str, float], step: int) -> None:
        for key, value in summary.items():
            self.writer.add_scalar(f"summary/{key}", value, global_step=step)
        self.writer.add_text("summary", _summary_markdown(summary), step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A W&B run in ``run_dir/wandb`` (offline unless ``wandb_mode: online``)."""

    name = "wandb"

    def __init__(
        self,
        run_dir: Path,
        run_name: str,
        config: Mapping[str, Any] | None,
        opts: TrackerOptions,
        previous: Mapping[str, Any] | None,
    ) -> None:
        wandb = _import("wandb")
        settings = wandb.Settings(
            silent=True,  # no banner, no prompts
            console="off",  # stdout stays ours
            disable_git=True,
            x_disable_stats=True,  # no system-metrics sampler process
            x_disable_machine_info=True,
        )
        run_id = str(previous["id"]) if previous else _new_id()
        self.run = wandb.init(
            dir=str(run_dir),
            mode=opts.wandb_mode,
            project=opts.project,
            name=run_name,
            id=run_id,
            resume="allow" if previous else None,
            config=dict(config) if config is not None else None,
            settings=settings,
            reinit="create_new",
        )
        self.run_id = run_id

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def log_summary(self, summary: Mapping[str, float], step: int) -> None:
        self.run.summary.update({f"summary/{k}": v for k, v in summary.items()})

    def state(self) -> dict[str, Any]:
        return {"id": self.run_id}

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def _new_id() -> str:
    """A W&B run id: 8 random lowercase letters and digits."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


_MLFLOW_BAD_CHARS = re.compile(r"[^0-9A-Za-z_\-. /:]")


class MLflowTracker(Tracker):
    """An MLflow run in experiment ``project`` of ``mlflow_tracking_uri`` (default: the file
    store ``run_dir/mlruns``)."""

    name = "mlflow"
    BATCH = 900  # log_batch takes at most 1000 metrics and 100 params per call

    def __init__(
        self,
        run_dir: Path,
        run_name: str,
        config: Mapping[str, Any] | None,
        opts: TrackerOptions,
        previous: Mapping[str, Any] | None,
    ) -> None:
        uri = opts.mlflow_tracking_uri or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # see the module doc
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no usage pings
        client_cls = _import("mlflow")
        from mlflow.entities import Param

        self.client = client_cls(tracking_uri=uri)
        self.uri = uri
        if previous and previous.get("tracking_uri") == uri:
            self.run_id = str(previous["run_id"])
            self.client.update_run(self.run_id, status="RUNNING")
            return
        exp = self.client.get_experiment_by_name(opts.project)
        exp_id = (
            exp.experiment_id if exp is not None else self.client.create_experiment(opts.project)
        )
        run = self.client.create_run(
            exp_id, run_name=run_name, tags={"relayrl.run_dir": str(run_dir.resolve())}
        )
        self.run_id = run.info.run_id
        if config is not None:
            params = [Param(self._key(k), str(v)[:6000]) for k, v in flatten_config(config).items()]
            for i in range(0, len(params), 100):
                self.client.log_batch(self.run_id, params=params[i : i + 100])
            self.client.log_dict(self.run_id, dict(config), "config.json")

    @staticmethod
    def _key(key: str) -> str:
        return _MLFLOW_BAD_CHARS.sub("_", key)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(self._key(k), v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), self.BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + self.BATCH])

    def log_summary(self, summary: Mapping[str, float], step: int) -> None:
        self.log(step, {f"summary/{k}": v for k, v in summary.items()})
        finite = {k: (v if math.isfinite(v) else None) for k, v in summary.items()}
        self.client.log_dict(self.run_id, finite, "summary.json")

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tracking_uri": self.uri}

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def make_trackers(
    run_dir: Path,
    backends: list[str],
    *,
    run_name: str | None = None,
    config: Mapping[str, Any] | None = None,
    resume_step: int | None = None,
    options: TrackerOptions | None = None,
) -> list[Tracker]:
    """Start one tracker per backend (in ``BACKENDS`` order of the list given).

    A resume (``resume_step`` > 0) continues the W&B / MLflow runs named in
    ``run_dir/trackers.json``; otherwise new runs are started and that file is rewritten."""
    opts = options or TrackerOptions()
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise TrackerError(f"unknown logging backend {unknown[0]!r} (known: {', '.join(BACKENDS)})")
    name = opts.run_name or run_name or run_dir.resolve().name
    resuming = resume_step is not None and resume_step > 0
    previous = _read_state(run_dir) if resuming else {}
    trackers: list[Tracker] = []
    try:
        for backend in dict.fromkeys(backends):
            if backend == "tensorboard":
                trackers.append(TensorBoardTracker(run_dir, name, config, resume_step or 0))
            elif backend == "wandb":
                trackers.append(WandbTracker(run_dir, name, config, opts, previous.get("wandb")))
            else:
                trackers.append(MLflowTracker(run_dir, name, config, opts, previous.get("mlflow")))
    except BaseException:
        for t in trackers:
            t.close(failed=True)
        raise
    if resuming:
        for t in trackers:
            if t.state() and t.state() != previous.get(t.name):
                print(
                    f"{t.name}: no earlier run of it recorded in {TRACKERS_FILE}; started a new one"
                )
    state = {t.name: t.state() for t in trackers if t.state()}
    if state or (run_dir / TRACKERS_FILE).exists():
        _write_state(run_dir, {**previous, **state})
    return trackers
