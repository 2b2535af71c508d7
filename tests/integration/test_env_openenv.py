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

import json
import math

import pytest

from qwen_template import ScriptedEngine, qwen_tokenizer
from relayrl.env import ChatTemplateRenderer
from relayrl.env.registry import resolve_factory
from relayrl.env.runner import EpisodeRunner, RunnerLimits
from relayrl.rollout import GenerationRequest, SamplingParams

pytest.importorskip("openenv.core")
import openenv_envs  # noqa: E402

LOCAL = {
    "environment": "openenv_envs:AnswerEnv",
    "action": "openenv_envs:AnswerAction",
    "observation": "openenv_envs:AnswerObservation",
    "observation_field": "text",
}
ROW = {"prompt": "3+4=", "answer": "7"}


def _run(factory, replies, row=ROW, max_turns=4):
    tok = qwen_tokenizer()
    runner = EpisodeRunner(
        ScriptedEngine(tok, replies),
        factory,
        ChatTemplateRenderer(tok),
        RunnerLimits(max_turns=max_turns, max_model_len=4096),
    )
    req = GenerationRequest([1], SamplingParams(max_tokens=80), metadata=row)
    try:
        (s,) = runner.generate([req])
    finally:
        runner.close()
    return tok, s


@pytest.mark.parametrize(("replies", "outcome"), [(["5", "7"], 1.0), (["5", "6"], 0.0)])
def test_an_openenv_episode_runs_over_its_server(replies, outcome):
    before = len(openenv_envs.EVENTS)
    tok, s = _run(resolve_factory("openenv", LOCAL), replies)
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
    tok, s = _run(resolve_factory("openenv", {"base_url": url}), ["7"])
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
    from relayrl.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("openenv") / "m", hidden_size=32, seed=1)


def test_grpo_trains_through_an_openenv_environment(tiny_path, tmp_path):
    from helpers import run_config
    from relayrl.cluster.local import build_local_roles
    from relayrl.controller.trainer import train

    run_dir = tmp_path / "run"
    kwargs = ", ".join(f"{k}: '{v}'" for k, v in LOCAL.items())
    cfg = run_config(
        tiny_path,
        run_dir,
        "env.factory=openenv",
        f"env.kwargs={{{kwargs}}}",
        "env.outcome=env",
        "env.max_turns=2",
        "rollout.max_tokens=8",
        "algo.prompts_per_step=2",
        "algo.group_size=2",
        "data.eval_size=2",
        "train.steps=2",
        "train.save_every=0",
    )
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "reward_mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["env/episodes"] == 4 and r.get("env/failures", 0) == 0
        assert r["env/stop_env_done"] + r.get("env/stop_max_turns", 0) == 4
        assert 1 <= r["env/turns_mean"] <= 2 and 0.0 <= r["reward_mean"] <= 1.0
        assert r["actor/optimizer_steps"] > 0 and math.isfinite(r["actor/grad_norm"])
