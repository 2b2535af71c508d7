"""The ``logging`` section: trackers and progress."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from relayrl.config.base import (
    KeyProblem,
    _Strict,
)

Tracker = Literal["tensorboard", "wandb", "mlflow"]


def _default_trackers() -> list[Tracker]:
    return ["tensorboard"]


class LoggingConfig(_Strict):
    backends: list[Tracker] = Field(default_factory=_default_trackers)
    """Experiment trackers the run writes to besides ``metrics.jsonl`` (``wandb``: offline in
    ``run_dir/wandb``; ``mlflow``: a file store in ``run_dir/mlruns``; see
    ``relayrl.telemetry.trackers``). ``wandb`` / ``mlflow`` need ``relayrl[trackers]``."""
    tensorboard: bool = True
    """``false`` drops ``tensorboard`` from ``backends`` (the older switch)."""
    run_name: str | None = None
    """The trackers' run name (null: the run directory's name)."""
    project: str = "relayrl"
    """The W&B project and the MLflow experiment."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """``online`` uploads as the run goes (needs ``wandb login`` or ``WANDB_API_KEY``)."""
    mlflow_tracking_uri: str | None = None
    """null: the file store ``run_dir/mlruns``."""
    progress: bool = True
    progress_interval_s: float | None = Field(None, gt=0)
    """Seconds between plain progress lines when the output is not a terminal (CI, nohup, a
    cluster job; null: ``$RELAYRL_PROGRESS_INTERVAL_S``, default 30). The same lines always go
    to ``run_dir/progress.log``."""

    @model_validator(mode="after")
    def _trackers_installed(self) -> LoggingConfig:
        import importlib.util

        for backend, module in (("wandb", "wandb"), ("mlflow", "mlflow")):
            if backend in self.backends and importlib.util.find_spec(module) is None:
                raise KeyProblem(
                    "backends",
                    self.backends,
                    f"{backend} is not installed: pip install relayrl[trackers]",
                )
        return self

    @property
    def active_backends(self) -> list[str]:
        """``backends`` without repeats, less ``tensorboard`` when ``tensorboard`` is off."""
        return [b for b in dict.fromkeys(self.backends) if b != "tensorboard" or self.tensorboard]
