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

Failures: an exception in ``rollout`` (the environment's turn, the endpoint) fails the rollout
(``env_error``, not trained), and so does a rubric reward function that raises: verifiers'
``Rubric`` catches it and scores that function 0.0, which would train a judge that is down
as a wrong answer; the adapter wraps the rubric's reward functions (once, in place) to see
the exception. A tool that raises inside a ``ToolEnv`` is shown to the model by verifiers
(the model's mistake, as relayrl's own tools), except one that raises
:class:`~relayrl.env.types.EnvError` (its backend failed): as with relayrl's own tools, that
fails the rollout at once (``env_error``, not trained). verifiers' ``call_tool`` catches every
exception, so the adapter wraps the ``ToolEnv``'s tools (once, in place) to record it, and its
``call_tool`` to raise it.

The row: its ``prompt`` (text, formatted with the environment's system prompt and few-shot
examples, or already a list of messages), ``answer``, ``task`` and ``info`` (``oai_tools``
added from the environment's tools) are what ``rollout`` gets. Tested with verifiers 0.1.3
(the newest release whose dependencies fit relayrl's lock: later ones pin ``openai<3`` and
``mcp<2`` / ``mcp==2.0.0`` and a dozen Prime Intellect packages).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

_REWARD_FAILURES: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "verifiers_reward_failures", default=None
)
"""The current rollout's reward-function failures (a list per ``agent`` call; the rubric's
scoring tasks copy the context, so they append to the same list)."""

_TOOL_FAILURES: contextvars.ContextVar[list[BaseException] | None] = contextvars.ContextVar(
    "verifiers_tool_failures", default=None
)
"""The current rollout's tool infrastructure failures (``EnvError`` raised by a tool)."""


def _tool_reporting(func: Any) -> Any:
    """``func`` (a ``ToolEnv`` tool, sync or async), recording an ``EnvError`` it raises in the
    current rollout's tool failures before verifiers' ``call_tool`` turns it into text."""
    from relayrl.env.types import EnvError

    @functools.wraps(func)
    async def tool(*args: Any, **kwargs: Any) -> Any:
        try:
            out = func(*args, **kwargs)
            return await out if inspect.isawaitable(out) else out
        except EnvError as e:
            failures = _TOOL_FAILURES.get()
            if failures is not None:
                failures.append(e)
            raise

    tool.__relayrl_reporting__ = True  # type: ignore[attr-defined]
    return tool


def _raise_tool_failure(failures: list[BaseException]) -> None:
    from relayrl.env.types import EnvError

    if failures:
        e = failures[0]
        raise EnvError(f"a tool raised EnvError: {e}") from e


def _report_tool_failures(env: Any) -> None:
    """Wrap a ``ToolEnv``'s tools (its ``tool_map``) and its ``call_tool`` once, so that a
    tool's ``EnvError`` ends the rollout as soon as the call returns."""
    tool_map = getattr(env, "tool_map", None)
    if not isinstance(tool_map, dict) or getattr(env, "__relayrl_tools_reporting__", False):
        return
    for name, f in list(tool_map.items()):
        if callable(f) and not getattr(f, "__relayrl_reporting__", False):
            tool_map[name] = _tool_reporting(f)
    call_tool = getattr(env, "call_tool", None)
    if callable(call_tool):

        @functools.wraps(call_tool)
        async def checked_call_tool(*args: Any, **kwargs: Any) -> Any:
            out = call_tool(*args, **kwargs)
            out = await out if inspect.isawaitable(out) else out
            _raise_tool_failure(_TOOL_FAILURES.get() or [])
            return out

        env.call_tool = checked_call_tool
    env.__relayrl_tools_reporting__ = True


def _reporting(func: Any) -> Any:
    """``func`` (a rubric's reward function, sync or async), recording an exception in the
    current rollout's failures before verifiers' rubric turns it into 0.0. ``functools.wraps``
    keeps its name (the metric) and, through ``__wrapped__``, its signature (the rubric passes
    only the arguments it names)."""

    @functools.wraps(func)
    async def reward_func(*args: Any, **kwargs: Any) -> Any:
        try:
            out = func(*args, **kwargs)
            return await out if inspect.isawaitable(out) else out
        except Exception as e:
            failures = _REWARD_FAILURES.get()
            if failures is not None:
                failures.append(f"{func.__name__} raised {type(e).__name__}: {e}")
            raise

    reward_func.__relayrl_reporting__ = True  # type: ignore[attr-defined]
    return reward_func


def _report_reward_failures(rubric: Any) -> None:
    """Wrap every reward function of ``rubric`` (and of a ``RubricGroup``'s rubrics) once."""
    for sub in getattr(rubric, "rubrics", None) or []:
        _report_reward_failures(sub)
    funcs = getattr(rubric, "reward_funcs", None)
    if isinstance(funcs, list):
        for i, f in enumerate(funcs):
            if not getattr(f, "__relayrl_reporting__", False):
                funcs[i] = _reporting(f)


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
    returning its rubric's reward (see module). A reward function that raises fails the
    rollout (verifiers' rubric alone would score it 0.0), and so does a ``ToolEnv`` tool that
    raises ``EnvError`` (verifiers alone would show it to the model)."""
    _report_reward_failures(env.rubric)
    _report_tool_failures(env)

    async def agent(base_url: str, api_key: str, row: dict[str, Any]) -> float:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        failures: list[str] = []
        tool_failures: list[BaseException] = []
        token = _REWARD_FAILURES.set(failures)
        tool_token = _TOOL_FAILURES.set(tool_failures)
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
            _raise_tool_failure(tool_failures)  # a subclass's own call_tool may have gone on
            score = await env.rubric.score_rollout(
                prompt, completion, answer, state, task=task, info=info
            )
            if failures:  # an infrastructure failure (a judge down...), not a zero reward
                raise RuntimeError(
                    "the rubric's reward function " + "; ".join(failures) + " (verifiers "
                    "would score it 0.0; the rollout is failed and left out of training)"
                )
            return float(score.reward)
        finally:
            _TOOL_FAILURES.reset(tool_token)
            _REWARD_FAILURES.reset(token)
            await client.close()

    agent.__name__ = f"verifiers_agent[{type(env).__name__}]"
    return agent
