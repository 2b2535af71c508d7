"""OpenEnv (the real PyPI ``openenv-core``) through relayrl's environment path: an OpenEnv
``Environment`` (tests/support/openenv_envs.py, written against openenv-core's server API) served by
OpenEnv's own ``create_app`` on a local HTTP/WebSocket server and reached through OpenEnv's
``GenericEnvClient``, one session per episode: a two-turn episode (the wrong answer's hint is
the next user turn, the right one ends it with reward 1) through the episode runner with the
Qwen2.5 template, the same against a server given by ``base_url``, the session closed on the
server after each episode, bad settings refused in one line, then two GRPO steps of a tiny model
through the trainer.

Skipped unless ``openenv.core`` imports: openenv-core is not in requirements.lock (it declares
gradio, which the lock cannot hold; see docs/environments.md).
"""

from __future__ import annotations

import pytest

from env_episodes import env_tiny_model, run_episode, train_through_env
from relayrl.env.registry import resolve_factory

pytest.importorskip("openenv.core")
import openenv_envs  # noqa: E402

LOCAL = {
    "environment": "openenv_envs:AnswerEnv",
    "action": "openenv_envs:AnswerAction",
    "observation": "openenv_envs:AnswerObservation",
    "observation_field": "text",
}
ROW = {"prompt": "3+4=", "answer": "7"}


@pytest.mark.parametrize(("replies", "outcome"), [(["5", "7"], 1.0), (["5", "6"], 0.0)])
def test_an_openenv_episode_runs_over_its_server(replies, outcome):
    before = len(openenv_envs.EVENTS)
    tok, s = run_episode(resolve_factory("openenv", LOCAL), replies, ROW)
    env = s.metadata["env"]
    assert env["stop_reason"] == "env_done" and env["turns"] == 2
    assert env["turn_rewards"] == [0.0] and env["outcome"] == outcome
    assert env["infos"][0]["observation"] == {"text": "wrong, it has 1 characters"}
    text = tok.decode(s.prompt_ids + s.response_ids)
    assert "Q: 3+4=" in text and "wrong, it has 1 characters" in text
    # the server reset an instance with the row and closed it when the session ended
    assert openenv_envs.EVENTS[before:] == ["reset 3+4=", "close"]


def test_a_server_given_by_base_url_and_observations_as_json():
    from relayrl.env.openenv_adapter import serve_locally

    url = serve_locally(LOCAL["environment"], LOCAL["action"], LOCAL["observation"])
    tok, s = run_episode(resolve_factory("openenv", {"base_url": url}), ["7"], ROW)
    env = s.metadata["env"]
    assert env["outcome"] == 1.0 and env["turns"] == 1
    assert '{"text": "Q: 3+4="}' in tok.decode(s.prompt_ids)  # no observation_field: JSON


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "needs base_url, or environment, action and observation"),
        ({**LOCAL, "base_url": "http://x"}, "not both"),
        ({**LOCAL, "environment": "openenv_envs:Nope"}, "env.kwargs.environment"),
    ],
)
def test_bad_settings_are_one_line_naming_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve_factory("openenv", kwargs)()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return env_tiny_model(tmp_path_factory.mktemp("openenv"))


def test_grpo_trains_through_an_openenv_environment(tiny_path, tmp_path):
    kwargs = ", ".join(f"{k}: '{v}'" for k, v in LOCAL.items())
    steps = train_through_env(tiny_path, tmp_path / "run", "openenv", f"env.kwargs={{{kwargs}}}")
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in steps)
