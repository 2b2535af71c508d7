"""An OpenEnv environment written against ``openenv-core``'s server API (``Environment``,
``Action``, ``Observation``, ``State``), for tests/integration/test_env_openenv.py: the model
is asked for the
row's answer; a wrong answer gets one more try (reward 0 and a hint), a right one ends the
episode with reward 1, the second wrong one with reward 0. Every instance counts its resets and
the sessions it saw close."""

from __future__ import annotations

from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

EVENTS: list[str] = []  # what the server-side instances did, in order


class AnswerAction(Action):
    message: str = Field(..., description="the model's reply")


class AnswerObservation(Observation):
    text: str = ""


class AnswerEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self.answer = ""

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **row: Any
    ) -> AnswerObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.answer = str(row.get("answer", ""))
        EVENTS.append(f"reset {row.get('prompt')}")
        return AnswerObservation(text=f"Q: {row.get('prompt')}", done=False, reward=0.0)

    def step(
        self, action: AnswerAction, timeout_s: float | None = None, **kw: Any
    ) -> AnswerObservation:  # type: ignore[override]
        self._state.step_count += 1
        right = action.message.strip() == self.answer
        last = right or self._state.step_count >= 2
        text = "right" if right else f"wrong, it has {len(self.answer)} characters"
        return AnswerObservation(text=text, done=last, reward=float(right))

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        EVENTS.append("close")
