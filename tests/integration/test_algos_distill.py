"""On-policy distillation (``algo.distill``): the teacher's per-token reverse-KL signal as an
advantage term or a loss term, and a run that loads the teacher by path."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import run_config
from relayrl.cluster.local import build_local_roles
from relayrl.config import RunConfig, load_config
from relayrl.controller.algorithms import distill_from_teacher
from relayrl.controller.trainer import train
from relayrl.model import build_tiny_model
from relayrl.rollout.types import Sample
from relayrl.workers import Experience
from relayrl.workers.teacher import load_teacher


def _exp() -> Experience:
    # two samples: behaviour logprobs [-1, -2] and [-0.5]
    samples = [
        Sample(0, [1, 2], [3, 4], [-1.0, -2.0], [0, 0], "stop", group_id=0),
        Sample(1, [1, 2], [5], [-0.5], [0], "stop", group_id=0),
    ]
    exp = Experience.from_samples(samples, pad_id=0)
    exp.advantages = torch.tensor([[1.0, 1.0], [-1.0, 0.0]])
    return exp


class _Teacher:
    def compute_logprobs(self, exp: Experience) -> torch.Tensor:
        return torch.tensor([[-1.5, -1.0], [-0.5, 0.0]]) * exp.response_mask


@pytest.mark.parametrize(
    "overrides, expected",
    [
        # d = student - teacher = [[0.5, -1], [0, -]]; A - 2 d
        ([], [[0.0, 3.0], [-1.0, 0.0]]),
        (["algo.distill.task_reward=false"], [[-1.0, 2.0], [0.0, 0.0]]),
        (["algo.distill.mode=loss"], [[1.0, 1.0], [-1.0, 0.0]]),  # advantages untouched
    ],
)
def test_reverse_kl_signal(overrides, expected) -> None:
    cfg = load_config(
        RunConfig, None, ["algo.distill.teacher_path=t", "algo.distill.coef=2", *overrides]
    )
    exp = _exp()
    roles = SimpleNamespace(teacher=_Teacher())
    distill_from_teacher(roles, exp, cfg)  # type: ignore[arg-type]
    torch.testing.assert_close(exp.advantages, torch.tensor(expected))
    assert exp.teacher_logprobs is not None


def test_missing_teacher_names_the_key(tmp_path) -> None:
    cfg = load_config(RunConfig, None, [f"algo.distill.teacher_path={tmp_path / 'none'}"])
    with pytest.raises(ValueError) as err:
        load_teacher(cfg)
    assert str(err.value) == (
        f"algo.distill.teacher_path: model directory not found: {tmp_path / 'none'}"
    )


@pytest.mark.parametrize("mode", ["reward", "loss"])
def test_a_run_distils_from_a_teacher_directory(tmp_path: Path, mode: str) -> None:
    student = build_tiny_model(tmp_path / "student", hidden_size=16, seed=0)
    teacher = build_tiny_model(tmp_path / "teacher", hidden_size=32, seed=1)
    cfg = run_config(
        student, tmp_path / "run", "train.steps=2", "algo.prompts_per_step=4",
        "algo.group_size=4", "algo.mini_batches=1", "data.eval_size=8", "rollout.max_tokens=4",
        f"algo.distill.teacher_path={teacher}", f"algo.distill.mode={mode}",
    )  # fmt: skip
    out = train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    # two random models disagree: the reverse-KL estimate is logged and moves the student
    assert out["distill/reverse_kl"] != 0.0
    assert out["actor/grad_norm"] > 0.0


@pytest.mark.parametrize("name, extra", [("ppo", ()), ("dpo", ("algo.kl_coef=0.1",))])
def test_distillation_outside_grpo_is_a_config_error(name: str, extra: tuple[str, ...]) -> None:
    from relayrl.config import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, [f"algo.name={name}", "algo.distill.teacher_path=t", *extra])
    assert str(err.value) == (
        "command line: bad value for 'algo.distill.teacher_path' ('t'): on-policy "
        "distillation runs with algo.name 'grpo' (GRPO-style advantages, with or without the "
        f"task reward); {name!r} does not read algo.distill"
    )
