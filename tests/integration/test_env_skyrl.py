"""SkyRL-gym (the real PyPI ``skyrl-gym``) through relayrl's environment path, unchanged: its own
``text2sql`` environment against a real SQLite database written here (a multi-turn episode: the
model's ``<sql>`` runs through SkyRL's SQL tool, the result is the next user turn, the
``<solution>`` is scored against the gold query), its ``gsm8k_multi_turn`` (per-turn rewards,
its own ``max_turns``), and a user-defined ``BaseTextEnv`` subclass with a SkyRL ``ToolGroup``,
through the episode runner with the Qwen2.5 template (scripted replies); then a few GRPO steps
of a tiny model through the trainer (``relayrl train``'s code path) on a built-in and on the
user-defined environment."""

from __future__ import annotations

import json
import sqlite3

import pytest

from env_episodes import env_tiny_model, run_episode, train_through_env
from relayrl.env.registry import resolve_factory

skyrl_gym = pytest.importorskip("skyrl_gym")
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput  # noqa: E402
from skyrl_gym.tools.core import ToolGroup, tool  # noqa: E402

closed: list[str] = []


class DigitTools(ToolGroup):
    """A SkyRL tool group: one tool counting the digits of a text."""

    def __init__(self) -> None:
        super().__init__(name="DigitTools")

    @tool
    def count_digits(self, text: str) -> str:
        return str(sum(c.isdigit() for c in text))


class DigitsEnv(BaseTextEnv):
    """A user's SkyRL env, two turns: turn 1's text goes through the tool, whose answer is the
    next user message; each turn is rewarded by its share of digit characters (in [0, 1])."""

    def __init__(self, env_config=None, extras=None):
        super().__init__()
        self.max_turns = int((extras or {}).get("max_turns", 2))
        self.init_tool_groups([DigitTools()])

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        reward = sum(c.isdigit() for c in action) / max(len(action), 1)
        done = self.turns >= self.max_turns
        obs = []
        if not done:
            n = self._execute_tool("DigitTools", "count_digits", [action])
            obs = [{"role": "user", "content": f"digits: {n}"}]
        return BaseTextEnvStepOutput(observations=obs, reward=reward, done=done, metadata={})

    def get_metrics(self):
        return {"turns": self.turns}

    def close(self):
        closed.append("digits")


if "relayrl_test_digits" not in skyrl_gym.registry:
    skyrl_gym.register(id="relayrl_test_digits", entry_point="test_env_skyrl:DigitsEnv")


@pytest.fixture
def spider(tmp_path):
    """SkyRL's text2sql layout: ``{db_path}/spider/database/{db_id}/{db_id}.sqlite``."""
    db = tmp_path / "spider" / "database" / "shop"
    db.mkdir(parents=True)
    con = sqlite3.connect(db / "shop.sqlite")
    con.execute("CREATE TABLE items (name TEXT, price INTEGER)")
    con.executemany("INSERT INTO items VALUES (?, ?)", [("pen", 3), ("ink", 5), ("pad", 4)])
    con.commit()
    con.close()
    return tmp_path


SQL_ROW = {
    "prompt": "Most expensive price?",
    "db_id": "shop",
    "data": "spider",
    "reward_spec": {"method": "rule", "ground_truth": "SELECT max(price) FROM items"},
}


@pytest.mark.parametrize(
    ("solution", "reward"),
    [("SELECT max(price) FROM items", 1.0), ("SELECT min(price) FROM items", 0.0)],
)
def test_skyrl_text2sql_runs_a_multi_turn_episode_unchanged(spider, solution, reward):
    factory = resolve_factory(
        "skyrl", {"env_class": "text2sql", "env_config": {"db_path": str(spider)}}
    )
    replies = [
        "<think>look</think><sql>SELECT name, price FROM items ORDER BY price</sql>",
        f"<think>done</think><solution>{solution}</solution>",
    ]
    tok, s = run_episode(factory, replies, {**SQL_ROW, "max_turns": 3})
    env = s.metadata["env"]
    assert env["stop_reason"] == "env_done" and env["turns"] == 2
    assert env["turn_rewards"] == [0.0] and env["outcome"] == reward
    assert env["infos"][0]["tool_name"] == "sql"
    text = tok.decode(s.prompt_ids + s.response_ids)
    assert "Most expensive price?" in text
    # the tool's result (SQLite through pandas; SkyRL keeps the rows as a set) is the next
    # user turn, then the solution
    obs = text.split("<observation>", 1)[1].split("</observation>", 1)[0]
    assert all(f"{n}  {p}\n" in obs for n, p in [("pen", 3), ("ink", 5), ("pad", 4)])
    assert "You have 2 turns left" in obs
    assert text.rstrip().endswith(f"<solution>{solution}</solution><|im_end|>")


def test_skyrl_gsm8k_multi_turn_turn_rewards_and_its_own_max_turns():
    factory = resolve_factory("skyrl", {"env_class": "gsm8k_multi_turn"})
    row = {"prompt": "12+30=", "answer": "42", "max_turns": 3}
    tok, s = run_episode(factory, ["#### 41", "no idea", "#### 40"], row, max_turns=5)
    env = s.metadata["env"]
    # 0.2 / max_turns for a well-formatted wrong answer, 0 unformatted; done at its max_turns
    assert env["stop_reason"] == "env_done" and env["turns"] == 3
    assert env["turn_rewards"] == pytest.approx([0.2 / 3, 0.0])
    assert env["outcome"] == pytest.approx(0.2 / 3)
    assert env["infos"][-1]["metrics"] == {"steps": 3}
    assert tok.decode(s.prompt_ids + s.response_ids).count("'#### ANSWER'") == 2
    _, s = run_episode(factory, ["#### 41", "#### 42"], row, max_turns=5)
    assert s.metadata["env"]["turns"] == 2 and s.metadata["env"]["outcome"] == 1.0


