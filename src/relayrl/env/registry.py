"""``env.factory``: a builtin environment name or ``"package.module:callable"``."""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from relayrl.env.environment import Environment

BUILTIN: dict[str, str] = {
    "calculator": "relayrl.env.builtin.calculator:make_calculator_env",
    "code": "relayrl.env.builtin.code:make_code_env",
    "latency": "relayrl.env.builtin.latency:make_latency_env",
    "mcp": "relayrl.env.mcp_tools:make_mcp_env",
    "gym": "relayrl.env.gym_adapter:make_gym_env",
    "skyrl": "relayrl.env.skyrl_adapter:make_skyrl_env",
    "openenv": "relayrl.env.openenv_adapter:make_openenv_env",
}


def resolve_factory(spec: str, kwargs: dict[str, Any] | None = None) -> Callable[[], Environment]:
    """A zero-argument callable making a fresh environment; ``ValueError`` naming ``env.factory``
    for an unknown name, a module that does not import or an attribute that is missing."""
    path = BUILTIN.get(spec, spec)
    if ":" not in path:
        raise ValueError(
            f"env.factory: unknown environment {spec!r} (builtin: {', '.join(BUILTIN)}; or "
            "'package.module:callable')"
        )
    return functools.partial(load_callable(path, "env.factory", "callable"), **(kwargs or {}))


def load_callable(spec: str, key: str, what: str = "callable") -> Callable[..., Any]:
    """``"package.module:name"`` -> that callable (the module searched on ``sys.path``, then in
    the current directory); ``ValueError`` naming ``key`` for a spec not of that form, a module
    that does not import, or a name that is missing or not callable."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"{key}: {spec!r} is not 'package.module:{what}'")
    cwd = os.getcwd()  # ./my_env.py is found, as reward.fn finds ./my_rewards.py
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"{key}: cannot import {mod_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{key}: {mod_name!r} has no {what} {attr!r}")
    return fn
