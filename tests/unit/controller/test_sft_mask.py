"""SFT's loss mask on multi-turn traces (``SFTRecord.segments``): observation tokens are inputs
but not targets, as an RL trajectory's loss mask; and ``run_sft``'s validation callback."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from relayrl.config import SFTConfig
from relayrl.controller.sft import masked_nll, run_sft, tokenize_pair, tokenize_record
from relayrl.data import DataError, SFTRecord, load_sft_jsonl, write_jsonl
from relayrl.env.builtin.calculator import sft_traces
from relayrl.model import build_tiny_model
from relayrl.model.tiny import build_char_tokenizer


class _Row:
    prompt = "12*34="
    answer = "408"


def test_calculator_trace_masks_exactly_the_observation():
    tok = build_char_tokenizer()
    (trace,) = sft_traces([_Row()], tok.eos_token, tool_fraction=1.0)
    rec = SFTRecord.from_segments(
        trace["prompt"], [(s["text"], s["train"]) for s in trace["segments"]]
    )
    assert rec.response == trace["response"]
    prompt, response, mask = tokenize_record(tok, rec)
    # char tokens: '<tool_call>' 11 + '{"name":"calculator","arguments":{"expression":"12*34"}}'
    # 56 + '</tool_call>' 12 + <eos> 1 = 80 trained; 'T:408\nA:' 8 untrained; '408' 3 + the
    # final <eos> 1 = 4 trained
    assert mask == [1] * 80 + [0] * 8 + [1] * 4
    assert len(response) == 92 and response[79] == response[91] == tok.eos_token_id
    assert tok.decode(response[80:88]) == "T:408\nA:"
    assert (prompt, response) == tokenize_pair(tok, rec)
    # a plain record trains every response token and its EOS, as before
    assert tokenize_record(tok, SFTRecord("3+5=", "8"))[2] == [1, 1]
    (direct,) = sft_traces([_Row()], tok.eos_token, tool_fraction=0.0)
    assert direct["segments"] == [{"text": "408", "train": True}]


def test_masked_nll_hand_computed():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    response_mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # row 0: token 1 untrained; row 1: its mask is shorter than R (pad: 0)
    loss = masked_nll(logp, response_mask, [[1, 0, 1], [1, 1]])
    assert loss.item() == pytest.approx((1 + 3 + 4 + 5) / 4)
    assert masked_nll(logp, response_mask, [[1, 1, 1], [1, 1, 1]]).item() == pytest.approx(
        (1 + 2 + 3 + 4 + 5) / 5
    )


def test_segments_round_trip_and_bad_rows_name_file_line(tmp_path: Path):
    rec = SFTRecord.from_segments("q", [("a", True), ("obs", False), ("b", True)])
    write_jsonl(tmp_path / "s.jsonl", [rec, SFTRecord("x", "y")])
    assert load_sft_jsonl(tmp_path / "s.jsonl") == [rec, SFTRecord("x", "y")]
    p = tmp_path / "only_segments.jsonl"
    p.write_text(json.dumps({"prompt": "q", "segments": [{"text": "a"}, {"text": "b"}]}) + "\n")
    assert load_sft_jsonl(p) == [SFTRecord("q", "ab", (("a", True), ("b", True)))]
    with pytest.raises(ValueError, match="join to 'ab', not the response 'abc'"):
        SFTRecord("q", "abc", (("a", True), ("b", False)))
    bad = {
        '{"prompt": "q", "segments": []}': "field 'segments' must be a non-empty array",
        '{"prompt": "q", "segments": ["a"]}': "segments[0]: expected an object",
        '{"prompt": "q", "segments": [{"text": 1}]}': "segments[0]: field 'text' must be a str",
        '{"prompt": "q", "segments": [{"text": "a", "train": 1}]}': "field 'train' must be a b",
        '{"prompt": "q", "response": "b", "segments": [{"text": "a"}]}': "'response' differs",
    }
    for line, msg in bad.items():
        p.write_text('{"prompt": "a", "response": "b"}\n' + line + "\n")
        with pytest.raises(DataError, match=re.escape(msg)) as info:
            load_sft_jsonl(p)
        assert str(info.value).startswith(f"{p}:2: ")


def test_run_sft_stops_when_the_validation_callback_reaches_the_target(tmp_path: Path):
    """A real SFT on masked traces (tiny model): the callback sees the live module in eval
    mode every ``eval_every`` steps, and the run stops at the first check at the target."""
    base = build_tiny_model(tmp_path / "base", hidden_size=32)
    tok = build_char_tokenizer()
    write_jsonl(tmp_path / "t.jsonl", sft_traces([_Row()] * 4, tok.eos_token, 0.5))
    seen: list[tuple[bool, bool]] = []

    def validate(model: torch.nn.Module) -> float:
        seen.append((model.training, torch.is_grad_enabled()))
        return 0.2 * len(seen)

    cfg = SFTConfig(
        model_path=str(base),
        output_dir=str(tmp_path / "sft"),
        task="jsonl",
        train_path=str(tmp_path / "t.jsonl"),
        steps=50,
        batch_size=4,
        eval_every=2,
        target_pass_rate=0.5,
        threads=1,
        progress=False,
    )
    out = run_sft(cfg, validate=validate)
    assert seen == [(False, False)] * 3
    assert out["sft/steps"] == 6 and out["sft/val_pass_rate"] == pytest.approx(0.6)
    assert (tmp_path / "sft" / "config.json").is_file()
    with pytest.raises(ValueError, match="validate callback needs eval_every"):
        run_sft(
            cfg.model_copy(update={"eval_every": 0, "target_pass_rate": None}), validate=validate
        )
