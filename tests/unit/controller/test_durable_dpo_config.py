"""``relayrl dpo`` (controller/dpo.py) writes its ``config.yaml`` through the RL run's
``record_config``: fsynced before its rename, the run directory after it, and a changed
config kept as ``config.prev-N.yaml``."""

from __future__ import annotations

import pytest

from fsync_log import at, fsynced, record
from relayrl.config import RunConfig
from relayrl.controller import dpo


class _Stop(Exception):
    """Raised where the test has seen what it needs (before any model is loaded)."""


def _cfg(run_dir, seed: int) -> RunConfig:
    algo = {"name": "dpo", "kl_coef": 0.1}
    return RunConfig.model_validate(
        {"model": {"path": "unused"}, "run_dir": str(run_dir), "algo": algo, "seed": seed}
    )


def _stop(cfg: RunConfig) -> None:
    raise _Stop


def test_dpos_config_yaml_is_written_durably_and_a_changed_one_kept(tmp_path, monkeypatch):
    run = tmp_path / "runs" / "dpo"
    monkeypatch.setattr(dpo, "_load_pairs", _stop)
    log = record(monkeypatch)
    with pytest.raises(_Stop):
        dpo.train_dpo(_cfg(run, 1))
    path = run / "config.yaml"
    tmp = next(e[1] for e in log if e[0] == "replace" and e[2] == str(path.resolve()))
    placed = at(log, "replace", tmp, path)
    assert tmp in fsynced(log[:placed])
    assert str(run.resolve()) in fsynced(log[placed:])
    assert str((tmp_path / "runs").resolve()) in fsynced(log[:placed])  # the new run_dir
    with pytest.raises(_Stop):
        dpo.train_dpo(_cfg(run, 2))
    assert "seed: 1" in (run / "config.prev-1.yaml").read_text()
    assert "seed: 2" in path.read_text()
