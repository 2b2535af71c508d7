"""relayrl.tinker.adam: AdamParams defaults and the ranges a step accepts."""

from __future__ import annotations

import math

import pytest

from relayrl.tinker.adam import ADAM_DEFAULTS, check_adam_params


def test_defaults_are_the_sdks() -> None:
    assert check_adam_params({}) == {
        "learning_rate": 1e-4,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-12,
        "weight_decay": 0.0,
        "grad_clip_norm": 0.0,
    }
    assert check_adam_params({"learning_rate": 0.0, "beta1": 0.0})["learning_rate"] == 0.0


@pytest.mark.parametrize("key", sorted(ADAM_DEFAULTS))
@pytest.mark.parametrize("value", [-1e-3, math.inf, math.nan, None])
def test_out_of_range_values_are_refused(key: str, value: float | None) -> None:
    with pytest.raises(ValueError, match=f"AdamParams.{key} must be"):
        check_adam_params({key: value})


@pytest.mark.parametrize("key", ["beta1", "beta2"])
def test_betas_must_be_below_one(key: str) -> None:
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        check_adam_params({key: 1.0})
