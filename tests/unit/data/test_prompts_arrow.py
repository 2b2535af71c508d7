"""Parquet files and saved Hugging Face datasets feed the lazy prompt path as JSONL does: the
table is kept as Arrow (the prompt column read once, no record per row), rows tokenised when
first drawn; the draws, eval set and skips equal the JSONL file's of the same rows; a table
that needs per-row checks goes through the row reader, whose errors name the file and row."""

from __future__ import annotations

import json
import time

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relayrl.config import RunConfig, load_config
from relayrl.data import DataError
from relayrl.data.prompts import PromptSource, load_prompts
from relayrl.data.prompts import source as source_mod
from relayrl.data.prompts.read import records_row_by_row
from relayrl.model import build_tiny_model, load_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=16))


def _rows(n: int) -> list[dict]:
    # every 7th prompt is 120 characters: over data.max_prompt_tokens=64 (redrawn when drawn)
    return [
        {"prompt": "9" * 120 if i % 7 == 3 else f"{i % 4000}+{i // 4000}=", "answer": i,
         "level": i % 3, "tags": [f"t{i % 2}"]}
        for i in range(n)
    ]  # fmt: skip


def _write_all(tmp_path, rows: list[dict]) -> dict[str, object]:
    j = tmp_path / "t.jsonl"
    j.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    (tmp_path / "pq").mkdir()
    half = len(rows) // 2
    pq.write_table(pa.Table.from_pylist(rows[:half]), tmp_path / "pq" / "a.parquet")
    pq.write_table(pa.Table.from_pylist(rows[half:]), tmp_path / "pq" / "b.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    # row groups of 7 rows: the table is many record batches (a row is found by bisection)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "g.parquet", row_group_size=7)
    return {
        "jsonl": j,
        "parquet": tmp_path / "t.parquet",
        "parquet_groups": tmp_path / "g.parquet",
        "parquet_dir": tmp_path / "pq",
        "hf": tmp_path / "hf",
    }


def _cfg(path, *extra):
    return load_config(RunConfig, None, ["data.task=jsonl", f"data.train_path={path}", *extra]).data


def test_arrow_rows_are_the_records_of_the_row_reader(tmp_path) -> None:
    paths = _write_all(tmp_path, _rows(30))
    expected = records_row_by_row(paths["jsonl"])
    for name, path in paths.items():
        rows = load_prompts(path)
        if name != "jsonl":
            assert rows._table is not None, name  # kept as Arrow, no record per row
        assert list(rows) == expected, name
        assert rows.records([29, 0, 5]) == [expected[29], expected[0], expected[5]], name
        assert rows[-1] == expected[-1] and rows[3:6] == expected[3:6]
        if name == "parquet_groups":
            assert len(rows._table.to_batches()) == 5  # 30 rows in groups of 7
        assert records_row_by_row(path) == expected, name


def test_tables_that_need_row_checks_keep_their_errors(tmp_path) -> None:
    def write(name: str, rows: list[dict]):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / name)
        return tmp_path / name

    null_prompt = write("np.parquet", [{"prompt": "a", "answer": "1"}, {"answer": "2"}])
    with pytest.raises(DataError, match=r"np.parquet\[row 1\]: missing required field 'prompt'"):
        load_prompts(null_prompt)
    bools = write("b.parquet", [{"prompt": "a", "answer": True}])
    with pytest.raises(DataError, match=r"b.parquet\[row 0\]: field 'answer' must be a string or"):
        load_prompts(bools)
    no_answer = write("na.parquet", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    with pytest.raises(DataError, match=r"na.parquet\[row 1\]: missing required field 'answer'"):
        load_prompts(no_answer, require_answer=True)
    assert [r.answer for r in load_prompts(no_answer)] == ["1", None]
    ints = write("ints.parquet", [{"prompt": 7, "answer": "1"}])
    with pytest.raises(DataError, match=r"ints.parquet\[row 0\]: field 'prompt' must be a string"):
        load_prompts(ints)
    chat = [{"messages": [{"role": "user", "content": "hi"}], "answer": "x"}]
    datasets.Dataset.from_list(chat).save_to_disk(str(tmp_path / "chat"))
    rows = load_prompts(tmp_path / "chat")  # the chat form: through the row reader
    assert list(rows) == records_row_by_row(tmp_path / "chat") and rows[0].prompt == "hi"
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="bad.parquet: cannot read Parquet"):
        load_prompts(tmp_path / "bad.parquet")
    write("empty.parquet", [])
    with pytest.raises(DataError, match="no records"):
        load_prompts(tmp_path / "empty.parquet")


def test_parquet_and_saved_datasets_draw_what_the_jsonl_file_draws(tmp_path, tok, monkeypatch):
    """The same 700 rows as JSONL, Parquet, a Parquet directory and a saved dataset, read
    lazily (PRETOKENIZE made small): the same eval set, the same prompts at every step (over
    an epoch: redraws of the over-long rows included), the same skip counts."""
    monkeypatch.setattr(source_mod, "PRETOKENIZE", 16)
    paths = _write_all(tmp_path, _rows(700))
    sources = {
        name: PromptSource(_cfg(p, "data.max_prompt_tokens=64", "data.eval_size=20"), tok, seed=3)
        for name, p in paths.items()
    }
    ref = sources.pop("jsonl")
    assert ref._cache.seen < 700  # the lazy path
    steps = [ref.for_step(s, 64) for s in range(12)]
    for name, src in sources.items():
        assert src._cache.rows._table is not None, name
        assert src.eval_set() == ref.eval_set(), name
        assert [src.for_step(s, 64) for s in range(12)] == steps, name
        assert src.skipped == ref.skipped > 0, name
        assert src._cache.seen == ref._cache.seen, name


@pytest.mark.parametrize(
    "rows", [100_000, pytest.param(1_000_000, marks=pytest.mark.slow)], ids=["100k", "1M"]
)
def test_a_large_parquet_file_starts_without_tokenising_it(tmp_path, tok, rows) -> None:
    """Start-up reads the prompt column and tokenises PRETOKENIZE rows plus the held-out
    set, as for JSONL (measured on the 2-core machine, bench/prompt_sampling.py --format
    parquet: 100k rows in 0.22-0.25 s of CPU, 1M in 2.5 s; with a record per row built at
    start, as before, 2.5 s and 21 s)."""
    table = pa.table(
        {
            "prompt": [f"{i % 1000}+{i // 1000}=" for i in range(rows)],
            "answer": list(range(rows)),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    t = time.perf_counter()
    src = PromptSource(_cfg(tmp_path / "t.parquet"), tok, seed=0)
    start = time.perf_counter() - t
    print(f"{rows} Parquet rows: start {start:.2f} s")
    assert src._cache.seen <= source_mod.PRETOKENIZE + 400
    assert start < 30.0
    first_fresh = source_mod.PRETOKENIZE // 64 + 1
    times = []
    for step in range(first_fresh, first_fresh + 20):
        t = time.perf_counter()
        got = src.for_step(step, 64)
        times.append(time.perf_counter() - t)
        assert len(got) == 64 and all(p.record.answer is not None for p in got)
    assert sorted(times)[10] < 0.5