def test_skyrl_text2sql_in_a_worker_process(spider):
    """``env.isolation: process``: the SkyRL env is built and stepped in a spawned worker."""
    factory = resolve_factory(
        "skyrl", {"env_class": "text2sql", "env_config": {"db_path": str(spider)}}
    )
    replies = [
        "<sql>SELECT max(price) FROM items</sql>",
        "<think>5</think><solution>SELECT 5</solution>",
    ]
    tok, s = run_episode(factory, replies, SQL_ROW, isolation="process")
    env = s.metadata["env"]
    assert env["stop_reason"] == "env_done" and env["turns"] == 2 and env["outcome"] == 1.0
    assert "<observation> 0\n 5\n" in tok.decode(s.prompt_ids + s.response_ids)


@pytest.mark.parametrize(("reply", "reward"), [("so #### 42", 1.0), ("#### 41", 0.0), ("42", 0.0)])
def test_skyrl_gsm8k_scores_one_turn(reply, reward):
    factory = resolve_factory("skyrl", {"env_class": "gsm8k"})
    _, s = run_episode(factory, [reply], {"prompt": "12+30=", "answer": "42"})
    env = s.metadata["env"]
    assert env["stop_reason"] == "env_done" and env["turns"] == 1
    assert env["outcome"] == reward and env["turn_rewards"] == []


@pytest.mark.parametrize("env_class", ["relayrl_test_digits", "test_env_skyrl:DigitsEnv"])
def test_a_user_defined_base_text_env_runs_unchanged(env_class):
    closed.clear()
    factory = resolve_factory("skyrl", {"env_class": env_class})
    tok, s = run_episode(factory, ["ab12", "7777"], {"prompt": "Say digits", "max_turns": 2})
    env = s.metadata["env"]
    assert env["stop_reason"] == "env_done" and env["turns"] == 2
    assert env["turn_rewards"] == [0.5] and env["outcome"] == 1.0
    assert env["infos"][-1]["metrics"] == {"turns": 2}
    assert "digits: 2" in tok.decode(s.prompt_ids + s.response_ids)  # the SkyRL tool's answer
    assert closed == ["digits"]


def test_a_skyrl_shaped_message_list_prompt_goes_to_init_as_is():
    factory = resolve_factory("skyrl", {"env_class": "relayrl_test_digits"})
    prompt = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Go"}]
    tok, s = run_episode(factory, ["1", "2"], {"prompt": prompt, "max_turns": 2})
    text = tok.decode(s.prompt_ids + s.response_ids)
    assert "system\nBe terse.<|im_end|>" in text and "user\nGo<|im_end|>" in text


def test_relayrl_max_turns_bounds_a_skyrl_episode():
    closed.clear()
    factory = resolve_factory("skyrl", {"env_class": "relayrl_test_digits"})
    _, s = run_episode(factory, ["1"], {"prompt": "p", "max_turns": 9}, max_turns=3)
    assert s.metadata["env"]["stop_reason"] == "max_turns" and s.metadata["env"]["turns"] == 3
    assert closed == ["digits"]


def test_an_unknown_env_class_is_refused_naming_the_registry():
    with pytest.raises(ValueError, match="'nope' is not in skyrl_gym's registry.*gsm8k"):
        resolve_factory("skyrl", {"env_class": "nope"})()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return env_tiny_model(tmp_path_factory.mktemp("skyrl"))


@pytest.mark.parametrize("env_class", ["gsm8k_multi_turn", "relayrl_test_digits"])
def test_grpo_trains_through_a_skyrl_env(tiny_path, tmp_path, env_class):
    """On relayrl's arithmetic rows (``answer`` -> ``reward_spec.ground_truth``)."""
    steps = train_through_env(
        tiny_path,
        tmp_path / "run",
        "skyrl",
        f"env.kwargs={{env_class: {env_class}, extras: {{max_turns: 2}}}}",
    )
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in steps)


def test_grpo_trains_through_skyrl_text2sql_on_skyrl_shaped_jsonl_rows(tiny_path, tmp_path, spider):
    """docs/environments.md's example: SkyRL-shaped rows (``db_id``, ``data``, ``reward_spec``)
    in a JSONL file, the SQLite database under ``env_config.db_path``."""
    rows = tmp_path / "sql.jsonl"
    rows.write_text("".join(json.dumps({**SQL_ROW, "prompt": f"q{i}?"}) + "\n" for i in range(6)))
    steps = train_through_env(
        tiny_path,
        tmp_path / "run",
        "skyrl",
        "data.task=jsonl",
        f"data.train_path={rows}",
        f"env.kwargs={{env_class: text2sql, env_config: {{db_path: '{spider}'}}, "
        "extras: {max_turns: 2}}",
    )
    # a tiny model writes no <solution>: SkyRL's format check scores every episode -1
    assert all(r["reward_mean"] == -1.0 for r in steps)
