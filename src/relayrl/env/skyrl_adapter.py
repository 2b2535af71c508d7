"""SkyRL-gym's environments (PyPI ``skyrl-gym``) as relayrl environments, by registry id.

``env.factory: skyrl`` with ``env.kwargs: {env_class: "gsm8k", env_config: {...}}`` builds each
episode's environment as SkyRL's generator does: ``skyrl_gym.make(env_class,
env_config=DictConfig(env_config), extras=row)``, and runs it unchanged through
:class:`~relayrl.env.gym_adapter.GymTextEnvironment` (``init(prompt)`` for the first messages,
``step(assistant text)`` per turn, ``close()`` at the end).

- ``env_class``: an id in ``skyrl_gym``'s registry (its own ``aime``, ``gsm8k``,
  ``gsm8k_multi_turn``, ``text2sql``, ``search``, ``lcb``, ``searchcode``, or one registered
  with ``skyrl_gym.register`` by a module the run imports), or ``"package.module:Class"`` for a
  ``BaseTextEnv`` subclass not registered (called as ``Class(env_config=..., extras=...)``).
  A row's own ``env_class`` field (SkyRL datasets carry one) takes precedence.
- ``env_config``: the environment's section of SkyRL's ``environment.skyrl_gym`` config (e.g.
  ``{db_path: ...}`` for ``text2sql``), passed as an ``omegaconf.DictConfig``.
- ``extras``: SkyRL's per-sample ``env_extras``: the dataset row's fields, over ``extras``
  given here (defaults shared by every row). A row without ``reward_spec`` gets
  ``{"method": "rule", "ground_truth": row["answer"]}`` when it has an ``answer`` (relayrl's
  prompt rows), and ``extra_info`` defaults to ``{}``.

The environment's rewards are per step (the last one the outcome: set ``env.outcome: env``);
its ``max_turns`` ends episodes through ``done``, and relayrl's ``env.max_turns`` still bounds
them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from relayrl.env.gym_adapter import GymTextEnvironment
from relayrl.env.registry import load_callable
from relayrl.env.types import EnvError


def skyrl_extras(row: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> dict:
    """SkyRL's ``env_extras`` of one dataset row: ``defaults`` overlaid with the row, with a
    ``reward_spec`` from the row's ``answer`` when it has none and ``extra_info`` ``{}``."""
    extras: dict[str, Any] = {**(defaults or {}), **row}
    if "reward_spec" not in extras and extras.get("answer") is not None:
        extras["reward_spec"] = {"method": "rule", "ground_truth": str(extras["answer"])}
    extras.setdefault("extra_info", {})
    return extras


def make_skyrl_text_env(
    row: Mapping[str, Any],
    env_class: str | None = None,
    env_config: Mapping[str, Any] | None = None,
    extras: Mapping[str, Any] | None = None,
) -> Any:
    """One episode's SkyRL-gym environment for ``row`` (see module); ``EnvError`` naming the
    id when it is neither registered nor ``"module:Class"``."""
    import skyrl_gym
    from omegaconf import OmegaConf

    cls_id = row.get("env_class") or env_class
    if not cls_id:
        raise EnvError("env.kwargs.env_class: not set, and the row has no 'env_class'")
    cfg = OmegaConf.create(dict(env_config or {}))
    ex = skyrl_extras(row, extras)
    if cls_id in skyrl_gym.registry:
        return skyrl_gym.make(cls_id, env_config=cfg, extras=ex)
    if ":" in cls_id:
        return load_callable(cls_id, "env.kwargs.env_class", "class")(env_config=cfg, extras=ex)
    known = ", ".join(sorted(skyrl_gym.registry))
    raise EnvError(
        f"env.kwargs.env_class: {cls_id!r} is not in skyrl_gym's registry ({known}) and not "
        "'package.module:Class'"
    )


def make_skyrl_env(
    env_class: str | None = None,
    env_config: Mapping[str, Any] | None = None,
    extras: Mapping[str, Any] | None = None,
) -> GymTextEnvironment:
    """``env.factory: skyrl``: a relayrl environment running ``env_class`` per episode."""
    import skyrl_gym  # fail at start-up, not in the first episode, when it is not installed

    if env_class and ":" not in env_class and env_class not in skyrl_gym.registry:
        raise ValueError(
            f"env.kwargs.env_class: {env_class!r} is not in skyrl_gym's registry "
            f"({', '.join(sorted(skyrl_gym.registry))}) and not 'package.module:Class'"
        )
    return GymTextEnvironment(lambda row: make_skyrl_text_env(row, env_class, env_config, extras))
