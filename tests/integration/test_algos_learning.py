"""Each 2025 policy loss trains the tiny model, and on-policy distillation moves a weak
student towards its teacher (60 GRPO steps from the SFT fixture, the settings of
``test_train_integration``). All are ``slow`` (one to three minutes each on 2 busy cores): with
ATEN_CPU_CAPABILITY=avx2 the SFT fixture stops at 0.40 and GSPO (clip 0.2 on the sequence
ratio) then gained -0.005 on seed 0, too fragile for the default run on other CPUs; the
default run trains every loss end to end in ``test_algos_train``.

Held-out greedy pass rate after 60 steps, seeds 0 / 1 / 2 (RELAYRL_TEST_SEED; from 0.315 /
0.41 / 0.37): ppo 0.47 / 0.75 / 0.545; gspo 0.43 / 0.69 / 0.49; gspo_token 0.43 / 0.675 /
0.505; sapo 0.425 / 0.715 / 0.44; gmpo 0.465 / 0.715 / 0.525; cispo at the default lr 5e-4
0.27 / 0.62 / 0.465, at lr 2.5e-4 0.48 / 0.75 / 0.495. Gains min / median: gspo 0.115 /
0.12, gspo_token 0.115 / 0.135, sapo 0.07 / 0.11, gmpo 0.15 / 0.155, cispo (lr 2.5e-4)
0.125 / 0.165; each test asserts about half its worst run's gain."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import ARITH, TEST_SEED, run_config
from relayrl.cluster.local import build_local_roles
from relayrl.config import ArithmeticConfig, DataConfig, SFTConfig
from relayrl.controller.sft import run_sft
from relayrl.controller.trainer import train
from relayrl.data.prompts import PromptSource
from relayrl.model import build_tiny_model, load_tokenizer


def _run(model: Path, run_dir: Path, *overrides: str) -> dict:
    cfg = run_config(model, run_dir, "train.steps=60", "data.eval_size=200", *overrides)
    return train(cfg, lambda a, c: build_local_roles(cfg, a, c))


@pytest.mark.slow
@pytest.mark.learning
def test_gspo_raises_held_out_pass_rate(sft_model, tmp_path, outcome):
    """GSPO (sequence-level clip) instead of PPO-clip in GRPO: gain min 0.115 over seeds 0-2."""
    out = _run(sft_model, tmp_path / "gspo", "algo.policy_loss=gspo")
    outcome(before=out["eval_before"], after=out["eval_after"])
    assert out["eval_after"] >= out["eval_before"] + 0.05, out


@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.parametrize(
    "loss, overrides, margin",
    [
        ("gspo_token", (), 0.05),
        ("sapo", (), 0.03),
        ("gmpo", (), 0.05),
        ("cispo", ("optim.lr=2.5e-4",), 0.05),
    ],
)
def test_new_loss_raises_held_out_pass_rate(sft_model, tmp_path, outcome, loss, overrides, margin):
    """See the module docstring for the measured gains. CISPO runs at lr 2.5e-4: at 5e-4 seed
    0 fell from 0.315 to 0.27. CISPO keeps the gradient of the tokens that PPO's clip would
    stop (their weight is bounded, not zeroed), and at that learning rate, over two
    mini-batches, that overshoots."""
    out = _run(sft_model, tmp_path / loss, f"algo.policy_loss={loss}", *overrides)
    outcome(before=out["eval_before"], after=out["eval_after"])
    assert out["eval_after"] >= out["eval_before"] + margin, out


def _weak_student(root: Path) -> Path:
    """A smaller tiny model (hidden 48) SFT'd only to 12% validation pass rate (the test seed's
    held-out set left out, as ``bench/distill.py`` builds it)."""
    base = build_tiny_model(root / "base", hidden_size=48, seed=TEST_SEED)
    data = DataConfig(arithmetic=ArithmeticConfig(**ARITH), eval_size=200)
    held = {p.record.prompt for p in PromptSource(data, load_tokenizer(base), TEST_SEED).eval_set()}
    cfg = SFTConfig(
        seed=TEST_SEED, model_path=str(base), output_dir=str(root / "sft"),
        arithmetic=ArithmeticConfig(**ARITH), steps=3000, eval_every=20, eval_size=200,
        target_pass_rate=0.12, threads=1, progress=False,
    )  # fmt: skip
    run_sft(cfg, exclude_prompts=held)
    return root / "sft"


@pytest.mark.slow
@pytest.mark.learning
def test_on_policy_distillation_moves_the_student_towards_the_teacher(sft_model, tmp_path, outcome):
    """Teacher: the SFT fixture after 60 GRPO steps (held-out 0.47); student: a hidden-48 model
    at 0.09. Seed 0, 60 steps: distillation alone (reverse KL as the only advantage) 0.09 ->
    0.135; with the task reward 0.155 (loss mode, coef 0.5: 0.135); GRPO alone stays at 0.09.
    Seed 1 (teacher 0.75, student 0.085): distillation alone 0.15, with the task reward 0.14,
    GRPO alone 0.115 (``bench/distill.py``)."""
    teacher_run = _run(sft_model, tmp_path / "teacher", "algo.policy_loss=ppo")
    teacher = tmp_path / "teacher" / "checkpoints" / "step_000060" / "actor"
    student = _weak_student(tmp_path / "student")
    out = _run(
        student,
        tmp_path / "distill",
        f"algo.distill.teacher_path={teacher}",
        "algo.distill.task_reward=false",
    )
    outcome(before=out["eval_before"], after=out["eval_after"], teacher=teacher_run["eval_after"])
    assert out["eval_after"] >= out["eval_before"] + 0.02, out
    assert out["eval_after"] < teacher_run["eval_after"]
