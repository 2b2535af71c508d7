"""Reward functions: built-ins, the registry, import-path specs and score normalisation."""

import ast
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import relayrl.reward
from relayrl.reward import (
    REWARD_FUNCTIONS,
    RewardSpecError,
    arithmetic,
    exact_match,
    get_reward_fn,
    score,
)


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("8", "8", 1.0),
        (" 8</s>", "8", 1.0),
        ("8", 8, 1.0),
        ("the answer is 8", "8", 1.0),
        ("9", "8", 0.0),
        ("", "8", 0.0),
        ("-3", "-3", 1.0),
        ("3", "-3", 0.0),
        ("8", "8.0", 1.0),
        ("8", "eight", 0.0),  # malformed answer field: 0.0, never raises
        ("8", None, 0.0),
        ("8", [8], 0.0),
        ("8", {"x": 1}, 0.0),
    ],
)
def test_arithmetic(completion: str, answer: object, expected: float) -> None:
    assert arithmetic("3+5=", completion, {"answer": answer}) == expected


@pytest.mark.parametrize("sample", [{}, None, "8", {"answer": float("nan")}])
def test_arithmetic_malformed_sample_gives_zero(sample: object) -> None:
    assert arithmetic("3+5=", "8", sample) == 0.0  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("Paris", "Paris", 1.0),
        ("  Paris\n", " Paris ", 1.0),
        ("paris", "Paris", 0.0),
        ("8", 8, 1.0),
        ("Paris.", "Paris", 0.0),
        ("x", None, 0.0),
    ],
)
def test_exact_match(completion: str, answer: object, expected: float) -> None:
    assert exact_match("q", completion, {"answer": answer}) == expected


def test_exact_match_missing_answer() -> None:
    assert exact_match("q", "x", {}) == 0.0


def test_registry_names() -> None:
    assert REWARD_FUNCTIONS["arithmetic"] is arithmetic
    assert get_reward_fn("arithmetic") is arithmetic
    assert get_reward_fn(" exact_match ") is exact_match


def test_import_path_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert get_reward_fn("relayrl.reward.functions:exact_match") is exact_match
    (tmp_path / "my_rewards_mod.py").write_text(
        "from relayrl.reward import arithmetic\n"
        "def components(prompt, completion, sample):\n"
        "    correct = arithmetic(prompt, completion, sample)\n"
        "    return {'score': correct + 0.25, 'correct': correct, 'short': 0.25}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward_fn("my_rewards_mod:components")
    assert score(fn, "3+5=", "8", {"answer": "8"}) == {
        "correct": 1.0,
        "short": 0.25,
        "score": 1.25,
    }


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        (
            "no_such_reward",
            "not a registered name (arithmetic, code, exact_match, format, humaneval, math",
        ),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("relayrl.reward.functions:nope", "has no attribute 'nope'"),
        ("relayrl.reward.functions:REWARD_FUNCTIONS", "is not callable"),
        (":fn", "expected 'module:function'"),
        ("relayrl.reward:", "expected 'module:function'"),
    ],
)
def test_bad_spec_errors_name_the_spec(spec: str, fragment: str) -> None:
    with pytest.raises(RewardSpecError) as info:
        get_reward_fn(spec)
    assert repr(spec) in str(info.value)
    assert fragment in str(info.value)


def test_empty_spec() -> None:
    with pytest.raises(RewardSpecError, match="non-empty string"):
        get_reward_fn("")


def test_score_normalisation() -> None:
    assert score(arithmetic, "3+5=", "8", {"answer": "8"}) == {"score": 1.0}
    assert score(lambda p, c, s: 1, "", "", {}) == {"score": 1.0}
    assert score(lambda p, c, s: np.float32(0.5), "", "", {}) == {"score": 0.5}
    assert score(lambda p, c, s: torch.tensor(2.0), "", "", {}) == {"score": 2.0}
    assert score(lambda p, c, s: {"score": 3, "b": np.int64(2)}, "", "", {}) == {
        "score": 3.0,
        "b": 2.0,
    }
    # The score is the function's: components are logged, never summed into it (issue 44).
    assert score(lambda p, c, s: {"a": 1.0, "score": 0.1}, "", "", {}) == {"a": 1.0, "score": 0.1}
    out = score(lambda p, c, s: {"a": 0.5, "score": 1}, "", "", {})
    assert all(type(v) is float for v in out.values())


def test_a_dict_without_a_score_names_the_function_and_the_value() -> None:
    def my_reward(prompt: str, completion: str, sample: dict) -> dict:
        return {"reward": 0.78, "exact": 0.75}

    with pytest.raises(TypeError) as info:
        score(my_reward, "", "", {})
    assert str(info.value) == (
        "reward function test_reward_functions:test_a_dict_without_a_score_names_the_function_"
        "and_the_value.<locals>.my_reward returned {'reward': 0.78, 'exact': 0.75}: a dict "
        "needs a 'score' (the reward; other keys are logged components, never summed)"
    )
    with pytest.raises(TypeError, match="returned {}: a dict needs a 'score'"):
        score(lambda p, c, s: {}, "", "", {})


@pytest.mark.parametrize("bad", [None, "1.0", [1.0], {"a": "x"}, {1: 1.0}])
def test_score_rejects_non_numbers(bad: object) -> None:
    def fn(prompt: str, completion: str, sample: dict) -> object:
        return bad

    with pytest.raises(TypeError, match="fn"):
        score(fn, "", "", {})  # type: ignore[arg-type]


def test_reward_does_not_import_higher_layers() -> None:
    higher = ("data", "workers", "controller", "cluster", "plan", "telemetry", "cli")
    for path in Path(relayrl.reward.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                parts = name.split(".")
                assert not (parts[0] == "relayrl" and len(parts) > 1 and parts[1] in higher), (
                    f"{path.name} imports {name}"
                )


def test_a_module_in_the_current_directory_is_found(tmp_path, monkeypatch) -> None:
    """``reward.fn=my_rewards:score`` with ``my_rewards.py`` in the working directory, no
    PYTHONPATH; an unknown module says where it was searched."""
    (tmp_path / "relayrl_cwd_rewards.py").write_text("def score(p, c, s):\n    return 0.5\n")
    monkeypatch.chdir(tmp_path)
    cwd = os.getcwd()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", cwd)])
    try:
        assert get_reward_fn("relayrl_cwd_rewards:score")("p", "c", {}) == 0.5
    finally:
        sys.modules.pop("relayrl_cwd_rewards", None)
    with pytest.raises(RewardSpecError) as info:
        get_reward_fn("relayrl_no_rewards:score")
    assert str(info.value) == (
        "reward function 'relayrl_no_rewards:score': cannot import module 'relayrl_no_rewards': "
        f"no module 'relayrl_no_rewards' on sys.path nor in the current directory ({cwd})"
    )
