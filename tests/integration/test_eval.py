"""pass@k and maj@k by hand, and ``relayrl eval`` with n = 8 on the SFT'd tiny model."""

from __future__ import annotations

import json
import math
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest

from relayrl.cli import main
from relayrl.config import ConfigError, RunConfig, load_config
from relayrl.controller.evaluate import answer_reader, maj_at_k, majority_vote, pass_at_k


def test_pass_at_k_by_hand() -> None:
    # n = 5 answers, c = 2 correct: 1 - C(3, k) / C(5, k)
    assert pass_at_k(5, 2, 1) == pytest.approx(1 - 3 / 5)  # 0.4
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 0.7
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 0.9
    assert pass_at_k(5, 2, 4) == 1.0  # n - c = 3 < k: every 4-subset holds a correct answer
    assert pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(8, 8, 1) == 1.0
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # pass@1 is the fraction correct


def test_pass_at_k_is_stable_where_binomials_are_huge() -> None:
    """n = 2000: C(2000, 100) has 190 digits (float overflows at 309, intermediate products
    long before); the product form matches exact rational arithmetic."""
    for c, k in [(10, 100), (1, 1), (1500, 500), (3, 1000)]:
        exact = 1 - Fraction(math.comb(2000 - c, k), math.comb(2000, k))
        assert pass_at_k(2000, c, k) == pytest.approx(float(exact), rel=1e-9, abs=1e-12)


def test_pass_at_k_rejects_impossible_counts() -> None:
    for n, c, k in [(4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)]:
        with pytest.raises(ValueError, match="pass@k"):
            pass_at_k(n, c, k)


def test_maj_at_k_by_hand() -> None:
    answers = ["3", "5", "3", None, "5", "5"]
    correct = [a == "5" for a in answers]
    assert maj_at_k(answers, correct, 6) == 1.0  # all 6: "5" three times, "3" twice
    assert maj_at_k(answers, correct, 1) == pytest.approx(3 / 6)  # the fraction correct
    assert maj_at_k(answers[:3], correct[:3], 3) == 0.0  # "3" twice, "5" once
    # three answers a, b, a (a correct), k = 2: {a, b} tie -> a (seen first): 1;
    # {a, a}: 1; {b, a}: tie -> b: 0; so 2/3
    assert maj_at_k(["a", "b", "a"], [True, False, True], 2) == pytest.approx(2 / 3)
    assert maj_at_k([None, None], [False, False], 2) == 0.0  # nothing readable: wrong
    assert majority_vote([None, "7", "7", "2"]) == 1  # index of the winner's first answer
    with pytest.raises(ValueError, match="maj@k"):
        maj_at_k(["1"], [True], 2)


def test_maj_at_k_samples_subsets_when_there_are_too_many() -> None:
    """n = 30, k = 15: C(30, 15) = 155 million subsets, so 2000 are drawn. 20 answers "x"
    (correct) and 10 "y": a subset votes "y" only with >= 8 of its 15 answers "y", which
    P(Y >= 8), Y ~ Hypergeometric(30, 10, 15), puts at 0.0251; maj@15 is 1 - that."""
    answers = ["x"] * 20 + ["y"] * 10
    correct = [a == "x" for a in answers]
    p_y = sum(math.comb(10, y) * math.comb(20, 15 - y) for y in range(8, 11)) / math.comb(30, 15)
    got = maj_at_k(answers, correct, 15)
    assert got == pytest.approx(1 - p_y, abs=0.015)  # 2000 draws: std 0.0035
    assert got == maj_at_k(answers, correct, 15)  # seeded


def test_maj_at_k_groups_equivalent_math_answers() -> None:
    read, same = answer_reader("math")
    answers = [read(t) for t in [r"\boxed{1/2}", r"so \boxed{0.5}", r"\boxed{3}"]]
    assert majority_vote(answers, same) == 0  # 1/2 and 0.5 are one answer, voted twice
    read_int, same_int = answer_reader("auto", "arithmetic")
    assert same_int is None and read_int("the answer is 42") == "42"


