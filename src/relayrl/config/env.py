"""The ``env`` section of the run config: multi-turn episodes (``relayrl.env``).

Without ``env.factory`` a run is single-turn, as before.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from relayrl.config.agent import AgentConfig  # env.agent (i20b)
from relayrl.config.base import KeyProblem, _Strict


class EnvConfig(_Strict):
    """Multi-turn episodes: which environment, stop conditions, the pool, timeouts."""

    factory: str | None = None
    """The environment: a builtin name (``calculator``) or ``"package.module:callable"``, a
    callable returning a fresh ``relayrl.env.Environment`` (called with ``kwargs``). null: a
    single-turn run."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the factory (e.g. ``{tools: false}`` for the calculator)."""
    max_turns: int = Field(4, ge=1)
    """Assistant turns per episode; the episode stops (``env/stop_max_turns``) after this."""
    max_turn_tokens: int | None = Field(None, ge=1)
    """Tokens one assistant turn may generate (null: ``rollout.max_tokens``)."""
    max_total_tokens: int | None = Field(None, ge=2)
    """Token budget of an episode: first prompt + every turn and observation (null: the
    engine's context). Reaching it stops the episode (``env/stop_token_budget``); a context
    that would not fit the engine's is ``env/stop_context_overflow``."""
    step_timeout_s: float = Field(30.0, gt=0)
    """Seconds ``reset`` / ``step`` / ``close`` may take; past it the episode ends as a
    recorded failure (``env/stop_timeout``) and the environment is discarded."""
    concurrency: int = Field(64, ge=1)
    """Episodes holding an environment at once (the pool's limit); others wait for a free one."""
    reuse: bool = True
    """Reset and reuse a finished episode's environment (else close it and create anew)."""
    isolation: Literal["thread", "process"] = "thread"
    """Where an environment runs: on an event loop of its own in a thread (``thread``: a
    blocked step times out, its thread cannot be stopped) or in a worker process
    (``process``: killed past ``step_timeout_s`` and replaced; the factory must be importable;
    ``relayrl.env.process_env``)."""
    render: Literal["auto", "plain", "template", "template_rerender"] = "auto"
    """Turn rendering (``relayrl.env.render``): the tokenizer's chat template when it has one
    (``auto``; bridged turn by turn onto the generated ids), else the plain ``U:`` / ``A:`` /
    ``T:`` format; ``template_rerender`` re-renders the conversation each turn (a new,
    counted sample wherever that breaks the prefix)."""
    outcome: Literal["reward_fn", "env"] = "reward_fn"
    """The episode's score: the run's reward function on the last assistant turn's text
    (``reward_fn``), or the reward the environment returned with ``done`` (``env``)."""
    turn_reward_coef: float = Field(0.0, ge=0, le=100)
    """Per-turn rewards (``StepResult.reward`` of turns that did not end the episode) enter
    the score as coef x their sum."""

    agent: AgentConfig = Field(default_factory=AgentConfig)
    """An agent written against the ``openai`` client instead of an environment (i20b)."""

    @model_validator(mode="after")
    def _cross_checks(self) -> EnvConfig:
        if self.factory is not None and not self.factory.strip():
            raise KeyProblem("factory", self.factory, "is empty: a builtin name or 'module:fn'")
        if self.factory is not None and self.agent.enabled:  # i20b
            raise KeyProblem("agent.function", self.agent.function, "and env.factory: set one")
        return self

    @property
    def enabled(self) -> bool:
        return self.factory is not None
