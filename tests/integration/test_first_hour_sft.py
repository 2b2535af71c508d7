"""The first hour (issue 44), ``relayrl sft``: it renders prompts as RL does and records the
format (a run that renders them otherwise is warned), follows the run-directory rules (never
overwrites, not into its own model, an unwritable output refused before training), and
checkpoints and resumes (also on SIGTERM) to the uninterrupted run's weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from qwen_template import ROLE_TEMPLATE as TEMPLATE
from relayrl.cli import main
from relayrl.model import build_tiny_model
from tiny_runs import TINY_RUN, file_hashes, mounted_tmpfs, run_cli, write_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=16)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs (root and a mountable tmpfs needed; skipped elsewhere)."""
    with mounted_tmpfs(tmp_path / "tmpfs", "2m") as where:
        yield where


# ---- relayrl sft: RL's prompt format, recorded; the run-directory rules ---------------------


@pytest.fixture(scope="module")
def chat_tiny(tmp_path_factory):
    """The tiny model with TEMPLATE as its tokenizer's chat template."""
    from relayrl.model import load_tokenizer

    out = build_tiny_model(tmp_path_factory.mktemp("chat") / "m", hidden_size=16)
    tok = load_tokenizer(out)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)
    return out


def _sft_config(path: Path, model: Path, out: Path) -> Path:
    path.write_text(
        f"model_path: {model}\noutput_dir: {out}\nsteps: 2\nbatch_size: 2\nnum_examples: 20\n"
        "threads: 1\nprogress: false\nwarmup_steps: 0\n"
    )
    return path


def test_sft_renders_prompts_as_rl_does_and_records_the_format(chat_tiny, tmp_path, capsys):
    from relayrl.controller.sft import tokenize_record
    from relayrl.data import PromptRecord, SFTRecord
    from relayrl.data.prompts import encode_prompts
    from relayrl.model import load_tokenizer

    tok = load_tokenizer(chat_tiny)
    rec = SFTRecord("3+5=", "8")
    for templated in (True, False):
        rl_ids = encode_prompts([PromptRecord("3+5=")], tok, templated)[0]
        assert tokenize_record(tok, rec, templated)[0] == rl_ids
    assert tok.decode(tokenize_record(tok, rec)[0]) == "U: 3+5=\nA: "

    out = tmp_path / "sft"
    config = _sft_config(tmp_path / "sft.yaml", chat_tiny, out)
    assert main(["sft", str(config)]) == 0
    assert json.loads((out / "prompt_format.json").read_text()) == {
        "format": "chat_template",
        "system_prompt": None,
    }
    capsys.readouterr()
    run_cfg = write_config(tmp_path / "run.yaml", out, tmp_path / "run")
    for key, warned in (("true", False), ("false", True)):
        argv = ["eval", str(run_cfg), *TINY_RUN, f"data.source.chat_template={key}"]
        assert main(argv) == 0
        err = capsys.readouterr().err.strip()
        assert (
            err
            == (
                f"warning: {out} was fine-tuned on prompts in its chat template "
                "(prompt_format.json) but this run renders raw prompts; set "
                "data.source.chat_template=true to ask it as it was trained"
            )
        ) == warned, err

    raw = tmp_path / "raw"  # data.source.chat_template=false: the same key as train and eval
    config = _sft_config(tmp_path / "raw.yaml", chat_tiny, raw)
    assert main(["sft", str(config), "data.source.chat_template=false"]) == 0
    assert json.loads((raw / "prompt_format.json").read_text())["format"] == "raw"


def test_sft_never_overwrites_and_checks_its_output_before_training(tiny, tmp_path, capsys):
    out = tmp_path / "sft"
    config = _sft_config(tmp_path / "sft.yaml", tiny, out)
    assert main(["sft", str(config)]) == 0
    capsys.readouterr()
    before = file_hashes(out)
    rc, err = run_cli(capsys, ["sft", str(config), "steps=1"])
    assert rc == 2
    assert err == (
        f"relayrl sft: error: output directory {out} already holds config.json, "
        "generation_config.json, model.safetensors, prompt_format.json, ...; choose another "
        f"output_dir=..., or pass --overwrite to move it to {out}.prev-1"
    )
    assert file_hashes(out) == before
    assert main(["sft", str(config), "steps=1", "--overwrite"]) == 0
    assert f"were moved to {out}.prev-1" in capsys.readouterr().out
    assert file_hashes(tmp_path / "sft.prev-1") == before  # the earlier model, intact
    assert (out / "model.safetensors").is_file()

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for bad, why in (
        (blocker / "sft", f"cannot be created ({blocker} is a file)"),
        (blocker, "is a file"),
    ):
        t0 = time.monotonic()
        rc, err = run_cli(capsys, ["sft", str(config), f"output_dir={bad}"])
        assert rc == 2
        assert err == (
            f"relayrl sft: error: output directory {bad} {why}; choose another output_dir=..."
        )
        assert time.monotonic() - t0 < 5  # refused before loading anything, not after training


