"""``algo.kl_in`` (where the KL to the reference goes) and ``algo.missing_eos_penalty``: the
defaults per algorithm, and the combinations refused with one line naming the keys."""

from __future__ import annotations

import pytest

from relayrl.config import ConfigError, RunConfig, load_config


@pytest.mark.parametrize(
    ("overrides", "placement", "estimator"),
    [
        ([], "loss", "k3"),  # GRPO: KL loss term, low-variance k3 (as before)
        (["algo.name=ppo"], "reward", "k1"),  # PPO: KL in the reward, k1 (as before)
        (["algo.kl_in=reward"], "reward", "k1"),  # veRL: kl_penalty "kl" in the reward
        (["algo.name=ppo", "algo.kl_in=loss"], "loss", "k3"),  # veRL: kl_loss_type low_var_kl
        (["algo.name=ppo", "algo.kl_in=loss", "algo.kl_estimator=k2"], "loss", "k2"),
        (["algo.advantage=rloo", "algo.kl_in=reward"], "reward", "k1"),
    ],
)
def test_placement_and_estimator_defaults(overrides, placement, estimator):
    a = load_config(RunConfig, None, overrides).algo
    assert (a.kl_placement, a.kl_kind) == (placement, estimator)


PREFIX = "command line: bad value for "


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algo.name=dpo", "algo.kl_coef=0.1", "algo.kl_in=loss"],
            "'algo.kl_in' ('loss'): algo.name 'dpo' has no reward or policy-gradient loss to "
            "put a KL in: algo.kl_coef is DPO's beta; leave algo.kl_in unset",
        ),
        (
            ["algo.name=dpo", "algo.kl_coef=0.1", "algo.missing_eos_penalty=1"],
            "'algo.missing_eos_penalty' (1.0): algo.name 'dpo' trains on fixed preference "
            "pairs, it samples no response to penalise; leave algo.missing_eos_penalty unset",
        ),
        (
            ["algo.kl_in=reward", "algo.turn_credit=stepwise_grpo"],
            "'algo.kl_in' ('reward'): algo.turn_credit=stepwise_grpo builds its advantages "
            "from the turns' scores, not from token rewards: a KL in the reward would be "
            "dropped; use algo.kl_in=loss",
        ),
        (
            ["algo.kl_in=reward", "algo.distill.teacher_path=/t", "algo.distill.task_reward=false"],
            "'algo.kl_in' ('reward'): algo.distill.task_reward=false drops the task "
            "advantages, and with them a KL in the reward; use algo.kl_in=loss",
        ),
        (
            [
                "algo.name=ppo",
                "algo.kl_in=loss",
                "algo.kl_coef=0.1",
                "algo.adaptive_kl_target=0.05",
                "algo.adaptive_kl_metric=seq-mean",
            ],
            "'algo.adaptive_kl_metric' ('seq-mean'): a KL loss term feeds the adaptive "
            "controller the update's token mean; seq-mean needs the KL in the reward "
            "(algo.kl_in=reward)",
        ),
        (
            ["algo.missing_eos_penalty=-1"],
            "'algo.missing_eos_penalty' (-1): Input should be greater than or equal to 0",
        ),
    ],
)
def test_refused_combinations_name_the_keys(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, None, overrides)
    assert str(info.value) == PREFIX + message


def test_the_same_keys_are_accepted_where_they_make_sense():
    ok = [
        ["algo.kl_in=loss", "algo.turn_credit=stepwise_grpo"],
        ["algo.kl_in=reward", "algo.distill.teacher_path=/t"],  # task reward kept
        [
            "algo.kl_in=reward",
            "algo.kl_coef=0.1",
            "algo.adaptive_kl_target=0.05",
            "algo.adaptive_kl_metric=seq-mean",
        ],
        ["algo.name=ppo", "algo.group_size=1", "algo.missing_eos_penalty=0.5"],
    ]
    for overrides in ok:
        load_config(RunConfig, None, overrides)
