"""The first hour, second round (issue 44): each defect a user met on their own model, as the
one line and exit code ``relayrl`` ends with. Resume that refuses what it cannot continue,
checkpoint faults that name the intact checkpoint, corrupt files, a busy port, SFT under the
run-directory rules and in RL's prompt format, the reward function's return contract."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from qwen_template import ROLE_TEMPLATE as TEMPLATE
from relayrl.cli import main
from relayrl.model import build_tiny_model
from relayrl.telemetry import read_metrics
from tiny_runs import TINY_RUN, file_hashes, train_argv, write_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=16)


@pytest.fixture
def finished(tiny, tmp_path, capsys):
    """A finished 2-step run (checkpoints at steps 1 and 2) and its config file."""
    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    assert main(train_argv(config, "train.steps=2", "train.save_every=1")) == 0
    capsys.readouterr()
    return run, config


def _run(capsys, argv):
    rc = main(argv)
    return rc, capsys.readouterr().err.strip()


# ---- --resume refuses what it cannot continue ---------------------------------------------
def test_resume_of_a_missing_or_empty_run_directory_is_refused(tiny, tmp_path, capsys):
    for run, why in ((tmp_path / "typo", "does not exist"), (tmp_path / "empty", "holds no run")):
        if why == "holds no run":
            run.mkdir()
        config = write_config(tmp_path / "run.yaml", tiny, run)
        rc, err = _run(capsys, train_argv(config, "train.steps=2", flags=("--resume",)))
        assert rc == 2
        assert err == (
            f"relayrl train: error: --resume: run directory {run} {why}: no checkpoint to "
            f"continue (looked for {run}/checkpoints/step_*/trainer_state.pt); check "
            "run_dir=..., or start a new run without --resume"
        )
    assert not (tmp_path / "typo").exists()
    assert [p.name for p in (tmp_path / "empty").iterdir()] in ([], [".lock"])


def test_resume_with_another_model_or_algorithm_is_refused_unless_allowed(
    finished, tiny, tmp_path, capsys
):
    run, config = finished
    other = build_tiny_model(tmp_path / "other", hidden_size=16)
    before = file_hashes(run)
    rc, err = _run(
        capsys,
        train_argv(
            config,
            "train.steps=3",
            f"model.path={other}",
            "algo.name=ppo",
            "data.source.chat_template=false",
            flags=("--resume",),
        ),
    )
    assert rc == 2
    assert err == (
        f"relayrl train: error: --resume: the config changes what the run in {run} was trained "
        f"with: model.path ('{tiny}' -> '{other}'), algo.name ('grpo' -> 'ppo'), "
        "data.source.chat_template (True -> False); start a new run (run_dir=... or "
        "--overwrite), or pass --allow-config-change to continue with the change"
    )
    assert file_hashes(run) == before
    same = os.path.relpath(tiny)  # the same model, spelled another way: not a change
    assert main(train_argv(config, "train.steps=3", f"model.path={same}", flags=("--resume",))) == 0
    rc = main(
        train_argv(
            config,
            "train.steps=4",
            "algo.name=ppo",
            flags=("--resume", "--allow-config-change"),
        )
    )
    assert rc == 0
    assert "name: ppo" in (run / "config.yaml").read_text()


# ---- a full disk during a checkpoint: one line naming the cause and the intact checkpoint ----
@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs (root and a mountable tmpfs needed; skipped elsewhere)."""
    where = tmp_path / "tmpfs"
    where.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True
        ).returncode
    ):
        pytest.skip("cannot mount a tmpfs here (the fault-injected test covers the message)")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(where: Path, leave: int) -> None:
    """Write a filler file until ``leave`` bytes are free under ``where``."""
    free = shutil.disk_usage(where).free
    with open(where / "filler", "wb") as fh:
        fh.write(b"\0" * max(free - leave, 0))