def test_eval_config_checks() -> None:
    with pytest.raises(ConfigError, match="eval.k"):
        load_config(RunConfig, None, ["eval.n=4", "eval.k=[1,8]"])
    with pytest.raises(ConfigError, match="eval.greedy"):
        load_config(RunConfig, None, ["eval.n=4", "eval.greedy=true"])
    cfg = load_config(RunConfig, None, ["eval.n=8"])
    assert cfg.eval.ks == [1, 8] and not cfg.eval.is_greedy
    assert load_config(RunConfig, None, []).eval.is_greedy


def _by_hand(rows: list[dict], n: int) -> dict[str, float]:
    """pass@1, pass@n and maj@n recomputed from the per-answer JSONL, independently."""
    prompts: dict[int, list[dict]] = {}
    for r in rows:
        prompts.setdefault(r["prompt_index"], []).append(r)
    p1 = pn = mn = 0.0
    for answers in prompts.values():
        assert sorted(a["sample_index"] for a in answers) == list(range(n))
        p1 += sum(a["correct"] for a in answers) / n
        pn += any(a["correct"] for a in answers)
        votes = Counter(a["extracted"] for a in answers if a["extracted"] is not None)
        if votes:
            top = max(votes.values())
            first = next(a for a in answers if votes.get(a["extracted"]) == top)
            mn += first["correct"]
    m = len(prompts)
    return {"pass@1": p1 / m, f"pass@{n}": pn / m, f"maj@{n}": mn / m}


def test_relayrl_eval_n8_pass_at_k_maj_at_k_per_sample_jsonl(
    sft_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two datasets in one call (the config's held-out set and a JSONL file), 8 sampled
    answers per prompt: pass@1, pass@8, maj@8 in the table and the summary, one JSONL line
    per answer, and the numbers agree with a recomputation from those lines."""
    cfg = tmp_path / "eval.yaml"
    cfg.write_text(
        f"model:\n  path: {sft_model}\nrun_dir: {tmp_path / 'run'}\nthreads: 1\n"
        "data:\n  eval_size: 12\neval:\n  seed: 0\n"
    )
    extra = tmp_path / "sums.jsonl"
    extra.write_text(
        "".join(
            json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
            for a, b in [(12, 7), (40, 40), (3, 5), (25, 61), (9, 90), (70, 11)]
        )
    )
    out = tmp_path / "answers.jsonl"
    argv = ["eval", str(cfg), "--n", "8", "--data", "held-out", "--data", str(extra)]
    assert main([*argv, "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    for col in ("pass@1", "pass@8", "maj@8"):
        assert col in printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert set(summary) == {"held-out", "sums"}
    for name, prompts in (("held-out", 12), ("sums", 6)):
        mine = [r for r in rows if r["dataset"] == name]
        assert len(mine) == prompts * 8
        assert {"completion", "extracted", "score", "correct", "reference"} <= set(mine[0])
        got = summary[name]
        for key, value in _by_hand(mine, 8).items():
            assert got[key] == pytest.approx(value), (name, key)
        assert got["pass@1"] <= got["pass@8"]
    # the SFT'd model solves some held-out sums but not all on every sample
    held = summary["held-out"]
    assert 0.0 < held["pass@1"] < held["pass@8"]


def test_eval_table_orders_pass_then_maj_by_k() -> None:
    from rich.console import Console

    from relayrl.telemetry.summary import eval_table

    rows = {"d": {"maj@8": 0.5, "pass@8": 0.75, "pass@1": 0.25, "prompts": 4, "n": 8}}
    console = Console(width=120, record=True)
    console.print(eval_table(rows))
    text = console.export_text()
    assert text.index("pass@1") < text.index("pass@8") < text.index("maj@8")
    assert "25.0%" in text and "75.0%" in text and "50.0%" in text
