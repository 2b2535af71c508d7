"""Gym-style text environments run unchanged: a Gymnasium-shaped one (reset -> (obs, info),
step -> 5-tuple) and a SkyRL-gym ``BaseTextEnv``-shaped one (init / step -> dict), through the
episode runner, with per-step rewards and the final reward as the outcome."""

from __future__ import annotations

from qwen_template import ScriptedEngine, qwen_tokenizer
from relayrl.env import ChatTemplateRenderer
from relayrl.env.gym_adapter import GymTextEnvironment
from relayrl.env.registry import resolve_factory
from relayrl.env.runner import EpisodeRunner, RunnerLimits
from relayrl.rollout import GenerationRequest, SamplingParams

closed: list[str] = []


class GuessGym:
    """Gymnasium's API over text: guess the row's number; 'higher' / 'lower' until right."""

    def reset(self, seed=None, options=None):
        self.target = int(options["answer"])
        return f"Guess a number. {options['prompt']}", {}

    def step(self, action: str):
        guess = int(action.strip() or 0)
        if guess == self.target:
            return "", 1.0, True, False, {"guess": guess}
        return ("higher" if guess < self.target else "lower"), -0.1, False, False, {}

    def close(self):
        closed.append("gym")


class GuessSkyRL:
    """SkyRL-gym's BaseTextEnv shape."""

    def __init__(self, row):
        self.target = int(row["answer"])

    def init(self, prompt):
        return prompt, {}

    def step(self, action: str):
        right = action.strip() == str(self.target)
        obs = [] if right else [{"role": "user", "content": "no"}]
        return {"observations": obs, "reward": 1.0 if right else 0.0, "done": right, "metadata": {}}


def make_guess(row, kind="gym"):
    return GuessGym() if kind == "gym" else GuessSkyRL(row)


def _run(factory, replies):
    tok = qwen_tokenizer()
    runner = EpisodeRunner(
        ScriptedEngine(tok, replies),
        factory,
        ChatTemplateRenderer(tok),
        RunnerLimits(max_turns=4, max_model_len=4096),
    )
    req = GenerationRequest(
        [1], SamplingParams(max_tokens=50), metadata={"prompt": "1-9", "answer": "7"}
    )
    try:
        (s,) = runner.generate([req])
    finally:
        runner.close()
    return tok, s


def test_a_gymnasium_shaped_text_env_runs_unchanged():
    closed.clear()
    tok, s = _run(resolve_factory("gym", {"make": "test_env_gym:make_guess"}), ["3", "9", "7"])
    env = s.metadata["env"]
    assert env["stop_reason"] == "env_done" and env["turns"] == 3
    assert env["turn_rewards"] == [-0.1, -0.1] and env["outcome"] == 1.0
    text = tok.decode(s.prompt_ids + s.response_ids)
    assert "Guess a number. 1-9" in text and "higher" in text and "lower" in text
    assert closed == ["gym"]  # closed when its episode ended and the pool let it go


def test_a_skyrl_shaped_text_env_runs_unchanged():
    tok, s = _run(lambda: GymTextEnvironment(lambda row: make_guess(row, "skyrl")), ["1", "7"])
    env = s.metadata["env"]
    assert env["stop_reason"] == "env_done" and env["turns"] == 2 and env["outcome"] == 1.0
    assert env["turn_rewards"] == [0.0]


def test_env_factory_finds_a_module_in_the_current_directory(tmp_path, monkeypatch):
    import sys

    (tmp_path / "my_cwd_env.py").write_text(
        "from relayrl.env.builtin.calculator import CalculatorEnv\n"
        "def make():\n    return CalculatorEnv()\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    env = resolve_factory("my_cwd_env:make")()
    assert type(env).__name__ == "CalculatorEnv"
