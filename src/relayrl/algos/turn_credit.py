"""Per-turn credit for multi-turn episodes: discounted turn returns and step-wise GRPO.

An episode of T assistant turns has a reward per turn, ``r_t`` (the environment's per-turn
reward for t < T, the episode's score for the last turn). Its discounted turn return is
``G_t = r_t + gamma * G_{t+1}`` (``G_T = r_T``; gamma = 1: the sum of the rewards from turn t
on). Step-wise GRPO (turn-level group normalisation, as in GiGPO's step-level groups over
turns) gives turn t of episode i the advantage::

    A_{i,t} = (G_{i,t} - mean_j G_{j,t}) / (std_j G_{j,t} + eps)

over the episodes j of i's group that have a turn t (population std; a turn index only one
episode of the group reached gets 0, as a one-sample group does). Every model token of turn t
carries ``A_{i,t}``. With one turn per episode and gamma = 1 this is GRPO's outcome advantage
(``relayrl.algos.advantages``, std-normalised).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence


def discounted_turn_returns(rewards: Sequence[float], gamma: float = 1.0) -> list[float]:
    """``G_t = r_t + gamma * G_{t+1}`` for each turn (see module)."""
    out = [0.0] * len(rewards)
    acc = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc = float(rewards[t]) + gamma * acc
        out[t] = acc
    return out


def stepwise_group_advantages(
    returns: Sequence[Sequence[float]],
    group_index: Sequence[int],
    eps: float = 1e-6,
    scale: bool = True,
) -> list[list[float]]:
    """``A_{i,t}``: each turn's return normalised over its group's episodes at that turn."""
    if len(returns) != len(group_index):
        raise ValueError(f"{len(returns)} episodes but {len(group_index)} group indices")
    cells: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, (g, rs) in enumerate(zip(group_index, returns, strict=True)):
        for t in range(len(rs)):
            cells[(int(g), t)].append(i)
    out = [[0.0] * len(rs) for rs in returns]
    for (_, t), members in cells.items():
        if len(members) < 2:
            continue
        xs = [float(returns[i][t]) for i in members]
        mean = sum(xs) / len(xs)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
        for i, x in zip(members, xs, strict=True):
            out[i][t] = (x - mean) / (std + eps) if scale else x - mean
    return out


def spread_over_turns(
    turn_values: Sequence[float], spans: Sequence[tuple[int, int]], length: int
) -> list[float]:
    """A per-token list of ``length``: turn t's value on the tokens ``spans[t]`` (start, end),
    0 elsewhere (observation tokens are masked out of the loss anyway)."""
    if len(turn_values) != len(spans):
        raise ValueError(f"{len(turn_values)} turn values but {len(spans)} turn spans")
    out = [0.0] * length
    for v, (a, b) in zip(turn_values, spans, strict=True):
        for k in range(max(a, 0), min(b, length)):
            out[k] = float(v)
    return out
