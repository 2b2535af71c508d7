"""Planner CLI subcommands, the profiler on a real tiny HF model, and the calibration script."""

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from helpers import load_bench
from relayrl.plan.cli import add_subcommands

ROOT = Path(__file__).resolve().parents[3]


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="relayrl")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    rc = args.fn(args)
    return rc, capsys.readouterr().out


def json_rows(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_registers_all_subcommands():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_subcommands(sub)
    assert {"simulate", "reshard", "placement", "plan", "cost", "profile"} <= set(sub.choices)
    for name in sub.choices:
        assert callable(sub.choices[name].get_default("fn"))


def test_reshard_cli_json(capsys):
    rc, out = run_cli(
        [
            "reshard",
            "--train",
            "1-8-1",
            "--gen",
            "1-2",
            "--model-gb",
            "140",
            "--bandwidth",
            "50",
            "--json",
        ],
        capsys,
    )
    assert rc == 0
    rows = {r["strategy"]: r for r in json_rows(out)}
    assert rows["hybridflow"]["comm_gb"] == 52.5 and rows["hybridflow"]["peak_gb"] == 70.0
    assert rows["hybridflow-v"]["redundant_gb"] == 17.5
    assert rows["separate"]["transition_s"] == pytest.approx(2.8)
    rc, out = run_cli(["reshard", "--train", "1-4-2", "--gen", "1-2", "--per-gpu"], capsys)
    assert rc == 0 and "per GPU" in out


def test_simulate_cli(capsys, tmp_path):
    rc, out = run_cli(
        [
            "simulate",
            "--steps",
            "3",
            "--batch",
            "64",
            "--eta",
            "0,2",
            "--lengths",
            "lognormal:500:0.8:4096",
            "--json",
        ],
        capsys,
    )
    assert rc == 0
    rows = json_rows(out)
    assert [r["config"] for r in rows] == ["sync", "overlap", "async eta=0", "async eta=2"]
    assert rows[0]["speedup"] == 1.0
    rc, out = run_cli(
        [
            "simulate",
            "--steps",
            "2",
            "--batch",
            "32",
            "--schedule",
            "sync,async",
            "--eta",
            "1",
            "--lengths",
            "constant:100",
            "--plot",
            str(tmp_path),
        ],
        capsys,
    )
    assert rc == 0 and "|" in out
    assert (tmp_path / "trace_sync.json").is_file()
    trace = json.loads((tmp_path / "trace_sync.json").read_text())
    assert any(e["ph"] == "X" for e in trace["traceEvents"])
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "utilisation.png").is_file() and (tmp_path / "staleness.png").is_file()


def test_placement_plan_cost_cli(capsys):
    rc, out = run_cli(["placement", "--model", "7b", "--devices", "16", "--json"], capsys)
    rows = json_rows(out)
    assert rc == 0 and len(rows) == 15 and rows[0]["rank"] == 1
    rc, out = run_cli(["plan", "--nodes", "1", "--steps", "100", "--json"], capsys)
    rows = json_rows(out)
    assert rc == 0 and any(r.get("plan") == "search" for r in rows)
    assert all(r["fits"] for r in rows if r.get("plan") == "search")
    rc, out = run_cli(
        ["cost", "--model", "7b", "--tokens", "1e9", "--hardware", "h100", "--rl", "--json"], capsys
    )
    rows = json_rows(out)
    assert rc == 0 and rows[0]["gpu_hours"] == pytest.approx(29.491)
    assert rows[1]["gb"] == 126.0  # GRPO: the actor trained, the reference frozen
    assert rows[1]["item"] == "memory actor (trained) + ref (frozen), 7b"
    assert any(r.get("component") == "rollout" for r in rows)
    # the memory row counts the models the step table does (issue 44): PPO with a reward model
    argv = ["cost", "--model", "7b", "--rl", "--critic", "--reward-model", "7b", "--json"]
    rc, out = run_cli(argv, capsys)
    rows = json_rows(out)
    assert rows[0]["gb"] == 252.0
    assert rows[0]["item"] == "memory actor+critic (trained) + ref+reward (frozen), 7b"
    assert {"critic", "reward"} <= {r.get("component") for r in rows}


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["reshard", "--train", "1-8", "--gen", "1-2"], "--train"),
        (["reshard", "--train", "1-3-1", "--gen", "1-2"], "multiple"),
        (["simulate", "--schedule", "fast"], "schedule"),
        (["simulate", "--eta", "-1", "--schedule", "async"], "eta"),
        (["simulate", "--lengths", "weibull:3"], "length"),
        (["simulate", "--model", "nope"], "unknown model"),
        (["cost", "--hardware", "tpu"], "unknown hardware"),
        (["simulate", "--profile", "/no/such.json"], "not found"),
    ],
)
def test_bad_input_is_a_one_line_value_error(argv, msg, capsys):
    with pytest.raises(ValueError, match=msg) as exc:
        run_cli(argv, capsys)
    assert "\n" not in str(exc.value)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny")
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def test_profile_cli_and_profiled_simulation(tiny_model, tmp_path, capsys):
    out_path = tmp_path / "profile.json"
    rc, out = run_cli(
        [
            "profile",
            str(tiny_model),
            "--out",
            str(out_path),
            "--batches",
            "1,4",
            "--threads",
            "1",
            "--decode-steps",
            "3",
            "--also-threads",
            "2",
        ],
        capsys,
    )
    assert rc == 0 and out_path.is_file()
    prof = json.loads(out_path.read_text())
    assert set(prof["decode_step_s"]) == {"1", "4"}
    assert set(prof["at_threads"]) == {"2"}  # measured again on 2 threads
    assert set(prof["at_threads"]["2"]["decode_step_s"]) == {"1", "4"}
    assert prof["at_threads"]["2"]["train_tokens_per_s"] > 0
    assert prof["train_tokens_per_s"] > 0 and prof["prefill_tokens_per_s"] > 0
    assert prof["params"] == pytest.approx(82240)
    rc, out = run_cli(
        [
            "simulate",
            "--profile",
            str(out_path),
            "--devices",
            "2",
            "--tp",
            "1",
            "--train-devices",
            "1",
            "--batch",
            "16",
            "--steps",
            "3",
            "--slots",
            "8",
            "--prompt-len",
            "8",
            "--lengths",
            "lognormal:32:0.8:256",
            "--schedule",
            "async",
            "--eta",
            "2",
            "--json",
        ],
        capsys,
    )
    assert rc == 0 and json_rows(out)[0]["samples_per_s"] > 0


