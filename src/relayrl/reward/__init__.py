"""Reward functions and answer verifiers (DESIGN.md layer 4; must not import ``data``)."""

from relayrl.reward.functions import (
    REWARD_FUNCTIONS,
    RewardFn,
    RewardSpecError,
    arithmetic,
    exact_match,
    get_reward_fn,
    register_reward_fn,
    score,
)
from relayrl.reward.verifiers import (
    END_MARKERS,
    extract_integer_answer,
    parse_int_answer,
    strip_special_tokens,
)

__all__ = [
    "END_MARKERS",
    "REWARD_FUNCTIONS",
    "RewardFn",
    "RewardSpecError",
    "arithmetic",
    "exact_match",
    "extract_integer_answer",
    "get_reward_fn",
    "parse_int_answer",
    "register_reward_fn",
    "score",
    "strip_special_tokens",
]
