"""An environment that stands for a slow tool: every step waits a latency drawn from a
(heavy-tailed) distribution, then answers, for ``turns`` turns.

It measures what a schedule does with agent workloads, where an episode alternates generating
and waiting on its environment (tool calls of 0.1-30 s in the lecture's code and browser
agents). The distribution is the planner's (``relayrl.plan.envlatency``, e.g.
``lognormal:MEDIAN_S:P99_S:CAP_S``), so a benchmark hands the simulator the very same
distribution it ran. Waits are ``asyncio.sleep``: the engine serves other episodes meanwhile.
Each episode's waits are drawn from a generator seeded by (``seed``, the row's prompt, its
sample index), so sync and async runs of one config wait the same times for the same samples.
The score is the run's reward function on the final turn (``env.outcome: reward_fn``).
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from relayrl.env.environment import Environment
from relayrl.env.types import Message, StepResult
from relayrl.plan.envlatency import parse_latency


class LatencyEnv(Environment):
    """``turns`` assistant turns; after each but the last, wait ``latency`` and answer
    ``observation`` (a ``tool`` message). ``waits`` records every wait (seconds)."""

    def __init__(
        self,
        turns: int = 3,
        latency: str = "lognormal:0.05:1.0:4",
        observation: str = "ok",
        seed: int = 0,
    ):
        if turns < 1:
            raise ValueError(f"latency env: turns must be >= 1, got {turns}")
        self.turns, self.observation, self.seed = turns, observation, seed
        self.dist = parse_latency(latency)
        self.waits: list[float] = []
        self._n = 0
        self._rng = np.random.default_rng(seed)

    async def reset(self, row: Mapping[str, Any]) -> list[Message]:
        key = f"{row.get('prompt')}|{row.get('sample_index', 0)}".encode()
        self._rng = np.random.default_rng([self.seed, zlib.crc32(key)])
        self._n = 0
        return [{"role": "user", "content": str(row["prompt"])}]

    async def step(self, message: Message) -> StepResult:
        self._n += 1
        if self._n >= self.turns:
            return StepResult(done=True)
        wait = float(self.dist.sample(1, self._rng)[0])
        self.waits.append(wait)
        await asyncio.sleep(wait)
        return StepResult([{"role": "tool", "content": self.observation}])


def make_latency_env(**kwargs: Any) -> LatencyEnv:
    """``env.factory: latency`` (``env.kwargs``: turns, latency, observation, seed)."""
    return LatencyEnv(**kwargs)