def test_sft_into_its_own_model_path_is_refused(tiny, tmp_path, capsys):
    before = file_hashes(tiny)
    config = _sft_config(tmp_path / "sft.yaml", tiny, tiny)
    for flags in ((), ("--overwrite",)):
        rc, err = run_cli(capsys, ["sft", str(config), *flags])
        assert rc == 2
        assert err == (
            f"relayrl sft: error: output_dir {tiny} is model_path: the model trained from would "
            "be replaced; choose another output_dir=..."
        )
    assert file_hashes(tiny) == before


def test_sft_into_a_read_only_filesystem_is_refused_before_training(
    tiny, small_tmpfs, tmp_path, capsys
):
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    config = _sft_config(tmp_path / "sft.yaml", tiny, small_tmpfs / "sft")
    rc, err = run_cli(capsys, ["sft", str(config)])
    assert rc == 2
    assert err == (
        f"relayrl sft: error: output directory {small_tmpfs / 'sft'} cannot be written "
        "(Read-only file system)"
    )


def test_sft_checkpoints_and_resumes_to_the_same_weights(tiny, tmp_path, capsys, monkeypatch):
    from safetensors.torch import load_file

    from relayrl.controller import sft

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    config = _sft_config(tmp_path / "sft.yaml", tiny, whole)
    argv = ["sft", str(config), "steps=4", "save_every=2", "lr_schedule=linear"]
    assert main(argv) == 0
    rc, err = run_cli(capsys, [*argv, f"output_dir={parts}", "--resume"])
    assert rc == 2
    assert err == (
        f"relayrl sft: error: --resume: output directory {parts} does not exist: no checkpoint "
        f"to continue (looked for {parts}/checkpoints/step_*/trainer_state.pt); check "
        "output_dir=..., or start a new run without --resume"
    )
    real_forward = sft.forward_logprobs
    calls = {"n": 0}

    def forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(sft, "forward_logprobs", forward)
    assert main([*argv, f"output_dir={parts}"]) == 130
    assert sorted(p.name for p in (parts / "checkpoints").iterdir()) == ["latest", "step_000002"]
    capsys.readouterr()
    assert main([*argv, f"output_dir={parts}", "--resume"]) == 0
    assert f"resumed from {parts}/checkpoints/step_000002 at step 2" in capsys.readouterr().out
    a = load_file(whole / "model.safetensors")
    b = load_file(parts / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit-identical to the uninterrupted run
    assert (parts / "checkpoints/step_000002/trainer_state.pt").is_file()  # kept


def test_sigterm_during_sft_checkpoints_the_last_completed_step(
    tiny, tmp_path, capsys, monkeypatch
):
    from safetensors.torch import load_file

    from relayrl.controller import sft

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    config = _sft_config(tmp_path / "sft.yaml", tiny, whole)
    argv = ["sft", str(config), "steps=4"]  # save_every: 0, only the signal saves
    assert main(argv) == 0
    real_forward = sft.forward_logprobs
    calls = {"n": 0}

    def forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(sft, "forward_logprobs", forward)
    rc, err = run_cli(capsys, [*argv, f"output_dir={parts}"])
    assert rc == 143
    assert err == (
        f"relayrl sft: stopped by SIGTERM after step 2; checkpoint {parts}/checkpoints/"
        "step_000002 written; continue with --resume"
    )
    monkeypatch.setattr(sft, "forward_logprobs", real_forward)
    assert main([*argv, f"output_dir={parts}", "--resume"]) == 0
    a = load_file(whole / "model.safetensors")
    b = load_file(parts / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit-identical to the uninterrupted run
