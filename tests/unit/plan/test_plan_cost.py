"""Cost estimator and memory of model sets (lecture notes: 18.1 §3, lecture 25, RL systems)."""

import pytest

from relayrl.plan.cost import (
    generation_vs_training_flops,
    gpu_hours,
    model_set_memory_bytes,
    money,
    rl_step_cost,
    training_gpu_hours,
    two_pool_pipeline,
)
from relayrl.plan.hardware import get_hardware
from relayrl.plan.models import get_model


def test_7b_on_1b_tokens_is_29_5_gpu_hours():
    h = gpu_hours(7e9, 1e9, 989e12, 0.4)
    assert h == pytest.approx(6 * 7e9 * 1e9 / (989e12 * 0.4 * 3600))
    assert round(h, 1) == 29.5
    assert training_gpu_hours(get_model("7b"), 1e9, get_hardware("h100"), 0.4) == pytest.approx(h)
    assert money(h, 2.0) == pytest.approx(2 * h)


def test_memory_of_four_7b_and_four_70b():
    four = lambda n: [(n, True), (n, True), (n, False), (n, False)]  # noqa: E731
    assert model_set_memory_bytes(four(7e9)) == pytest.approx(252e9)
    assert model_set_memory_bytes(four(70e9)) == pytest.approx(2520e9)
    # exercise 8 split: 1120 + 1120 + 140 + 140 GB
    assert model_set_memory_bytes([(70e9, True)]) == pytest.approx(1120e9)
    assert model_set_memory_bytes([(70e9, False)]) == pytest.approx(140e9)


def test_generation_vs_training_flops_b1024_l512():
    gen, train = generation_vs_training_flops(1.0, 1024, 512)
    assert gen == 1_048_576 * 1.0  # ~1e6 Psi
    assert train == 3 * gen  # ~3e6 Psi


def test_two_pools_45_50_5():
    r = two_pool_pipeline(0.45, 0.50, 0.05)
    assert r["serial_utilisation"] == pytest.approx(0.475)
    assert r["pipelined_wall_fraction"] == pytest.approx(0.55)
    assert r["pipelined_utilisation"] == pytest.approx(0.95)
    with pytest.raises(ValueError):
        two_pool_pipeline(0.5, 0.5, 0.5)


def test_rl_step_cost_components_and_rollout_share():
    m = get_model("7b")
    c = rl_step_cost(
        m,
        get_hardware("h100"),
        prompts=512,
        samples_per_prompt=8,
        prompt_len=512,
        response_len=4096,
        ref=m,
    )
    assert set(c.components) == {"rollout", "actor_update", "ref_forward", "reward"}
    T = 512 * 8 * (512 + 4096)
    assert c.components["actor_update"] == pytest.approx(6 * 7e9 * T / (989e12 * 0.4))
    assert c.components["ref_forward"] == pytest.approx(c.components["actor_update"] / 3)
    assert c.components["reward"] == 0.0  # rule-based verifier
    # "rollout generation takes 50%-60% of the step" for long answers
    assert 0.5 <= c.share("rollout") <= 0.6
    assert c.cost == pytest.approx(c.gpu_hours * get_hardware("h100").price_per_hour)
    # a long tail (idle slots) makes the rollout share grow
    tail = rl_step_cost(m, get_hardware("h100"), response_len=4096, ref=m, tail_factor=2.0)
    assert tail.share("rollout") > c.share("rollout")
    with pytest.raises(ValueError):
        rl_step_cost(m, get_hardware("h100"), prompts=0)


def test_bad_cost_inputs():
    with pytest.raises(ValueError):
        gpu_hours(7e9, 1e9, 989e12, 0.0)
    with pytest.raises(ValueError):
        money(-1, 2)
