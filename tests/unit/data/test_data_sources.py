"""Prompt datasets from JSONL, Parquet and saved Hugging Face datasets (real files), chat
templates, and the over-length skip report."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from relayrl.data import DataError, PromptRecord, render_prompt, tokenize_prompts
from relayrl.data.prompts.read import records_row_by_row

ROWS = [
    {"prompt": "3+5=", "answer": "8", "domain": "math"},
    {"prompt": "2*4=", "answer": 8, "domain": "math"},
    {"prompt": "capital of France?", "answer": "Paris", "domain": "qa"},
]
EXPECTED = [
    PromptRecord("3+5=", "8", {"domain": "math"}),
    PromptRecord("2*4=", "8", {"domain": "math"}),
    PromptRecord("capital of France?", "Paris", {"domain": "qa"}),
]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_same_records_from_jsonl_hf_disk_and_parquet(tmp_path: Path) -> None:
    j = _jsonl(tmp_path / "p.jsonl", ROWS)
    ds = datasets.Dataset.from_list([{**r, "answer": str(r["answer"])} for r in ROWS])
    ds.save_to_disk(str(tmp_path / "hf"))
    ds.to_parquet(str(tmp_path / "p.parquet"))
    (tmp_path / "pq_dir").mkdir()
    ds.select(range(2)).to_parquet(str(tmp_path / "pq_dir" / "a.parquet"))
    ds.select(range(2, 3)).to_parquet(str(tmp_path / "pq_dir" / "b.parquet"))
    for path in (j, tmp_path / "hf", tmp_path / "p.parquet", tmp_path / "pq_dir"):
        assert records_row_by_row(path) == EXPECTED, path


def test_dataset_dict_splits_and_custom_keys(tmp_path: Path) -> None:
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"question": "1+1=", "solution": "2"}]),
            "test": datasets.Dataset.from_list([{"question": "2+2=", "solution": "4"}]),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    kw = dict(prompt_key="question", answer_key="solution")
    assert records_row_by_row(tmp_path / "dd", **kw) == [PromptRecord("1+1=", "2")]
    assert records_row_by_row(tmp_path / "dd", split="test", **kw) == [PromptRecord("2+2=", "4")]
    with pytest.raises(DataError, match="no split 'dev'"):
        records_row_by_row(tmp_path / "dd", split="dev", **kw)


def test_chat_messages_rows(tmp_path: Path) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2="}]
    p = _jsonl(tmp_path / "m.jsonl", [{"messages": msgs, "answer": "3"}])
    (rec,) = records_row_by_row(p)
    assert rec.prompt == "1+2=" and rec.extra["messages"] == msgs and rec.answer == "3"


@pytest.mark.parametrize("fmt", ["jsonl", "hf", "parquet"])
def test_row_without_answer_is_a_clear_error(tmp_path: Path, fmt: str) -> None:
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": None}]
    if fmt == "jsonl":
        path = _jsonl(tmp_path / "p.jsonl", rows)
        where = f"{path}:2: "
    else:
        ds = datasets.Dataset.from_list(rows)
        path = tmp_path / ("hf" if fmt == "hf" else "p.parquet")
        ds.save_to_disk(str(path)) if fmt == "hf" else ds.to_parquet(str(path))
        where = f"{path}[row 1]: "
    assert records_row_by_row(path)[1].answer is None  # optional by default (RLHF prompts)
    with pytest.raises(DataError) as err:
        records_row_by_row(path, require_answer=True)
    assert str(err.value).startswith(where + "missing required field 'answer'")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"answer": "2"}, "missing required field 'prompt'"),
        ({"prompt": 5}, "field 'prompt' must be a string, got number"),
        ({"prompt": "x", "answer": [1]}, "field 'answer' must be a string or number, got array"),
        ({"prompt": "x", "answer": True}, "must be a string or number, got boolean"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "no user turn"),
    ],
)
def test_bad_rows(tmp_path: Path, row: dict, message: str) -> None:
    p = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, row])
    with pytest.raises(DataError, match=f"bad.jsonl:2: .*{message}"):
        records_row_by_row(p)


def test_missing_and_empty_paths(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="file not found"):
        records_row_by_row(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no records"):
        records_row_by_row(tmp_path / "empty.jsonl")
    (tmp_path / "somedir").mkdir()
    with pytest.raises(DataError, match="neither a saved dataset nor Parquet"):
        records_row_by_row(tmp_path / "somedir")


class ToyTokenizer:
    """Whitespace tokenizer; a chat template is optional."""

    def __init__(self, chat_template: str | None = None):
        self.chat_template = chat_template
        self.calls: list[bool] = []

    def __call__(self, text: str, add_special_tokens: bool = True):
        self.calls.append(add_special_tokens)
        ids = [len(w) for w in text.split()]

        class Enc:
            input_ids = ([1] if add_special_tokens else []) + ids

        return Enc()

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        assert tokenize is False
        body = " ".join(f"<{m['role']}> {m['content']}" for m in messages)
        return body + (" <assistant>" if add_generation_prompt else "")


def test_chat_template_applied_when_tokenizer_has_one() -> None:
    rec = PromptRecord("what is 1+1", "2")
    plain = ToyTokenizer()
    assert render_prompt(rec, plain) == ("what is 1+1", False)
    chat = ToyTokenizer(chat_template="{{ messages }}")
    text, used = render_prompt(rec, chat, system_prompt="be brief")
    assert used and text == "<system> be brief <user> what is 1+1 <assistant>"
    assert render_prompt(rec, chat, use_chat_template=False) == ("what is 1+1", False)
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "1+1"},
        {"role": "assistant", "content": "2"},
    ]
    text, _ = render_prompt(PromptRecord("1+1", "2", {"messages": msgs}), chat)
    assert text == "<user> hi <assistant> hello <user> 1+1 <assistant>"
    kept, report = tokenize_prompts([rec], chat, max_tokens=100)
    assert chat.calls == [False]  # the template carries its own special tokens
    assert kept[0].ids == [6, 4, 2, 3, 11]  # "<user> what is 1+1 <assistant>"


def test_over_length_prompts_are_reported_and_skipped() -> None:
    tok = ToyTokenizer()
    records = [
        PromptRecord("a b c"),
        PromptRecord("a " * 50),
        PromptRecord("  "),
        PromptRecord("x"),
    ]
    kept, report = tokenize_prompts(records, tok, max_tokens=8)
    assert [p.record.prompt for p in kept] == ["a b c", "x"]
    assert report.total == 4 and report.too_long == 1 and report.empty == 1
    assert report.skipped == 2
    assert report.message() == "skipped 2 of 4 prompts (1 longer than 8 tokens, 1 empty)"
    assert report.examples and report.examples[0].startswith("a a")


def test_real_tokenizer_skip_count(tmp_path: Path) -> None:
    from relayrl.model import build_tiny_model, load_tokenizer

    tok = load_tokenizer(build_tiny_model(tmp_path / "m", hidden_size=16))
    records = [PromptRecord("3+5="), PromptRecord("1" * 200), PromptRecord("12+13=")]
    kept, report = tokenize_prompts(records, tok, max_tokens=16)
    assert [p.record.prompt for p in kept] == ["3+5=", "12+13="] and report.too_long == 1
    assert kept[0].ids == list(tok("3+5=").input_ids)


def test_prompt_source_reads_hf_and_parquet(tmp_path: Path) -> None:
    from relayrl.config import DataConfig
    from relayrl.data.prompts import PromptSource
    from relayrl.model import build_tiny_model, load_tokenizer

    tok = load_tokenizer(build_tiny_model(tmp_path / "m", hidden_size=16))
    rows = [{"q": f"{i}+1=", "a": str(i + 1)} for i in range(6)] + [{"q": "9" * 300, "a": "x"}]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "hf"))
    ds.to_parquet(str(tmp_path / "p.parquet"))
    for path in (tmp_path / "hf", tmp_path / "p.parquet"):
        cfg = DataConfig.model_validate(
            {
                "task": "jsonl",
                "train_path": str(path),
                "eval_path": str(path),
                "max_prompt_tokens": 64,
                "source": {"prompt_key": "q", "answer_key": "a", "require_answer": True},
            }
        )
        src = PromptSource(cfg, tok, seed=0)
        assert src.skipped == 1  # the 300-character prompt
        batch = src.for_step(0, 4)
        assert len(batch) == 4 and all(p.fields()["answer"] for p in batch)
        assert len(src.eval_set()) == 6
    bad = tmp_path / "bad.jsonl"
    _jsonl(bad, [{"q": "1+1=", "a": "2"}, {"q": "2+2="}])
    cfg = DataConfig.model_validate(
        {
            "task": "jsonl",
            "train_path": str(bad),
            "source": {"prompt_key": "q", "answer_key": "a", "require_answer": True},
        }
    )
    with pytest.raises(DataError, match=r"bad.jsonl:2: missing required field 'a'"):
        PromptSource(cfg, tok, seed=0)
