"""Gym-style text environments as relayrl environments.

``GymTextEnvironment(make)`` runs, unchanged, an environment of either shape the field uses:

- Gymnasium's (``reset(seed=..., options=...) -> (observation, info)``, ``step(action) ->
  (observation, reward, terminated, truncated, info)``; the older 4-tuple ``(observation,
  reward, done, info)`` too), where the action is the assistant turn's text and an observation
  is a string (a ``user`` message), a message dict or a list of messages;
- SkyRL-gym's ``BaseTextEnv`` (``init(prompt) -> (messages, metadata)``, ``step(action) ->
  {"observations": [...], "reward": r, "done": d, "metadata": {...}}``); the real package's
  registered environments by id: :mod:`relayrl.env.skyrl_adapter` (``env.factory: skyrl``).

``make(row)`` builds the environment of one episode from the dataset row (a fresh one each
episode, as both APIs expect; it may return an instance or a class to call with no argument).
The first messages: SkyRL's ``init`` gets the row's ``prompt`` as a chat (a string becomes
``[{"role": "user", ...}]``, a list of messages is passed as is) and returns the first
messages; Gymnasium's ``reset`` gets ``options=row`` and ``seed=row.get("seed")``, and its
observation is the first user message. Per-step rewards are
the :class:`StepResult` rewards: the one of the step that ends the episode is its outcome
(``env.outcome: env``), the earlier ones are turn rewards; ``truncated`` ends the episode too
(``info["truncated"]``). A SkyRL step's ``postprocessed_action`` is kept in ``info`` but not
applied (the trained tokens are the engine's, so the next turn extends them unchanged), and the
env's ``get_metrics()`` at the end of an episode is ``info["metrics"]``. ``close`` is called
when the episode's environment is let go.
Everything a step or reset does runs on the environment's own loop (``relayrl.env.pool``), so
a blocking gym env never stalls the others; sync methods run in a worker thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from relayrl.env.environment import Environment, call_maybe_async
from relayrl.env.registry import load_callable
from relayrl.env.types import EnvError, Message, StepResult, check_messages


def _messages(obs: Any, where: str) -> list[Message]:
    if obs is None:
        return []
    if isinstance(obs, str):
        return [{"role": "user", "content": obs}]
    return check_messages(obs, where)


class GymTextEnvironment(Environment):
    """A gym-style text environment per episode (see module)."""

    def __init__(self, make: Callable[[Mapping[str, Any]], Any]):
        self.make = make
        self.env: Any = None

    async def reset(self, row: Mapping[str, Any]) -> list[Message]:
        await self._close_env()
        env = await call_maybe_async(self.make, dict(row))
        self.env = env() if isinstance(env, type) else env
        if hasattr(self.env, "init"):  # SkyRL-gym BaseTextEnv
            raw = row.get("prompt", "")
            prompt = (
                check_messages(raw, "row['prompt']")
                if isinstance(raw, list)
                else [{"role": "user", "content": str(raw)}]
            )
            out = await call_maybe_async(self.env.init, prompt)
            msgs = out[0] if isinstance(out, tuple) else out
            return _messages(msgs, "init")
        seed = row.get("seed")

        def gym_reset() -> Any:
            return self.env.reset(seed=seed, options=dict(row))

        out = await call_maybe_async(gym_reset)
        obs = out[0] if isinstance(out, tuple) else out
        return _messages(obs, "reset")

    async def step(self, message: Message) -> StepResult:
        if self.env is None:
            raise EnvError("step before reset")
        out = await call_maybe_async(self.env.step, message["content"])
        if isinstance(out, Mapping):  # SkyRL-gym: BaseTextEnvStepOutput (a TypedDict)
            obs, reward = out.get("observations") or [], out.get("reward")
            done, info = bool(out.get("done")), dict(out.get("metadata") or {})
            if out.get("postprocessed_action") is not None:  # recorded; the tokens stand
                info["postprocessed_action"] = out["postprocessed_action"]
            metrics = getattr(self.env, "get_metrics", None)
            if done and callable(metrics):
                info["metrics"] = dict(await call_maybe_async(metrics) or {})
        elif isinstance(out, tuple) and len(out) == 5:
            obs, reward, terminated, truncated, info = out
            done, info = bool(terminated or truncated), dict(info or {})
            if truncated:
                info["truncated"] = True
        elif isinstance(out, tuple) and len(out) == 4:
            obs, reward, done, info = out
            done, info = bool(done), dict(info or {})
        else:
            raise EnvError(f"step returned {type(out).__name__}, not a gym step tuple")
        r = None if reward is None else float(reward)
        return StepResult([] if done else _messages(obs, "step"), done, r, info)

    async def close(self) -> None:
        await self._close_env()

    async def _close_env(self) -> None:
        env, self.env = self.env, None
        close = getattr(env, "close", None)
        if callable(close):
            await call_maybe_async(close)


def make_gym_env(make: str, **kwargs: Any) -> GymTextEnvironment:
    """``env.factory: gym`` with ``env.kwargs: {make: "package.module:callable", ...}``:
    ``callable(row, **kwargs)`` builds each episode's gym-style environment."""
    fn = load_callable(make, "env.kwargs.make")
    return GymTextEnvironment(lambda row: fn(row, **kwargs))
