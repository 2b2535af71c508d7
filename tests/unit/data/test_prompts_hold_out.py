"""``task: jsonl`` without ``data.eval_path``: the eval prompts are held out of the training
file (seeded), never trained on; too small a file is a one-line error naming both keys."""

from __future__ import annotations

import json

import pytest

from relayrl.config import RunConfig, load_config
from relayrl.data.prompts import PromptSource
from relayrl.model import build_tiny_model, load_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=16))


def _data(tmp_path, rows: int, **overrides):
    path = tmp_path / "train.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) + "\n" for i in range(rows))
    )
    items = [f"{k}={v}" for k, v in overrides.items()]
    return path, load_config(
        RunConfig, None, ["data.task=jsonl", f"data.train_path={path}", *items]
    ).data


def test_eval_prompts_are_held_out_of_the_training_file(tmp_path, tok):
    _, cfg = _data(tmp_path, 300, **{"data.eval_size": 50})
    src = PromptSource(cfg, tok, seed=3)
    held = [p.record.prompt for p in src.eval_set()]
    trained = {p.record.prompt for step in range(20) for p in src.for_step(step, 64)}
    assert len(set(held)) == 50 and not set(held) & trained and len(trained) == 250
    assert held == [p.record.prompt for p in PromptSource(cfg, tok, seed=3).eval_set()]
    assert held != [p.record.prompt for p in PromptSource(cfg, tok, seed=4).eval_set()]


def test_too_small_a_file_for_the_hold_out_names_both_keys(tmp_path, tok):
    path, cfg = _data(tmp_path, 60, **{"data.eval_size": 50})
    with pytest.raises(ValueError) as info:
        PromptSource(cfg, tok, seed=0)
    assert str(info.value) == (
        f"{path}: 60 distinct usable prompts; holding out data.eval_size=50 for the evaluation "
        "would leave 10 to train on (at most half, 30, are held out): set data.eval_path or a "
        "smaller data.eval_size"
    )


def test_a_hold_out_larger_than_the_file_leaves_none_not_a_negative_count(tmp_path, tok):
    """Was `would leave -30 to train on` for 20 prompts and data.eval_size=50."""
    path, cfg = _data(tmp_path, 20, **{"data.eval_size": 50})
    with pytest.raises(ValueError, match=r"would leave 0 to train on \(at most half, 10,"):
        PromptSource(cfg, tok, seed=0)