def test_checkpoint_on_a_full_tmpfs_is_one_line(tiny, small_tmpfs, tmp_path, capsys, monkeypatch):
    """The second checkpoint meets a full disk inside torch's zip writer (whose own error is
    ``unexpected pos N vs M``): the line names the disk and the intact checkpoint."""
    from relayrl.controller import trainer

    run = small_tmpfs / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    real_save = trainer.save_checkpoint
    calls = {"n": 0}

    def save(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the weights fit; trainer_state.pt (120 kB) does not
            _fill(small_tmpfs, 96 * 1024)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(trainer, "save_checkpoint", save)
    rc, err = _run(capsys, train_argv(config, "train.steps=3", "train.save_every=1"))
    assert rc == 1
    assert err == (
        "relayrl train: error: checkpoint step_000002 could not be written (No space left on "
        f"device); the newest intact checkpoint is {run}/checkpoints/step_000001"
    )
    AutoModelForCausalLM.from_pretrained(run / "checkpoints/step_000001/actor")


def test_a_full_disk_reported_by_torch_without_an_errno_is_one_line(
    tiny, tmp_path, capsys, monkeypatch
):
    """Fault-injected: torch's zip writer raises a RuntimeError (chained to another) on a short
    write, with no errno; the free space tells that the disk is full."""
    from relayrl.controller import checkpoint as ck

    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    real_save = ck.torch.save
    calls = {"n": 0}

    def save(obj, path, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            try:
                raise RuntimeError("basic_ios::clear: iostream error")
            except RuntimeError:
                raise RuntimeError(
                    "[enforce fail at inline_container.cc:672] . unexpected pos 460032 vs 459920"
                ) from None
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(ck.torch, "save", save)
    monkeypatch.setattr(ck, "free_bytes", lambda path: 0)
    rc, err = _run(capsys, train_argv(config, "train.steps=3", "train.save_every=1"))
    assert rc == 1
    assert err == (
        "relayrl train: error: checkpoint step_000002 could not be written (No space left on "
        f"device); the newest intact checkpoint is {run}/checkpoints/step_000001"
    )
    monkeypatch.setattr(ck, "free_bytes", lambda path: 1 << 40)
    calls["n"] = 0
    rc, err = _run(
        capsys, train_argv(config, "train.steps=3", "train.save_every=1", flags=("--overwrite",))
    )
    assert rc == 1
    assert err.startswith(
        "relayrl train: error: checkpoint step_000002 could not be written (write failed: "
        "[enforce fail at inline_container.cc:672] . unexpected pos 460032 vs 459920); "
    )


# ---- corrupt weights and checkpoints ------------------------------------------------------
def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damaged", ["trainer_state.pt", "actor/model.safetensors"])
def test_resume_falls_back_to_the_newest_intact_checkpoint(finished, capsys, damaged):
    run, config = finished
    _truncate(run / "checkpoints/step_000002" / damaged)
    rc = main(train_argv(config, "train.steps=3", flags=("--resume",)))
    out = capsys.readouterr().out
    assert rc == 0
    assert f"checkpoint {run}/checkpoints/step_000002 cannot be read (" in out
    assert (
        f"kept as corrupt_step_000002, resuming from the newest intact checkpoint "
        f"{run}/checkpoints/step_000001" in out
    )
    assert f"resumed from {run}/checkpoints/step_000001 at step 1" in out
    assert (run / "checkpoints/corrupt_step_000002" / damaged).is_file()  # kept, not deleted
    assert (run / "checkpoints/step_000003/trainer_state.pt").is_file()


def test_every_checkpoint_corrupt_and_corrupt_model_weights_are_one_line(finished, capsys):
    run, config = finished
    for step in (1, 2):
        _truncate(run / f"checkpoints/step_00000{step}/trainer_state.pt")
    rc, err = _run(capsys, train_argv(config, "train.steps=3", flags=("--resume",)))
    assert rc == 2
    assert err.startswith(
        f"relayrl train: error: --resume: no checkpoint in {run} can be read (step_000002: "
        "trainer_state.pt cannot be read: "
    )
    assert "; step_000001: trainer_state.pt cannot be read: " in err
    model = run / "checkpoints/step_000001/actor"
    _truncate(model / "model.safetensors")
    for argv in (
        train_argv(config, f"model.path={model}", f"run_dir={run}-new"),
        ["serve", str(model), "--seconds", "0.1"],
    ):
        rc, err = _run(capsys, argv)
        assert rc == 2
        assert err == (
            f"relayrl {argv[0]}: error: {model}/model.safetensors: the weights file is corrupt or "
            "truncated (Error while deserializing header: incomplete metadata, file not fully "
            "covered)"
        )


# ---- relayrl serve: a busy port, another model's name, a huge body, a slow tokenisation ----
def test_serve_on_a_busy_port_is_one_line(tiny, capsys):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        rc, err = _run(capsys, ["serve", str(tiny), "--port", str(port), "--seconds", "0.1"])
    assert rc == 2
    assert err == (
        f"relayrl serve: error: cannot listen on 127.0.0.1:{port} (Address already in use); "
        "choose another port with --port (0: any free one)"
    )


@pytest.fixture
def strict_server(tiny):
    from relayrl.env.openai_server import OpenAIServer
    from relayrl.model import load_causal_lm, load_tokenizer
    from relayrl.rollout import RolloutEngine

    tok = load_tokenizer(tiny)
    engine = RolloutEngine(
        load_causal_lm(tiny), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    srv = OpenAIServer(engine, tok, "tiny", max_body_bytes=1 << 20, strict_model=True)
    srv.start()
    yield srv
    srv.stop()


def test_serve_answers_another_model_404_and_a_huge_body_413(strict_server):
    url = strict_server.base_url()
    small = {"prompt": "1+1=", "max_tokens": 2}
    with httpx.Client(timeout=60) as http:
        assert http.post(f"{url}/completions", json={**small, "model": "tiny"}).status_code == 200
        assert http.post(f"{url}/completions", json=small).status_code == 200  # no name: ok
        r = http.post(f"{url}/completions", json={**small, "model": "gpt-4o"})
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found"
        assert r.json()["error"]["param"] == "model"
        r = http.post(f"{url}/completions", json={**small, "prompt": "x" * (2 << 20)})
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit holds while the body streams in
            for _ in range(3):
                yield b" " * (1 << 19)

        r = http.post(f"{url}/completions", content=chunks())
        assert r.status_code == 413


def test_one_slow_tokenisation_does_not_block_other_requests(strict_server, monkeypatch):
    """A prompt whose tokenisation takes 3 s (a 20 MB body took 33 s on the serving loop):
    a small request sent meanwhile is answered before it ends."""
    from relayrl.env.agent_chat import ChatRendering

    real_encode = ChatRendering.encode

    def encode(self, text):
        if text.startswith("slow"):
            time.sleep(3)
        return real_encode(self, text)

    monkeypatch.setattr(ChatRendering, "encode", encode)
    url = strict_server.base_url()
    done: dict[str, float] = {}

    def post(name: str, prompt: str) -> None:
        with httpx.Client(timeout=60) as http:
            r = http.post(f"{url}/completions", json={"prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200
        done[name] = time.monotonic()

    slow = threading.Thread(target=post, args=("slow", "slow 1+1="))
    t0 = time.monotonic()
    slow.start()
    time.sleep(0.3)
    post("fast", "1+1=")
    slow.join()
    assert done["fast"] < done["slow"]
    assert done["fast"] - t0 < 2.5


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
    rc, err = _run(capsys, ["sft", str(config), "steps=1"])
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
        rc, err = _run(capsys, ["sft", str(config), f"output_dir={bad}"])
        assert rc == 2
        assert err == (
            f"relayrl sft: error: output directory {bad} {why}; choose another output_dir=..."
        )
        assert time.monotonic() - t0 < 5  # refused before loading anything, not after training


def test_sft_into_its_own_model_path_is_refused(tiny, tmp_path, capsys):
    before = file_hashes(tiny)
    config = _sft_config(tmp_path / "sft.yaml", tiny, tiny)
    for flags in ((), ("--overwrite",)):
        rc, err = _run(capsys, ["sft", str(config), *flags])
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
    rc, err = _run(capsys, ["sft", str(config)])
    assert rc == 2
    assert err == (
        f"relayrl sft: error: output directory {small_tmpfs / 'sft'} cannot be written "
        "(Read-only file system)"
    )


# ---- the reward function's contract; a reward exception saves the last completed step -------
REWARDS = """
CALLS = {"n": 0}

def no_score(prompt, completion, sample):
    return {"reward": 0.78, "exact": 0.75}

def explodes(prompt, completion, sample):
    CALLS["n"] += 1
    if CALLS["n"] > 10:  # 2 eval prompts, then 4 answers a step: step 3 fails
        return 1 / 0
    return {"score": 0.5, "length": float(len(completion))}
"""


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    name = f"rewards_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_a_reward_dict_without_a_score_is_one_line(tiny, tmp_path, rewards_module, capsys):
    config = write_config(tmp_path / "run.yaml", tiny, tmp_path / "run")
    rc, err = _run(
        capsys, train_argv(config, "train.steps=2", f"reward.fn={rewards_module}:no_score")
    )
    assert rc == 1
    assert err == (  # an infrastructure failure of every sample (issue 43's budget): one line
        "relayrl train: error: no sample of the step is left to train: infrastructure failures, "
        f"mostly reward_fn (4 of 4); last error: reward function {rewards_module}:no_score "
        "returned {'reward': 0.78, 'exact': 0.75}: a dict needs a 'score' (the reward; other "
        "keys are logged components, never summed) (step 1); no checkpoint was written"
    )


def test_a_reward_exception_checkpoints_the_last_completed_step(
    tiny, tmp_path, rewards_module, capsys
):
    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    fn = f"reward.fn={rewards_module}:explodes"
    rc, err = _run(capsys, train_argv(config, "train.steps=5", fn))  # save_every: 0
    assert rc == 1
    assert err == (
        "relayrl train: error: no sample of the step is left to train: infrastructure failures, "
        f"mostly reward_fn (4 of 4); last error: reward function {rewards_module}:explodes raised "
        f"ZeroDivisionError: division by zero (step 3); checkpoint {run}/checkpoints/"
        "step_000002 written; continue with --resume"
    )
    logged = [r for r in read_metrics(run) if "reward_mean" in r]
    assert [r["step"] for r in logged] == [1, 2]
    assert logged[0]["reward/length"] >= 0  # a named component, logged as a metric
    assert logged[0]["reward_mean"] == 0.5  # the score, not score + components
    sys.modules[rewards_module].CALLS["n"] = -(10**6)  # fixed: resume trains steps 3-5
    assert main(train_argv(config, "train.steps=5", fn, flags=("--resume",))) == 0
    assert [r["step"] for r in read_metrics(run) if "reward_mean" in r] == [1, 2, 3, 4, 5]


HANGS = """
import time

CALLS = {"n": 0}

def hangs(prompt, completion, sample):
    CALLS["n"] += 1
    if CALLS["n"] > 6:  # 2 eval prompts, 4 answers of step 1: step 2 hangs
        time.sleep(30)
    return 0.0
"""


def test_a_reward_function_that_hangs_times_out_in_one_line(tiny, tmp_path, capsys, monkeypatch):
    name = f"hangs_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(HANGS)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    t0 = time.monotonic()
    rc, err = _run(
        capsys,
        train_argv(
            config,
            "train.steps=4",
            f"reward.fn={name}:hangs",
            "reward.fn_timeout_s=1",
        ),
    )
    assert rc == 1
    assert time.monotonic() - t0 < 20
    assert err == (
        "relayrl train: error: no sample of the step is left to train: infrastructure failures, "
        f"mostly reward_fn (4 of 4); last error: reward function {name}:hangs did not return "
        "within 1 s "
        f"(reward.fn_timeout_s) (step 2); checkpoint {run}/checkpoints/step_000001 written; "
        "continue with --resume"
    )


def test_the_progress_count_of_a_resumed_run_goes_on_from_its_checkpoint(finished, capsys):
    run, config = finished
    assert main(train_argv(config, "train.steps=4", flags=("--resume",))) == 0
    lines = (run / "progress.log").read_text().splitlines()
    assert " step 3/4 (75%) " in lines[-2] and " step 4/4 (100%) " in lines[-1]
    assert not any(" step 1/2 " in line for line in lines[-2:])


@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_resuming_an_async_run_says_it_is_not_exact(tiny, tmp_path, capsys, schedule):
    """Sync resumes bit-identically, overlap and async do not: the resume says so in one line."""
    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    common = (f"schedule={schedule}", "train.save_every=1")
    assert main(train_argv(config, "train.steps=1", *common)) == 0
    capsys.readouterr()
    assert main(train_argv(config, "train.steps=2", *common, flags=("--resume",))) == 0
    out = capsys.readouterr().out
    note = (
        f"note: a {schedule} run resumes correctly but not bit-identically: the generations in "
        "flight when it stopped are generated again, under other timing and policy versions "
        "(only schedule: sync resumes exactly)"
    )
    assert f"resumed from {run}/checkpoints/step_000001 at step 1" in out
    assert (note in out.splitlines()) == (schedule == "async"), out


@pytest.mark.parametrize("command", ["train", "sft", "eval", "filter"])
def test_a_config_typo_is_reported_before_torch_is_imported(tmp_path, command):
    """The one line of a typo came after 6-20 s of imports; now before torch loads."""
    config = tmp_path / "run.yaml"
    config.write_text("seed: 0\n")
    extra = ["--output", str(tmp_path / "o.jsonl")] if command == "filter" else []
    code = (
        "import sys\nfrom relayrl.cli import main\n"
        f"rc = main({[command, str(config), 'no_such_key=1', *extra]!r})\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\nsys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        f"relayrl {command}: error: command line: unknown config key 'no_such_key'"
    )


def test_a_typo_in_the_config_file_is_reported_before_torch_and_transformers_load(tmp_path):
    """``relayrl train bad.yaml``: the file's line, and neither torch nor transformers loaded."""
    config = tmp_path / "bad.yaml"
    config.write_text("seed: 0\nalgo:\n  kl_cof: 0.1\n")
    code = (
        "import sys\nfrom relayrl.cli import main\n"
        f"rc = main(['train', {str(config)!r}])\n"
        "assert not {'torch', 'transformers'} & set(sys.modules), 'torch was imported'\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert (
        proc.stderr.strip() == f"relayrl train: error: {config}:3: unknown config key 'algo.kl_cof'"
    )


def test_sft_checkpoints_and_resumes_to_the_same_weights(tiny, tmp_path, capsys, monkeypatch):
    from safetensors.torch import load_file

    from relayrl.controller import sft

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    config = _sft_config(tmp_path / "sft.yaml", tiny, whole)
    argv = ["sft", str(config), "steps=4", "save_every=2", "lr_schedule=linear"]
    assert main(argv) == 0
    rc, err = _run(capsys, [*argv, f"output_dir={parts}", "--resume"])
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


def test_near_zero_weight_syncs_do_not_paint_over_a_long_runs_timeline(tmp_path):
    """1000 steps of 1 s training, each followed by a 0.1 ms weight sync: the widened sync
    bars used to cover the whole row; now training's colour fills most of it."""
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from relayrl.telemetry.plots import PHASE_COLOURS, timeline_plot

    spans = []
    for i in range(1000):
        spans += [(i * 1.0001, 1.0, "train"), (i * 1.0001 + 1.0, 1e-4, "weight_sync")]
    png = timeline_plot(tmp_path / "t.png", [("run", {"trainer": spans})])
    pixels = (imread(png)[..., :3] * 255).round().astype(int)

    def count(name: str) -> int:
        rgb = [int(PHASE_COLOURS[name][i : i + 2], 16) for i in (1, 3, 5)]
        return int((abs(pixels - rgb).sum(axis=-1) <= 6).sum())

    assert count("train") > 10 * count("weight_sync")


def test_the_timelines_legend_gives_each_kind_of_span_its_real_total():
    """The widened near-zero bars are labelled with how little time they really took:
    train 1000 x 1 s = 1000 s, weight_sync 1000 x 0.1 ms = 0.1 s, share 0.1 / 1000.1."""
    from relayrl.telemetry.plots import timeline_labels

    spans = [(i * 1.0001, 1.0, "train") for i in range(1000)]
    spans += [(i * 1.0001 + 1.0, 1e-4, "weight_sync") for i in range(1000)]
    runs = [("a", {"trainer": spans}), ("b", {"rollout": [(0.0, 999.9, "generate")]})]
    assert timeline_labels(runs) == {
        "train": "train: 1,000 s (50%)",
        "weight_sync": "weight_sync: 0.1 s (0.005%)",
        "generate": "generate: 1,000 s (50%)",
    }


def test_any_oserror_under_the_run_directory_is_one_line(tiny, tmp_path, capsys, monkeypatch):
    """Permission denied (not one of the disk-full errnos) on a file of the run: one line."""
    from relayrl.telemetry.metrics import MetricsLogger

    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    real_log = MetricsLogger.log

    def log(self, step, metrics):
        if step == 2:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(run / "tb"))
        return real_log(self, step, metrics)

    monkeypatch.setattr(MetricsLogger, "log", log)
    rc, err = _run(capsys, train_argv(config, "train.steps=3", "train.save_every=1"))
    assert rc == 1
    assert err == (
        f"relayrl train: error: could not write {run}/tb (Permission denied); the newest "
        f"intact checkpoint is {run}/checkpoints/step_000001"
    )


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
    rc, err = _run(capsys, [*argv, f"output_dir={parts}"])
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


def _readme_first_run_commands() -> list[list[str]]:
    """The README's "A first run on your own model" code block, one argv per command (the
    ``relayrl`` dropped, continuation lines joined, comments cut)."""
    import shlex

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = text.split("## A first run on your own model")[1].split("```bash\n")[1]
    block = block.split("```")[0].replace("\\\n", " ")
    return [shlex.split(line, comments=True)[1:] for line in block.splitlines() if line.strip()]


def test_the_readmes_path_from_trained_to_evaluated_and_served_runs(
    tiny, tmp_path, capsys, monkeypatch
):
    """The README's commands as written: train, then evaluate, report and serve the trained
    checkpoint (the model, data, step numbers and sizes swapped for the tiny ones)."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    (tmp_path / "my_rewards.py").write_text(
        "def score(prompt, completion, sample):\n"
        "    return float(completion.strip() == sample['answer'])\n"
    )
    swap = {  # substrings of the README's arguments
        "/models/qwen2-0.5b": str(tiny),
        "configs/grpo_jsonl.yaml": str(root / "configs/grpo_jsonl.yaml"),
        "my.jsonl": str(root / "examples/arithmetic_prompts.jsonl"),
        "step_000200": "step_000002",
    }
    extra = {
        "train": [*TINY_RUN, "train.steps=2", "train.save_every=1"],
        "eval": TINY_RUN,
        "serve": ["--seconds", "0.1"],
    }
    commands = _readme_first_run_commands()
    assert [argv[0] for argv in commands] == ["train", "eval", "report", "serve"]
    for argv in commands:
        for old, new in swap.items():
            argv = [a.replace(old, new) for a in argv]
        argv = ["0" if a == "8000" else a for a in argv]  # any free port
        assert main([*argv, *extra.get(argv[0], [])]) == 0, (argv, capsys.readouterr().err)
    out = capsys.readouterr().out
    actor = "runs/my_grpo/checkpoints/step_000002/actor"
    assert f"serving {actor} as 'actor' at http://127.0.0.1:" in out
    assert "pass@8" in out and (tmp_path / actor / "model.safetensors").is_file()
