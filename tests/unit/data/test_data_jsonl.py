"""JSONL files: prompt rows through the one loader (``load_prompts``), SFT rows, round trips and
file:line errors on real temp files."""

import json
from pathlib import Path

import pytest

from relayrl.data import (
    DataError,
    PromptRecord,
    SFTRecord,
    load_prompts,
    load_sft_jsonl,
    write_jsonl,
)


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_prompts(tmp_path: Path) -> None:
    p = _write(
        tmp_path / "p.jsonl",
        [
            '{"prompt": "3+5=", "answer": "8"}',
            "",
            "   ",
            '{"prompt": "2*4=", "answer": 8, "domain": "math", "level": 2}',
            '{"prompt": "free text"}',
            '{"prompt": "x", "answer": null}',
            '{"prompt": "y", "answer": -1.5}',
        ],
    )
    assert list(load_prompts(p)) == [
        PromptRecord("3+5=", "8"),
        PromptRecord("2*4=", "8", {"domain": "math", "level": 2}),
        PromptRecord("free text", None),
        PromptRecord("x", None),
        PromptRecord("y", "-1.5"),
    ]
    assert list(load_prompts(str(p)))[1].as_sample() == {
        "domain": "math",
        "level": 2,
        "prompt": "2*4=",
        "answer": "8",
    }


def test_load_sft(tmp_path: Path) -> None:
    p = _write(
        tmp_path / "s.jsonl",
        ['{"prompt": "3+5=", "response": "8"}', '{"prompt": "", "response": "", "id": 3}'],
    )
    assert load_sft_jsonl(p) == [SFTRecord("3+5=", "8"), SFTRecord("", "")]


def test_unicode_and_bom(tmp_path: Path) -> None:
    p = tmp_path / "u.jsonl"
    p.write_bytes("\ufeff".encode() + '{"prompt": "ünï ✓", "answer": "é"}\n'.encode())
    assert list(load_prompts(p)) == [PromptRecord("ünï ✓", "é")]


def test_write_jsonl_round_trip(tmp_path: Path) -> None:
    prompts = [PromptRecord("a", "1", {"k": [1, 2]}), PromptRecord("ü", None)]
    path = tmp_path / "sub" / "dir" / "p.jsonl"
    assert write_jsonl(path, prompts) == 2
    assert list(load_prompts(path)) == prompts
    sft = [SFTRecord("q", "r")]
    write_jsonl(tmp_path / "s.jsonl", sft)
    assert load_sft_jsonl(tmp_path / "s.jsonl") == sft
    write_jsonl(tmp_path / "d.jsonl", ({"prompt": str(i)} for i in range(3)))
    lines = (tmp_path / "d.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"prompt": "0"}, {"prompt": "1"}, {"prompt": "2"}]
    assert [x.name for x in tmp_path.iterdir() if x.name.endswith(".tmp")] == []


def test_write_jsonl_rejects_unknown_rows(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="int"):
        write_jsonl(tmp_path / "x.jsonl", [1])
    assert not (tmp_path / "x.jsonl").exists()


GOOD = '{"prompt": "1+1=", "answer": "2"}'


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"prompt": "1+1=", "answer": "2"', "invalid JSON: Expecting ',' delimiter (column 33)"),
        ("not json", "invalid JSON: Expecting value (column 1)"),
        ('["prompt", "1+1="]', "expected a JSON object, got array"),
        ('"just a string"', "expected a JSON object, got string"),
        ("42", "expected a JSON object, got number"),
        ("null", "expected a JSON object, got null"),
        ('{"answer": "2"}', "missing required field 'prompt'"),
        ('{"prompt": 12}', "field 'prompt' must be a string, got number"),
        ('{"prompt": null}', "missing required field 'prompt'"),  # null: no prompt
        ('{"prompt": "q", "answer": [2]}', "field 'answer' must be a string or number, got array"),
        (
            '{"prompt": "q", "answer": true}',
            "field 'answer' must be a string or number, got boolean",
        ),
    ],
)
def test_prompt_errors_report_file_and_line(tmp_path: Path, bad_line: str, message: str) -> None:
    p = _write(tmp_path / "bad.jsonl", [GOOD, "", GOOD, bad_line, GOOD])
    with pytest.raises(DataError) as info:
        load_prompts(p)
    assert str(info.value) == f"{p}:4: {message}"


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"prompt": "q"}', "missing required field 'response'"),
        ('{"response": "r"}', "missing required field 'prompt'"),
        ('{"prompt": "q", "response": 8}', "field 'response' must be a string, got number"),
        ('{"prompt": {}, "response": "r"}', "field 'prompt' must be a string, got object"),
    ],
)
def test_sft_errors_report_file_and_line(tmp_path: Path, bad_line: str, message: str) -> None:
    p = _write(tmp_path / "bad.jsonl", ['{"prompt": "a", "response": "b"}', bad_line])
    with pytest.raises(DataError) as info:
        load_sft_jsonl(p)
    assert str(info.value) == f"{p}:2: {message}"


def test_invalid_utf8_reports_line(tmp_path: Path) -> None:
    p = tmp_path / "bin.jsonl"
    p.write_bytes(GOOD.encode() + b"\n" + b'{"prompt": "\xff"}\n')
    with pytest.raises(DataError) as info:
        load_prompts(p)
    assert str(info.value).startswith(f"{p}:2: not valid UTF-8")


def test_missing_file_and_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError) as info:
        load_prompts(missing)
    assert str(info.value) == f"{missing}: file not found"
    with pytest.raises(DataError, match="not a file"):
        load_sft_jsonl(tmp_path)


def test_empty_file(tmp_path: Path) -> None:
    p = _write(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DataError) as info:
        load_prompts(p)
    assert str(info.value) == f"{p}: no records (the dataset is empty)"


def test_data_error_is_value_error() -> None:
    assert issubclass(DataError, ValueError)