def _calibration_module():
    return load_bench("plan_calibration")


def test_calibration_script_on_synthetic_schedules(tmp_path, capsys):
    from relayrl.plan.timemodel import MeasuredProfile

    cal = _calibration_module()
    prof = MeasuredProfile(
        model="tiny",
        params=1e5,
        device="cpu",
        threads=2,
        dtype="float32",
        decode_context=64,
        decode_step_s={1: 0.002, 8: 0.003, 32: 0.006},
        decode_s_per_ctx_token=1e-8,
        prefill_tokens_per_s=5e4,
        train_tokens_per_s=1e4,
    )
    prof.save(tmp_path / "profile.json")
    config = {
        "batch_size": 32,
        "n_steps": 6,
        "prompt_len": 16,
        "lengths": "lognormal:32:0.8:256",
        "slots": 32,
        "threads": 2,
        "train_threads": 1,
    }
    # synthetic "measured" speedups: the model's own prediction for async eta=2, 1.6x off for eta=0
    res = cal.compare(
        prof,
        [
            {"schedule": "sync", "samples_per_s": 1.0},
            {"schedule": "async", "eta": 2, "interrupt": True, "samples_per_s": 1.0},
        ],
        config,
    )
    pred = res["rows"][0]["predicted_speedup"]
    lines = [
        json.dumps({"config": config}),
        json.dumps({"schedule": "sync", "samples_per_s": 10.0}),
        "| a printed table line |",
        json.dumps(
            {"schedule": "async", "eta": 2, "interrupt": True, "samples_per_s": 10.0 * pred}
        ),
        json.dumps({"schedule": "async", "eta": 0, "interrupt": True, "samples_per_s": 16.0}),
    ]
    (tmp_path / "sched.jsonl").write_text("\n".join(lines) + "\n")
    rc = cal.main(
        ["--profile", str(tmp_path / "profile.json"), "--schedules", str(tmp_path / "sched.jsonl")]
    )
    out = capsys.readouterr().out
    assert rc == 0
    summary = json.loads(out.strip().splitlines()[-1])
    by_eta = {r["eta"]: r for r in summary["rows"]}
    assert by_eta[2]["rel_error"] == pytest.approx(0.0, abs=1e-3)
    assert by_eta[2]["measured_speedup"] == pytest.approx(pred, rel=1e-3)
    assert by_eta[0]["rel_error"] > 0.25
    assert summary["within_tolerance"] is False
    assert (
        cal.main(
            [
                "--profile",
                str(tmp_path / "profile.json"),
                "--schedules",
                str(tmp_path / "sched.jsonl"),
                "--check",
            ]
        )
        == 1
    )
    capsys.readouterr()
    (tmp_path / "nosync.jsonl").write_text(json.dumps({"schedule": "async", "samples_per_s": 1}))
    assert (
        cal.main(
            [
                "--profile",
                str(tmp_path / "profile.json"),
                "--schedules",
                str(tmp_path / "nosync.jsonl"),
            ]
        )
        == 2
    )


PLAN_TABLES = {
    "simulate": ["--steps", "2", "--batch", "16", "--turns", "2", "--env-latency", "constant:1"],
    "reshard": ["--train", "2-8-2", "--gen", "1-4", "--model", "70b", "--bandwidth", "50"],
    "placement": ["--model", "7b", "--devices", "16", "--top", "1"],
    "plan": ["--nodes", "1", "--steps", "100"],
    "cost": ["--model", "7b", "--tokens", "1e9", "--rl", "--critic"],
}


@pytest.mark.parametrize("command", PLAN_TABLES)
def test_every_column_a_planning_command_prints_is_explained_in_docs_plan_md(
    command, capsys, monkeypatch
):
    """Each table column of ``relayrl COMMAND`` is named, in backticks, in its own section of
    docs/plan.md (issue 44: the planning commands' columns were not explained)."""
    monkeypatch.setenv("COLUMNS", "400")  # no folded headers
    rc, out = run_cli([command, *PLAN_TABLES[command]], capsys)
    assert rc == 0
    columns = {
        cell.strip()
        for line in out.splitlines()
        if line.startswith("┃")
        for cell in line.strip().strip("┃").split("┃")
    }
    assert len(columns) >= 3, out
    section = (ROOT / "docs/plan.md").read_text().split(f"### `relayrl {command}`")[1]
    section = section.split("\n### ")[0]
    assert [c for c in sorted(columns) if f"`{c}`" not in section] == []
