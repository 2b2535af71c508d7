"""The prompt pipeline's seams (``relayrl.data.prompts``): ``open_task`` is the one place that
reads ``data.task`` and reads nothing itself; ``tokenize_prompts`` is ``RowCache`` over a list;
``PromptSource`` names its training prompts and its eval set apart in the preflight's lengths."""

from __future__ import annotations

import json

import pytest

from relayrl.config import DataConfig, RunConfig, load_config
from relayrl.data import PromptRecord
from relayrl.data.prompts import (
    DatasetTask,
    GeneratedTask,
    PromptSource,
    RowCache,
    open_task,
    tokenize_prompts,
)
from relayrl.model import build_tiny_model, load_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=16))


def test_open_task_reads_the_name_and_nothing_else(tmp_path) -> None:
    missing = tmp_path / "not-yet.jsonl"
    task = open_task(DataConfig(task="jsonl", train_path=str(missing)), seed=0)
    assert isinstance(task, DatasetTask) and task.where == str(missing)  # no file opened yet
    with pytest.raises(ValueError, match="data.train_path is required"):
        open_task(DataConfig(task="jsonl"), seed=0).rows()
    gen = open_task(DataConfig(), seed=5)
    assert isinstance(gen, GeneratedTask)
    step = gen.step_records(3, 8)
    assert step == gen.step_records(3, 8) != gen.step_records(4, 8)  # a function of the step
    again = open_task(DataConfig(), seed=5)
    assert isinstance(again, GeneratedTask) and gen.eval_records(4) == again.eval_records(4)
    with pytest.raises(ValueError, match="unknown data.task 'nope'"):
        open_task(DataConfig.model_construct(task="nope"), seed=0)


def test_tokenize_prompts_is_the_row_cache_over_a_list(tok) -> None:
    records = [PromptRecord("3+5="), PromptRecord("1" * 200), PromptRecord(" "), PromptRecord("7=")]
    kept, report = tokenize_prompts(records, tok, max_tokens=16)
    cache = RowCache(records, tok, max_tokens=16)
    assert kept == [p for p in cache.get(range(len(records))) if p is not None]
    assert [p.record.prompt for p in kept] == ["3+5=", "7="]
    assert (report.total, report.too_long, report.empty) == (4, 1, 1) and report == cache.report


def test_prompt_lengths_name_the_training_file_and_its_held_out_set_apart(tmp_path, tok):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(40)))
    cfg = load_config(
        RunConfig, None, ["data.task=jsonl", f"data.train_path={path}", "data.eval_size=10"]
    ).data
    lengths = PromptSource(cfg, tok, seed=0).prompt_lengths()
    assert {k: len(v) for k, v in lengths.items()} == {
        str(path): 40,  # the rows tokenised so far: the whole (small) file
        f"the eval set held out of {path}": 10,
    }
    arith = PromptSource(DataConfig(eval_size=5), tok, seed=0).prompt_lengths(per_step=4)
    assert {k: len(v) for k, v in arith.items()} == {
        "the arithmetic task": 4,
        "the arithmetic eval set": 5,
    }
