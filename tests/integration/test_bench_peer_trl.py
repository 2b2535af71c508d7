"""``bench/peer_trl.py``: the plan (``--dry-run``), its own TRL environment's lock and stamp
logic, argument errors, the time-to-pass-rate figures, and the relayrl side for real on a tiny
model (the default run; TRL is not started there). The slow test runs a 1-step mini
head-to-head with all three arms, TRL in the venv the bench creates."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from helpers import load_bench
from relayrl.model import build_tiny_model


def _bench():
    return load_bench("peer_trl")


def test_dry_run_prints_the_plan_and_creates_nothing(tmp_path: Path, capsys) -> None:
    bench = _bench()
    venv = tmp_path / "venv"
    argv = ["--dry-run", "--venv", str(venv), "--work", str(tmp_path / "w"), "--seeds", "0", "1"]
    assert bench.main(argv + ["--modes", "short", "long", "--threads", "2", "--eta", "1"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    env = plan["trl_env"]
    assert env["pins"] == ["trl==1.16.0"] and env["ready"] is False
    assert env["python"] == str(venv / "bin" / "python")
    assert not venv.exists() and not (tmp_path / "w").exists()
    assert len(plan["runs"]) == 2 * 2 * 3 and ["long", 1, "relayrl_async"] in plan["runs"]
    long = plan["modes"]["long"]
    assert long["max_completion_tokens"] == 128 and long["trl"]["max_completion_length"] == 128
    asy = long["relayrl"]["relayrl_async"]
    assert {"schedule=async", "async.eta=1", "threads=2", "rollout.threads=2"} <= set(asy)
    assert "threads=2" in long["relayrl"]["relayrl"] and "schedule=async" not in str(
        long["relayrl"]["relayrl"]
    )
    # the keys both sides set, in each one's names
    assert "optim.lr=0.0001" in asy and long["trl"]["learning_rate"] == 1e-4
    assert long["trl"]["loss_type"] == "dapo" and "algo.loss_agg=token-mean" in asy
    # the same memory setting both sides: TRL's GRPOConfig would checkpoint by default
    assert long["trl"]["gradient_checkpointing"] is False
    assert "model.gradient_checkpointing=false" in asy
    assert bench.main(["--dry-run", "--modes", "long", "--gradient-checkpointing"]) == 0
    ckpt = json.loads(capsys.readouterr().out)["plan"]["modes"]["long"]
    assert ckpt["trl"]["gradient_checkpointing"] is True
    assert all("model.gradient_checkpointing=true" in o for o in ckpt["relayrl"].values())
    # the naive async arm: async, the clip on the engine's logprobs (no pi_prox forward)
    assert bench.main(["--dry-run", "--arms", "relayrl_async_naive", "--modes", "long"]) == 0
    (naive,) = json.loads(capsys.readouterr().out)["plan"]["modes"]["long"]["relayrl"].values()
    assert {"schedule=async", "algo.policy_loss=ppo"} <= set(naive)
    # without the TRL arm the plan has no TRL environment
    assert bench.main(["--dry-run", "--arms", "relayrl", "--venv", str(venv)]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["trl_env"] is None


def test_lock_pins_and_the_venv_stamp(tmp_path: Path) -> None:
    bench = _bench()
    assert bench.lock_pins(bench.LOCK) == ["trl==1.16.0"]
    lock = tmp_path / "x.lock"
    lock.write_text("# c\nfoo==1.0 --hash=sha256:ab\n\nbar==2  # why\n")
    assert bench.lock_pins(lock) == ["foo==1.0", "bar==2"]
    venv = tmp_path / "v"
    assert bench.venv_plan(venv, lock)["ready"] is False
    venv.mkdir()
    (venv / ".installed").write_text(hashlib.sha256(lock.read_bytes()).hexdigest() + "\n")
    assert bench.venv_plan(venv, lock)["ready"] is True
    lock.write_text(lock.read_text() + "baz==3\n")  # a changed lock rebuilds the venv
    assert bench.venv_plan(venv, lock)["ready"] is False
    lock.write_text("foo>=1\n")
    with pytest.raises(SystemExit, match=r"x\.lock:1: not pinned"):
        bench.lock_pins(lock)


def test_argument_errors() -> None:
    bench = _bench()
    with pytest.raises(SystemExit):
        bench.parse(["--group", "1"])
    with pytest.raises(SystemExit):
        bench.parse(["--arms", "vllm"])
    with pytest.raises(SystemExit):
        bench.parse(["--threads", "0"])


def test_time_to_pass_rate_and_the_common_target() -> None:
    bench = _bench()
    rates = {0: 0.3, 10: 0.35, 20: 0.42, 30: 0.40}
    times = [0.5] * 10 + [1.0] * 10 + [2.0] * 10
    assert bench.wall_to(rates, times, 0.4) == 15.0  # 10 x 0.5 + 10 x 1.0
    assert bench.wall_to(rates, times, 0.3) == 0.0 and bench.wall_to(rates, times, 0.5) is None
    assert bench.wall_to(rates, times, None) is None
    rows = [
        {"mode": "long", "seed": 0, "arm": "a", "pass_rate": {"0": 0.3, "10": 0.5, "20": 0.45},
         "step_times": [1.0] * 20},
        {"mode": "long", "seed": 0, "arm": "trl", "pass_rate": {"0": 0.3, "10": 0.36, "20": 0.4},
         "step_times": [2.0] * 20},
        {"mode": "long", "seed": 1, "arm": "a", "pass_rate": {"0": 0.3, "10": 0.3},
         "step_times": [1.0] * 10},
        {"mode": "long", "seed": 1, "arm": "trl", "pass_rate": {"0": 0.3, "10": 0.5},
         "step_times": [1.0] * 10},
    ]  # fmt: skip
    bench.add_common(rows)
    # seed 0: the lower best is trl's 0.4: arm a at step 10 (10 s), trl at step 20 (40 s)
    assert [r["common_target"] for r in rows[:2]] == [0.4, 0.4]
    assert [r["wall_s_to_common"] for r in rows[:2]] == [10.0, 40.0]
    # seed 1: arm a never rose above the warm start: no common target
    assert rows[2]["common_target"] is None and rows[3]["wall_s_to_common"] is None
    for r in rows:
        r |= {"s_per_step": sum(r["step_times"]) / len(r["step_times"]), "gen_tokens_per_s": 1.0,
              "response_len_mean": 2.0}  # fmt: skip
    (s,) = bench.summary(rows)
    assert s["arms"]["a"]["time_to_common_over_trl"] == [0.25]
    assert s["arms"]["a"]["s_per_step_over_trl"] == [0.5, 1.0]
    # seed-mean curves: a 0.3/0.4/0.45, trl 0.3/0.43/0.4; target 0.43: a at step 20 (seed 0
    # alone reached step 20: 20 s), trl at step 10 (mean of 20 s and 10 s: 15 s)
    curve = s["mean_curve"]
    assert curve["target"] == pytest.approx(0.43)
    assert curve["arms"]["a"] == {"step": 20, "wall_s": 20.0, "over_trl": 1.333}
    assert curve["arms"]["trl"] == {"step": 10, "wall_s": 15.0, "over_trl": 1.0}


def test_relayrl_side_runs_and_is_scored(tmp_path: Path) -> None:
    bench = _bench()
    model = build_tiny_model(tmp_path / "m", hidden_size=16)
    a = bench.parse(["--steps", "2", "--eval-every", "1", "--prompts", "2", "--group", "2",
                     "--lr", "1e-3", "--threads", "1"])  # fmt: skip
    held = bench.write_held_out(tmp_path / "held.jsonl", bench.held_out(model, 0, 200))
    res = bench.run_relayrl(a, "short", "relayrl", 0, model, tmp_path / "run", held)
    assert sorted(res["checkpoints"]) == [1, 2]
    assert len(res["step_times"]) == 2 and all(t > 0 for t in res["step_times"])
    assert len(res["gen_tokens"]) == 2 and all(0 < g <= 2 * 2 * 8 for g in res["gen_tokens"])
    assert len(res["gen_times"]) == len(res["train_times"]) == 2
    assert all(0 < g + t <= s for g, t, s in zip(res["gen_times"], res["train_times"],
                                                  res["step_times"], strict=True))  # fmt: skip
    cfg = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert cfg["algo"]["mini_batches"] == 1 and cfg["optim"]["warmup_steps"] == 0
    assert cfg["data"]["eval_path"] == str(held)
    # TRL's dataset is relayrl's draws, none of them a held-out prompt
    rows = bench.trl_prompts(model, 0, a, held)
    held_prompts = {json.loads(x)["prompt"] for x in held.read_text().splitlines()}
    assert len(rows) == 4 and not {r["prompt"] for r in rows} & held_prompts
    prompts = bench.held_out(model, 0, 4)
    row = bench.summarise("relayrl", "short", 0, res, 0.0, prompts, a)
    assert set(row["pass_rate"]) == {"0", "1", "2"}
    assert all(0.0 <= r <= 1.0 for r in row["pass_rate"].values())
    assert row["s_per_step"] > 0 and row["gen_tokens_per_s"] > 0


@pytest.mark.slow
def test_mini_head_to_head_all_arms(tmp_path: Path) -> None:
    """One step of each arm on a tiny model, TRL in the bench's own venv (created on first use:
    downloads TRL's wheel once)."""
    bench = _bench()
    model = build_tiny_model(tmp_path / "m", hidden_size=16)
    a = bench.parse(["--steps", "1", "--eval-every", "1", "--prompts", "2", "--group", "2",
                     "--threads", "1"])  # fmt: skip
    held = bench.write_held_out(tmp_path / "held.jsonl", bench.held_out(model, 0, 200))
    py = bench.ensure_venv(bench.VENV, bench.LOCK)
    assert bench.venv_plan(bench.VENV, bench.LOCK)["ready"]
    prompts = bench.held_out(model, 0, 4)
    rows = []
    for arm in ("relayrl", "relayrl_async", "trl"):
        out = tmp_path / arm
        if arm == "trl":
            res = bench.run_trl(a, "short", 0, model, out, held, py)
            result = json.loads((out / "result.json").read_text())
            assert result["trl_version"] == "1.16.0" and len(result["gen_times"]) == 1
            assert 0 < result["gen_times"][0] < result["step_times"][0]
        else:
            res = bench.run_relayrl(a, "short", arm, 0, model, out, held)
        assert sorted(res["checkpoints"]) == [1] and len(res["step_times"]) == 1
        rows.append(bench.summarise(arm, "short", 0, res, 0.0, prompts, a))
    bench.add_common(rows)
    (s,) = bench.summary(rows)
    assert set(s["arms"]) == {"relayrl", "relayrl_async", "trl"}
    assert all(r["gen_tokens_per_s"] > 0 for r in rows)
