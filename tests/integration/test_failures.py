"""Infrastructure failures are never training data (issue 43, ``relayrl.controller.failures``).

Units: the classification of every cause, hand-computed advantages of a group that holds an
infrastructure failure, the group rule, the budget's one line. Integration with real
components: a reward function that raises (inline and through the reward service's workers:
the same tag), a reward worker that dies and one that times out, a sandboxed program that
crashes on its own (a model failure: it keeps its 0 and trains), training with a reward
function that raises on ~30% of samples, ``relayrl train`` with one that always raises (exit 1,
one line), a flaky and a hanging environment.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import SMALL_STEP, run_config
from relayrl.algos import compute_advantages
from relayrl.cli import main
from relayrl.cluster.local import build_local_roles
from relayrl.config.failures import FailuresConfig
from relayrl.controller.failures import (
    FailureLog,
    InfraBudgetExceeded,
    classify,
    infra_cause,
)
from relayrl.controller.trainer import train
from relayrl.model import build_tiny_model
from relayrl.reward import RewardService
from relayrl.rollout.types import Sample
from relayrl.workers.reward import RewardWorker


def _sample(group: int, **metadata) -> Sample:
    return Sample(0, [1, 2], [3, 4], [-0.1, -0.2], [0, 0], "stop", group, dict(metadata))


def _env(reason: str, error: str | None = None) -> dict:
    return {"stop_reason": reason, "error": error, "turns": 1}


# ---------------------------------------------------------------- classification


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ({}, None),
        ({"reward": {"score": 0.0, "error": None, "reason": "AssertionError"}}, None),
        ({"env": _env("env_done")}, None),
        ({"env": _env("env_error", "step: RuntimeError: reset")}, ("infra", "env")),
        ({"env": _env("timeout", "step took longer than 1 s")}, ("infra", "env_timeout")),
        ({"env": _env("env_error", "the agent raised ValueError: x")}, ("infra", "agent")),
        ({"env": _env("timeout", "the agent ran past env.agent.timeout_s=1")},
         ("infra", "agent_timeout")),
        ({"env": _env("abort", "the engine rejected the turn")}, ("infra", "engine")),
        ({"env": _env("context_overflow")}, ("model", "context_overflow")),
        ({"reward": {"error": "f: ValueError: boom"}}, ("infra", "reward_fn")),
        ({"reward": {"error": "timeout: reward call exceeded 1 s"}}, ("infra", "reward_timeout")),
        ({"reward": {"error": "reward worker died (exit code 3) while scoring"}},
         ("infra", "reward_worker")),
    ],
)  # fmt: skip
def test_classify_every_cause(metadata, expected):
    kind = classify(_sample(0, **metadata))
    assert (kind[:2] if kind else None) == expected


# ---------------------------------------------------------------- group statistics


def _advantages(name: str, samples: list[Sample], scores: torch.Tensor, **kw) -> torch.Tensor:
    mask = torch.ones(len(samples), 2)
    rewards = torch.zeros(len(samples), 2)
    rewards[:, -1] = scores
    groups = torch.tensor([s.group_id for s in samples])
    adv, _ = compute_advantages(
        name, token_rewards=rewards, response_mask=mask, group_index=groups, **kw
    )
    return adv[:, -1]


def test_infra_failure_is_out_of_its_groups_statistics():
    """Group 0 = scores [1, 0, 1] and an infrastructure failure (scored 0); group 1 = [1, 0].

    GRPO over the survivors of group 0: mean 2/3, unbiased std sqrt(1/3) = 0.57735, so
    A = (1 - 2/3) / 0.57735 = 0.57735 and (0 - 2/3) / 0.57735 = -1.15470. Counting the failure
    (mean 1/2, std 0.57735) would give 0.86603 / -0.86603 instead. RLOO: leave-one-out means
    of [1, 0, 1]: A = 1 - 1/2, 0 - 1, 1 - 1/2. Dr.GRPO: r - 2/3."""
    failed = {"reward": {"error": "reward worker died (exit code 9) while scoring"}}
    samples = [_sample(0), _sample(0), _sample(0, **failed), _sample(0), _sample(1), _sample(1)]
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    log = FailureLog()
    kept, kept_scores = log.admit(samples, scores)
    assert [s.group_id for s in kept] == [0, 0, 0, 1, 1]
    assert samples[2].metadata["failure"] == {
        "kind": "infra",
        "cause": "reward_worker",
        "error": "reward worker died (exit code 9) while scoring",
    }
    grpo = _advantages("grpo", kept, kept_scores, eps=0.0)
    s = (1 / 3) ** 0.5
    torch.testing.assert_close(
        grpo[:3], torch.tensor([(1 / 3) / s, (-2 / 3) / s, (1 / 3) / s]), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        grpo[:3], torch.tensor([0.57735, -1.15470, 0.57735]), atol=1e-5, rtol=0
    )
    # the other group's advantages do not change
    clean = _advantages("grpo", samples[4:], scores[4:], eps=0.0)
    torch.testing.assert_close(grpo[3:], clean)
    rloo = _advantages("rloo", kept, kept_scores)
    torch.testing.assert_close(rloo[:3], torch.tensor([0.5, -1.0, 0.5]))
    drgrpo = _advantages("drgrpo", kept, kept_scores)
    torch.testing.assert_close(drgrpo[:3], torch.tensor([1 / 3, -2 / 3, 1 / 3]))
    m = log.metrics()
    assert m["failures/infra"] == 1 and m["failures/infra/reward_worker"] == 1
    assert m["failures/samples"] == 6
    assert log.metrics()["failures/infra/reward_worker"] == 0  # reset, series continuous


def test_group_left_with_one_sample_is_dropped_and_counted():
    bad = {"env": _env("env_error", "step: boom")}
    samples = [_sample(0), _sample(0, **bad), _sample(1), _sample(1)]
    log = FailureLog()
    kept, scores = log.admit(samples, torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert [s.group_id for s in kept] == [1, 1]
    assert scores.tolist() == [1.0, 0.0]
    assert log.metrics()["failures/groups_dropped"] == 1
    # PPO (no group baseline): the survivor trains
    kept, _ = FailureLog().admit(samples, torch.zeros(4), grouped=False)
    assert len(kept) == 3


def test_model_failure_keeps_its_score_and_trains():
    samples = [_sample(0, env=_env("context_overflow")), _sample(0)]
    kept, scores = FailureLog().admit(samples, torch.tensor([0.0, 1.0]))
    assert len(kept) == 2 and scores.tolist() == [0.0, 1.0]
    assert samples[0].metadata["failure"]["kind"] == "model"


def test_budget_in_a_row_rate_and_nothing_left():
    bad = {"reward": {"error": "rm: ConnectionError: refused"}}
    log = FailureLog(FailuresConfig(max_consecutive=3, window=1000))
    log.admit([_sample(0, **bad), _sample(0), _sample(0)], torch.zeros(3))
    with pytest.raises(InfraBudgetExceeded) as e:
        log.admit([_sample(1, **bad) for _ in range(3)] + [_sample(2)], torch.zeros(4))
    msg = str(e.value)
    assert "\n" not in msg and "3 samples in a row failed" in msg
    assert "mostly reward_fn (4 of 4)" in msg and "rm: ConnectionError: refused" in msg
    log = FailureLog(FailuresConfig(max_rate=0.5, window=4, max_consecutive=100))
    log.admit([_sample(0, **bad), _sample(0), _sample(0)], torch.zeros(3))
    with pytest.raises(InfraBudgetExceeded, match=r"3 of the last 4 samples failed"):
        log.admit([_sample(g, **bad) for g in (1, 2, 3)] + [_sample(4)], torch.zeros(4))
    with pytest.raises(InfraBudgetExceeded, match="no sample of the step is left to train"):
        FailureLog().admit([_sample(0, **bad), _sample(0, **bad)], torch.zeros(2))


# ---------------------------------------------------------------- reward paths


class _Chars:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + i) for i in ids)


def _raising(prompt, completion, sample):
    raise KeyError("expected_answer")


def test_inline_and_service_record_a_raising_reward_fn_the_same_way():
    from failure_helpers import broken_reward

    inline = _sample(0, prompt="1+1=", answer="2")
    scores, _ = RewardWorker(broken_reward, _Chars()).score([inline])
    assert scores.tolist() == [0.0]
    assert infra_cause(inline) == "reward_fn"
    assert "broken_reward raised KeyError" in inline.metadata["reward"]["error"]
    for workers in (0, 1):
        svc = RewardService(
            "failure_helpers:broken_reward", num_workers=workers, tokenizer=_Chars(), timeout_s=20
        )
        try:
            sample = _sample(0, prompt="1+1=", answer="2")
            scores, _ = RewardWorker(None, _Chars(), svc).score([sample])
        finally:
            svc.close()
        assert scores.tolist() == [0.0]
        assert infra_cause(sample) == "reward_fn", sample.metadata["reward"]


def test_reward_worker_death_and_timeout_are_infra_failures(tmp_path):
    (tmp_path / "checkpoints" / "step_000001").mkdir(parents=True)
    svc = RewardService(
        {"fn": "failure_helpers:dies_after_checkpoint", "kwargs": {"run_dir": str(tmp_path)}},
        num_workers=1,
        tokenizer=_Chars(),
        timeout_s=20,
    )
    try:
        dead = _sample(0, prompt="1+1=", answer="2")
        RewardWorker(None, _Chars(), svc).score([dead])
    finally:
        svc.close()
    assert infra_cause(dead) == "reward_worker", dead.metadata["reward"]
    svc = RewardService("failure_helpers:hangs", num_workers=1, tokenizer=_Chars(), timeout_s=0.5)
    try:
        slow = _sample(0, prompt="1+1=", answer="2", sample_index=0)
        RewardWorker(None, _Chars(), svc).score([slow])
    finally:
        svc.close()
    assert infra_cause(slow) == "reward_timeout", slow.metadata["reward"]


def test_a_program_that_crashes_on_its_own_is_a_model_failure():
    """The code reward runs the model's program in the sandbox; it raises there: score 0, no
    failure recorded, the sample trains."""
    from relayrl.reward import get_reward_fn

    class Text:
        def decode(self, ids, skip_special_tokens=True):
            return "```python\ndef add(a, b):\n    raise ValueError('mine')\n```"

    sample = _sample(0, prompt="write add", tests=["assert add(1, 2) == 3"])
    scores, _ = RewardWorker(get_reward_fn("code"), Text()).score([sample])
    assert scores.tolist() == [0.0]
    assert classify(sample) is None
    kept, _ = FailureLog().admit([sample], scores, grouped=False)
    assert kept == [sample]


# ---------------------------------------------------------------- training


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("failures") / "m", hidden_size=32, seed=1)


def _records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _single_turn(tiny, run_dir, *overrides):
    return run_config(tiny, run_dir, *SMALL_STEP, *overrides)


def test_reward_fn_raising_on_30_percent_trains_to_the_end(tiny, tmp_path):
    cfg = _single_turn(
        tiny, tmp_path / "run", "train.steps=3", "reward.fn=failure_helpers:flaky_reward"
    )
    out = train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    assert out["eval_after"] is not None
    steps = [r for r in _records(tmp_path / "run") if "failures/samples" in r]
    assert len(steps) == 3
    failed = sum(r["failures/infra/reward_fn"] for r in steps)
    seen = sum(r["failures/samples"] for r in steps)
    assert seen == 48 and 0.1 * seen <= failed <= 0.5 * seen, (failed, seen)
    # a failure is retried (same sample: fails again) and then left out
    assert sum(r["failures/retried"] for r in steps) >= failed


def test_train_cli_with_an_always_raising_reward_fn_stops_in_one_line(tiny, tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model:\n  path: {tiny}\nlogging:\n  progress: false\n")
    rc = main(
        [
            "train",
            str(cfg),
            f"run_dir={tmp_path / 'run'}",
            "reward.fn=failure_helpers:broken_reward",
            "data.eval_size=2",
            "rollout.max_tokens=4",
            "algo.prompts_per_step=2",
            "algo.group_size=2",
            "train.steps=2",
            "failures.retries=0",
            "threads=1",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 1
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "broken_reward raised KeyError" in err and "expected_answer" in err
    assert "mostly reward_fn" in err and "no checkpoint was written" in err


def test_reward_service_whose_workers_die_stops_with_the_checkpoint(tiny, tmp_path):
    run_dir = tmp_path / "run"
    cfg = _single_turn(
        tiny,
        run_dir,
        "train.steps=4",
        "train.save_every=1",
        "reward.service.num_workers=1",
        "reward.service.timeout_s=30",
        "failures.retries=1",
        "reward.service.functions=[{fn: 'failure_helpers:dies_after_checkpoint', "
        f"kwargs: {{run_dir: '{run_dir}'}}}}]",
    )
    with pytest.raises(Exception) as e:
        train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    msg = str(e.value)
    assert type(e.value).__name__ == "RunFault" and "\n" not in msg
    assert "mostly reward_worker" in msg and "reward worker died" in msg
    assert "the newest intact checkpoint is" in msg and "step_000001" in msg


def _calculator(tiny, run_dir, factory, *overrides):
    return run_config(
        tiny,
        run_dir,
        "data.arithmetic.operators=['*']",
        "data.arithmetic.min_operand=10",
        "data.arithmetic.max_operand=99",
        "data.eval_size=2",
        f"env.factory={factory}",
        "env.max_turns=2",
        "rollout.max_tokens=12",
        "algo.prompts_per_step=4",
        "algo.group_size=2",
        "train.save_every=0",
        "train.steps=3",
        *overrides,
    )


def _weights(run_dir):
    from safetensors.torch import load_file

    path = sorted((run_dir / "checkpoints").glob("step_*/actor/model.safetensors"))[-1]
    return load_file(path)


def test_flaky_and_hanging_environment_train_the_same_weights_as_a_clean_one(tiny, tmp_path):
    """An environment whose steps raise (30%) or hang past ``env.step_timeout_s`` (10%), drawn
    from a seeded stream: every failed episode is run again (same request, same seed, a fresh
    environment) until it succeeds, so the run trains exactly the clean run's episodes."""
    from failure_helpers import reseed

    clean = _calculator(tiny, tmp_path / "clean", "calculator")
    clean_out = train(clean, lambda a, c: build_local_roles(clean, a, c))
    reseed(0)
    flaky = _calculator(
        tiny,
        tmp_path / "flaky",
        "failure_helpers:flaky_calculator",
        "env.kwargs={raise_rate: 0.3, hang_rate: 0.1}",
        "env.step_timeout_s=0.5",
        "failures.retries=12",
    )
    flaky_out = train(flaky, lambda a, c: build_local_roles(flaky, a, c))
    steps = [r for r in _records(tmp_path / "flaky") if "failures/samples" in r]
    assert sum(r["failures/retried"] for r in steps) > 0
    assert sum(r["failures/infra"] for r in steps) == 0  # every retry succeeded in the end
    env_failures = sum(r.get("env/failures", 0) for r in steps)
    assert env_failures > 0 and any(r.get("env/stop_timeout", 0) for r in steps)
    evals = [r for r in _records(tmp_path / "flaky") if "eval/pass_rate" in r]
    assert all(r["eval/failures/infra"] == 0 for r in evals)  # retried too
    assert (flaky_out["eval_before"], flaky_out["eval_after"]) == (
        clean_out["eval_before"],
        clean_out["eval_after"],
    )
    a, b = _weights(tmp_path / "clean"), _weights(tmp_path / "flaky")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0, msg=k)


