"""OpenEnv environments (PyPI ``openenv-core``) as relayrl environments, over OpenEnv's own
client and server.

``env.factory: openenv`` talks to an OpenEnv environment server through OpenEnv's
``GenericEnvClient`` (its WebSocket session protocol: one session, so one environment instance
on the server, per episode):

- ``env.kwargs: {base_url: "http://host:port"}``: a server already running (``openenv serve``,
  a container, a Space);
- ``env.kwargs: {environment: "pkg.mod:EnvClass", action: "pkg.mod:ActionClass",
  observation: "pkg.mod:ObservationClass"}``: relayrl serves that OpenEnv ``Environment``
  subclass itself, once per process, with OpenEnv's ``create_app`` on uvicorn at
  ``127.0.0.1`` (an ephemeral port), as ``openenv serve`` would (no web interface), for up to
  ``max_sessions`` concurrent sessions (OpenEnv's ``max_concurrent_envs``; its default, 1,
  would refuse the second episode in flight). Its uvicorn logs only critical errors: OpenEnv
  0.3.0's WebSocket endpoint raises on every session a client closes (it closes the socket
  again), which uvicorn would print as an error per episode.

An episode: ``reset`` opens a session and calls the server's ``reset`` with the dataset row's
fields as keyword arguments (the server passes on those the environment's ``reset`` accepts:
``seed``, ``episode_id`` and its own); its observation is the first user message. Each
assistant turn is one action ``{action_field: text}`` (default ``message``); the step's
observation is the next user message, its ``reward`` the turn's reward (the one of the step
that ends the episode: the outcome, ``env.outcome: env``), its ``done`` the end. An
observation is shown as its ``observation_field`` (when given) or as JSON of its fields.
``close`` ends the session. OpenEnv's web interface (gradio) is neither used nor imported.
"""

from __future__ import annotations

import atexit
import json
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from relayrl.env.environment import Environment
from relayrl.env.registry import load_callable
from relayrl.env.types import EnvError, Message, StepResult

_SERVERS: dict[tuple[str, str, str], tuple[str, Any, threading.Thread]] = {}
_LOCK = threading.Lock()
START_TIMEOUT_S = 60.0
MAX_SESSIONS = 64


def serve_locally(
    environment: str, action: str, observation: str, max_sessions: int = MAX_SESSIONS
) -> str:
    """The URL of this process's OpenEnv server for these classes (started on first use:
    ``create_app(EnvClass, ActionClass, ObservationClass)`` on uvicorn, stopped at exit)."""
    key = (environment, action, observation)
    with _LOCK:
        if key in _SERVERS:
            return _SERVERS[key][0]
        import uvicorn
        from openenv.core.env_server import create_app

        env_cls = load_callable(environment, "env.kwargs.environment", "class")
        act_cls = load_callable(action, "env.kwargs.action", "class")
        obs_cls = load_callable(observation, "env.kwargs.observation", "class")
        app = create_app(
            env_cls,
            act_cls,
            obs_cls,
            env_name=env_cls.__name__,
            max_concurrent_envs=max_sessions,
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, name="openenv-server", daemon=True)
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise EnvError(f"the OpenEnv server for {environment} did not start")
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port}"
        _SERVERS[key] = (url, server, thread)
        return url


@atexit.register
def stop_local_servers() -> None:
    """Stop the servers :func:`serve_locally` started."""
    with _LOCK:
        for _, server, thread in _SERVERS.values():
            server.should_exit = True
            thread.join(5)
        _SERVERS.clear()


def observation_text(observation: Any, field: str | None) -> str:
    """An observation as the next user message: its ``field`` when given, else JSON of it."""
    if field is not None:
        if not isinstance(observation, Mapping) or field not in observation:
            keys = list(observation) if isinstance(observation, Mapping) else observation
            raise EnvError(f"env.kwargs.observation_field: {field!r} is not in {keys!r}")
        return str(observation[field])
    return json.dumps(observation, sort_keys=True, default=str)


class OpenEnvEnvironment(Environment):
    """One OpenEnv session per episode (see module)."""

    def __init__(
        self, base_url: str, action_field: str = "message", observation_field: str | None = None
    ) -> None:
        self.base_url = base_url
        self.action_field = action_field
        self.observation_field = observation_field
        self.client: Any = None

    async def reset(self, row: Mapping[str, Any]) -> list[Message]:
        from openenv.core.generic_client import GenericEnvClient

        await self._close_client()
        self.client = GenericEnvClient(base_url=self.base_url)
        await self.client.connect()
        result = await self.client.reset(**dict(row))
        return [
            {
                "role": "user",
                "content": observation_text(result.observation, self.observation_field),
            }
        ]

    async def step(self, message: Message) -> StepResult:
        if self.client is None:
            raise EnvError("step before reset")
        result = await self.client.step({self.action_field: message["content"]})
        info = {"observation": result.observation}
        done = bool(result.done)
        text = observation_text(result.observation, self.observation_field)
        next_msgs: list[Message] = [] if done else [{"role": "user", "content": text}]
        reward = None if result.reward is None else float(result.reward)
        return StepResult(next_msgs, done, reward, info)

    async def close(self) -> None:
        await self._close_client()

    async def _close_client(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await client.close()


def make_openenv_env(
    base_url: str | None = None,
    environment: str | None = None,
    action: str | None = None,
    observation: str | None = None,
    action_field: str = "message",
    observation_field: str | None = None,
    max_sessions: int = MAX_SESSIONS,
) -> OpenEnvEnvironment:
    """``env.factory: openenv`` (see module): a server at ``base_url``, or the classes to serve."""
    import openenv.core  # noqa: F401  (fail at start-up, not in the first episode)

    local = (environment, action, observation)
    if base_url is None and not all(local):
        raise ValueError(
            "env.kwargs: openenv needs base_url, or environment, action and observation "
            "('package.module:Class' each)"
        )
    if base_url is not None and any(local):
        raise ValueError("env.kwargs: give base_url or environment/action/observation, not both")
    url = base_url or serve_locally(str(environment), str(action), str(observation), max_sessions)
    return OpenEnvEnvironment(url, action_field, observation_field)
