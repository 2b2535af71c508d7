"""The ``env.agent`` section: train an agent written against the ``openai`` client.

With
``env.agent.function`` set, each rollout runs the user's agent against relayrl's
OpenAI-compatible endpoint (``relayrl.env.agent_rollout``) instead of one engine request.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from relayrl.config.base import KeyProblem, _Strict


class AgentConfig(_Strict):
    """Which agent function, its time limit and how many run at once."""

    function: str | None = None
    """``"package.module:function"``: ``agent(base_url, api_key, row) -> float`` (sync or
    async) runs one rollout with the ``openai`` client and returns its reward. null: no agent."""
    timeout_s: float = Field(120.0, gt=0)
    """Wall-clock seconds one rollout may take; past it the rollout is a recorded failure
    (reward 0, nothing of it trained) and its session is closed."""
    concurrency: int = Field(16, ge=1)
    """Rollouts (agent calls) running at once."""
    isolation: Literal["thread", "process"] = "thread"
    """Where an agent runs: a daemon thread per rollout (``thread``: a hung sync agent is
    abandoned past ``timeout_s``) or a spawned worker process per rollout (``process``: killed
    past ``timeout_s``; ``relayrl.env.agent_process``)."""
    max_sequences_per_request: int | None = Field(256, ge=1)
    """Most sequences (prompts x ``n``) one request to the agents' OpenAI-compatible endpoint
    may ask for; a request asking for more is answered 400 (``too_many_sequences``) before
    anything is queued. null: unbounded (as vLLM)."""

    @model_validator(mode="after")
    def _cross_checks(self) -> AgentConfig:
        f = self.function
        if f is not None and (":" not in f or not all(p.strip() for p in f.split(":", 1))):
            raise KeyProblem("function", f, "is not 'package.module:function'")
        return self

    @property
    def enabled(self) -> bool:
        return self.function is not None
