"""SFT's validation pass rate: the arithmetic stream or a JSONL ``val_path``; early stop."""

from __future__ import annotations

import pytest

from relayrl.config import SFTConfig
from relayrl.controller.sft import run_sft
from relayrl.data import ArithmeticTask, write_jsonl
from relayrl.model import build_tiny_model


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("sftval") / "base", hidden_size=32)


def _cfg(base, tmp_path, **kw) -> SFTConfig:
    return SFTConfig(
        model_path=str(base),
        output_dir=str(tmp_path / "out"),
        steps=10,
        batch_size=8,
        threads=1,
        progress=False,
        eval_size=16,
        **kw,
    )


def test_jsonl_val_path_is_scored_and_target_stops_early(base, tmp_path):
    train = tmp_path / "train.jsonl"
    write_jsonl(
        train,
        [
            {"prompt": r.prompt, "response": r.response + "..."}
            for r in ArithmeticTask().sft_records(64)
        ],
    )
    val = tmp_path / "val.jsonl"
    write_jsonl(val, ArithmeticTask(seed=3).sample(16))
    cfg = _cfg(
        base,
        tmp_path,
        task="jsonl",
        train_path=str(train),
        val_path=str(val),
        eval_every=5,
        target_pass_rate=0.0,  # any pass rate reaches it: stop at the first validation
    )
    out = run_sft(cfg)
    assert out["sft/steps"] == 5
    assert 0.0 <= out["sft/val_pass_rate"] <= 1.0
    assert (tmp_path / "out" / "config.json").exists()


def test_jsonl_without_val_path_cannot_validate(base, tmp_path):
    train = tmp_path / "train.jsonl"
    write_jsonl(train, [{"prompt": "1+1=", "response": "2"}])
    cfg = _cfg(base, tmp_path, task="jsonl", train_path=str(train), eval_every=5)
    with pytest.raises(ValueError, match="val_path"):
        run_sft(cfg)