def test_async_retries_and_leaves_out_reward_fn_failures(tiny, tmp_path):
    cfg = _single_turn(
        tiny,
        tmp_path / "run",
        "train.steps=3",
        "schedule=async",
        "async.eta=1",
        "reward.fn=failure_helpers:flaky_reward",
    )
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    steps = [r for r in _records(tmp_path / "run") if "failures/samples" in r]
    assert len(steps) == 3
    assert sum(r["failures/retried"] for r in steps) > 0
    assert sum(r["failures/samples"] for r in steps) == 48


@pytest.mark.slow  # ~25 s: the stall at 3 s, then the hung worker is shut down
def test_async_trainer_waiting_on_a_hung_reward_is_an_error_naming_it(tiny, tmp_path):
    cfg = _single_turn(
        tiny,
        tmp_path / "run",
        "train.steps=2",
        "schedule=async",
        "reward.service.functions=[{fn: 'failure_helpers:hangs'}]",
        "reward.service.num_workers=1",
        "reward.service.timeout_s=120",
        "failures.stall_s=3",
    )
    with pytest.raises(Exception, match=r"rollout stalled: no sample finished") as e:
        train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    assert "samples awaiting the reward service" in str(e.value)


def test_rollout_only_on_the_calculator_environment(tiny, tmp_path, capsys):
    """``relayrl train --rollout-only``: no training, nothing in run_dir; one line per step
    with the time split and the failures by cause, then a few samples with their tags."""
    from failure_helpers import reseed

    reseed(1)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model:\n  path: {tiny}\nlogging:\n  progress: false\n")
    rc = main(
        [
            "train",
            str(cfg),
            "--rollout-only",
            f"run_dir={tmp_path / 'run'}",
            "env.factory=failure_helpers:flaky_calculator",
            "env.kwargs={raise_rate: 0.3}",
            "env.max_turns=2",
            "rollout.max_tokens=8",
            "algo.prompts_per_step=4",
            "algo.group_size=2",
            "train.steps=2",
            "failures.retries=0",
            "threads=1",
        ]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    assert not (tmp_path / "run").exists()
    steps = [x for x in lines if x.startswith("step ")]
    assert len(steps) == 2, lines
    assert all("generate" in x and "score" in x and "infra failures" in x for x in steps)
    assert any("(env " in x for x in steps), steps  # some steps raised: counted by cause
    samples = [x for x in lines if x.startswith("  ")]
    assert len(samples) == 3 and all("score" in x for x in samples)


def test_own_engine_weight_sync_to_a_hung_worker_is_a_bounded_error(tiny):
    """The engine worker stops (SIGSTOP) mid-way: the next weight update is an error naming the
    worker and the versions within ``weight_sync.timeout_s``, never a hang; nothing of the
    new weights was written into the shared tensors."""
    import os
    import signal
    import time

    from relayrl.cluster.engine_process import EngineProcess, EngineSpec, WeightSyncFailed
    from relayrl.model import load_causal_lm, load_tokenizer

    tok = load_tokenizer(tiny)
    spec = EngineSpec(
        model_path=str(tiny),
        dtype="float32",
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_slots=4,
        threads=1,
        version=0,
        urgent_steps=0,
    )
    state = load_causal_lm(tiny, torch.float32).state_dict()
    with EngineProcess(spec, state, sync_timeout_s=2.0) as engine:
        engine.update_weights(state, version=1)
        engine.wait_weights_loaded()
        os.kill(engine.process.pid, signal.SIGSTOP)
        try:
            engine.update_weights(state, version=2)  # sent; the stopped worker never loads it
            new = {k: v + 1.0 for k, v in state.items()}
            t0 = time.monotonic()
            with pytest.raises(WeightSyncFailed) as e:
                engine.update_weights(new, version=3)
            assert time.monotonic() - t0 < 10
            msg = str(e.value)
            assert f"pid {engine.process.pid}" in msg and "version 3" in msg
            assert "not loaded version 2" in msg and "\n" not in msg
            name = next(iter(state))
            torch.testing.assert_close(engine._shared[name], state[name].to(torch.float32))
        finally:
            os.kill(engine.process.pid, signal.SIGCONT)


def test_a_sandbox_that_cannot_start_is_an_infra_failure(monkeypatch, tmp_path):
    """No temporary directory for the sandbox's run (deleted under the run): the code reward
    raises ``SandboxUnavailable``; the sample is an infrastructure failure (``sandbox``), not a
    program that scored 0."""
    import tempfile

    from relayrl.reward import get_reward_fn

    class Text:
        def decode(self, ids, skip_special_tokens=True):
            return "```python\ndef add(a, b):\n    return a + b\n```"

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))
    sample = _sample(0, prompt="write add", tests=["assert add(1, 2) == 3"])
    scores, _ = RewardWorker(get_reward_fn("code"), Text()).score([sample])
    assert scores.tolist() == [0.0]
    assert infra_cause(sample) == "sandbox", sample.metadata["reward"]


def test_async_evaluation_runs_beside_training(tiny, tmp_path):
    """``schedule=async`` with ``train.eval_every``: the evaluation runs in its own thread on
    the engine's evaluation lane; its metrics come with a later step's record, with the step
    (trainer version) it started at and the versions its tokens came from."""
    cfg = _single_turn(
        tiny, tmp_path / "run", "train.steps=6", "schedule=async", "train.eval_every=2"
    )
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    recs = _records(tmp_path / "run")
    assert len([r for r in recs if "failures/samples" in r]) == 6  # every step trained
    beside = [r for r in recs if "eval/at_step" in r]
    assert beside, recs
    for r in beside:
        assert r["step"] >= r["eval/at_step"] and r["eval/at_step"] in (2, 4)
        assert r["eval/version_min"] >= r["eval/at_step"] - 1  # no older weights than that
        assert r["eval/version_max"] <= r["step"]
