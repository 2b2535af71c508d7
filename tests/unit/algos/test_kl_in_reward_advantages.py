"""A KL in the reward under the group-relative advantages (``algo.kl_in: reward``, veRL's
``use_kl_in_reward``): token rewards r_t = -beta * KL_t + score * [t = T], whose sum, the
return R_i = score_i - beta * sum_t KL_t, is what GRPO / Dr.GRPO / RLOO compare within a group.
Every number below is worked out by hand in the comments."""

from __future__ import annotations

import pytest
import torch

from relayrl.algos import apply_kl_to_rewards, compute_advantages

# Three answers to one prompt; row 2 has one response token. d = log pi_old - log pi_ref:
#   row 0: [0.2, 0.4] (k1 sum 0.6), row 1: [-0.2, 0.0] (sum -0.2), row 2: [1.0] (sum 1.0)
OLD = torch.tensor([[-1.0, -1.0], [-1.2, -0.8], [-0.5, 0.0]])
REF = torch.tensor([[-1.2, -1.4], [-1.0, -0.8], [-1.5, 0.0]])
MASK = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
SCORES = torch.tensor([1.0, 1.0, 0.0])
BETA = 0.5
GROUP = torch.tensor([0, 0, 0])


def _rewards() -> torch.Tensor:
    rewards, _ = apply_kl_to_rewards(SCORES, OLD, REF, MASK, BETA, "k1")
    return rewards


def test_token_rewards_carry_minus_beta_kl_and_the_score_on_the_last_token():
    # row 0: [-0.5 * 0.2, -0.5 * 0.4 + 1] = [-0.1, 0.8]; row 1: [0.1, 1.0]; row 2: [-0.5, 0]
    expected = torch.tensor([[-0.1, 0.8], [0.1, 1.0], [-0.5, 0.0]])
    torch.testing.assert_close(_rewards(), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("estimator", "per_row"),
    [
        # R = [1 - 0.5 * 0.6, 1 + 0.5 * 0.2, 0 - 0.5 * 1.0] = [0.7, 1.1, -0.5], mean 1.3 / 3;
        # centred c = [0.266667, 0.666667, -0.933333]
        ("drgrpo", [0.266667, 0.666667, -0.933333]),
        # unbiased var = (0.071111 + 0.444444 + 0.871111) / 2 = 0.693333, std 0.832666;
        # A = c / (std + 1e-6)
        ("grpo", [0.320256, 0.800640, -1.120897]),
        # A_i = R_i - mean of the others: 0.7 - 0.3, 1.1 - 0.1, -0.5 - 0.9
        ("rloo", [0.4, 1.0, -1.4]),
    ],
)
def test_group_advantages_compare_the_kl_shaped_returns(estimator, per_row):
    adv, _ = compute_advantages(
        estimator, token_rewards=_rewards(), response_mask=MASK, group_index=GROUP
    )
    expected = torch.tensor(per_row)[:, None] * MASK
    torch.testing.assert_close(adv, expected, atol=2e-6, rtol=0)


def test_without_the_kl_the_same_group_differs():
    """The KL changes the ranking: scores alone make rows 0 and 1 equal (A = 1/3 each)."""
    plain, _ = apply_kl_to_rewards(SCORES, OLD, REF, MASK, 0.0, "k1")
    adv, _ = compute_advantages(
        "drgrpo", token_rewards=plain, response_mask=MASK, group_index=GROUP
    )
    torch.testing.assert_close(adv[:, 0], torch.tensor([1 / 3, 1 / 3, -2 / 3]))
