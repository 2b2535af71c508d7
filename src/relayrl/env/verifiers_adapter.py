"""``verifiers`` environments (PyPI ``verifiers``) trained unchanged, through the endpoint.

A verifiers environment (``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv``, with its parser and
rubric) talks to its model through an ``AsyncOpenAI`` client: ``env.rollout(client, model,
prompt, answer, task, info, sampling_args) -> (completion, state)``, then
``env.rubric.score_rollout(prompt, completion, answer, state, task, info).reward``. So it runs
as an agent (``relayrl.env.agent_rollout``): :func:`verifiers_agent` turns an environment into
an ``env.agent.function``, each rollout a session on relayrl's OpenAI-compatible endpoint, whose
recorded calls are the engine's tokens (chat calls rendered by the model's chat template,
``tools`` included; a ``ToolEnv``'s calls parsed into ``tool_calls`` it runs itself). The
rubric's reward is the rollout's reward::

    # my_envs.py
    import verifiers as vf
    from relayrl.env.verifiers_adapter import verifiers_agent

    agent = verifiers_agent(vf.ToolEnv(tools=[multiply], dataset=..., rubric=...))

    # run.yaml:  env: {agent: {function: "my_envs:agent"}}

The row: its ``prompt`` (text, formatted with the environment's system prompt and few-shot
examples, or already a list of messages), ``answer``, ``task`` and ``info`` (``oai_tools``
added from the environment's tools) are what ``rollout`` gets. Tested with verifiers 0.1.3
(the newest release whose dependencies fit relayrl's lock: later ones pin ``openai<3`` and
``mcp<2`` / ``mcp==2.0.0`` and a dozen Prime Intellect packages).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def _prompt(env: Any, row: Mapping[str, Any]) -> Any:
    prompt = row.get("prompt", "")
    if getattr(env, "message_type", "chat") != "chat":
        return str(prompt)
    if isinstance(prompt, list):
        return list(prompt)
    return env.format_prompt(str(prompt), env.system_prompt, env.few_shot)


def verifiers_agent(
    env: Any, model: str = "policy", sampling_args: Mapping[str, Any] | None = None
) -> Callable[[str, str, dict[str, Any]], Any]:
    """An ``env.agent.function`` running ``env`` (a verifiers environment) per rollout and
    returning its rubric's reward (see module)."""

    async def agent(base_url: str, api_key: str, row: dict[str, Any]) -> float:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        try:
            prompt = _prompt(env, row)
            answer = str(row.get("answer", ""))
            task = str(row.get("task", "default"))
            info = dict(row.get("info") or {})
            if getattr(env, "oai_tools", None) and "oai_tools" not in info:
                info["oai_tools"] = env.oai_tools
            completion, state = await env.rollout(
                client,
                model,
                prompt,
                answer=answer,
                task=task,
                info=info,
                sampling_args=dict(sampling_args or {}),
            )
            score = await env.rubric.score_rollout(
                prompt, completion, answer, state, task=task, info=info
            )
            return float(score.reward)
        finally:
            await client.close()

    agent.__name__ = f"verifiers_agent[{type(env).__name__}]"
    return agent
