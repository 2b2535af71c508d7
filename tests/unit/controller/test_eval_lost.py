"""``trainer._eval_lost``: whether a resumed run evaluates its checkpointed step again (the
background evaluation of that step was pending when the run stopped, and the resume dropped the
later record that would have held it)."""

from __future__ import annotations

from relayrl.config import RunConfig, load_config
from relayrl.controller.trainer import _eval_lost


def _cfg(steps: int = 6, every: int = 2) -> RunConfig:
    return load_config(RunConfig, None, [f"train.steps={steps}", f"train.eval_every={every}"])


def test_a_due_evaluation_with_no_record_is_lost():
    history = [{"step": 0, "eval/pass_rate": 0.5}, {"step": 1}, {"step": 2}]
    assert _eval_lost(_cfg(), 2, history)  # 2 % 2 == 0, 2 < 6, no eval/at_step == 2
    assert _eval_lost(_cfg(), 4, history)


def test_a_recorded_or_not_due_evaluation_is_not():
    cfg = _cfg()
    assert not _eval_lost(cfg, 2, [{"step": 2, "eval/at_step": 2.0}])  # logged by step 2
    assert not _eval_lost(cfg, 3, [])  # 3 % 2 != 0: none was due
    assert not _eval_lost(cfg, 0, [])  # a fresh start evaluates step 0 anyway
    assert not _eval_lost(cfg, 6, [])  # the last step: the final evaluation, not a background one
    assert not _eval_lost(_cfg(every=0), 2, [])  # no periodic evaluation
