"""Multi-turn episodes in the simulator: environment latency per turn, sync (the batch waits)
vs async (the slot serves others). Every number below is worked by hand in the comments."""

import argparse
import json
import math

import numpy as np
import pytest

from relayrl.plan.cli import add_subcommands
from relayrl.plan.envlatency import (
    Z99,
    ConstantLatency,
    EmpiricalLatency,
    FixedLatency,
    LognormalLatency,
    parse_latency,
)
from relayrl.plan.lengths import ConstantLengths, FixedLengths, LognormalLengths
from relayrl.plan.simulator import SimConfig, simulate
from relayrl.plan.timemodel import FixedStepTimeModel


def two_turns(schedule: str, slots: int, **kw):
    """Two episodes of two turns of 3 tokens; waits 1 s (episode 1) and 5 s (episode 2)."""
    cfg = dict(
        time_model=FixedStepTimeModel(step_s=1.0, concurrency=slots),
        lengths=FixedLengths([3]),
        schedule=schedule,
        n_devices=1 if schedule == "sync" else 2,
        train_devices=None if schedule == "sync" else 1,
        batch_size=2,
        n_steps=1,
        prompt_len=0,
        eta=None,
        turns=2,
        env_latency=FixedLatency([1.0, 5.0]),
    )
    cfg.update(kw)
    return simulate(SimConfig(**cfg))


def test_sync_batch_waits_for_its_slowest_environment_call():
    # both turn 1s run 0..3; the batch waits max(1, 5) = 5 s; both turn 2s run 8..11
    r = two_turns("sync", slots=2)
    assert r.makespan_s == pytest.approx(11.0)
    assert r.breakdown["env_wait_s"] == pytest.approx(5.0)
    assert r.breakdown["generate_s"] == pytest.approx(6.0)
    assert r.response_tokens == 12
    assert r.staleness_hist == {0: 12}


def test_async_frees_the_slot_while_the_environment_runs():
    # one slot. async: ep1 0..3 (back at 4); ep2 3..6 (back at 11); ep1 resumes 6..9 (done);
    # ep3 (the engine stays full) 9..12; ep2 resumes first at 12..15: step 0 trains at 15.
    a = two_turns("async", slots=1)
    assert a.makespan_s == pytest.approx(15.0)
    # sync: ep1 0..3, ep2 3..6, the batch waits until 6 + 5 = 11, turn 2s 11..14, 14..17
    s = two_turns("sync", slots=1)
    assert s.makespan_s == pytest.approx(17.0)
    assert a.breakdown["episode_env_wait_s"] == pytest.approx((1 + 5) / 2)
    assert "env_wait_s" not in a.breakdown  # nothing blocks on the environment
    # sync with turn_barrier=False: ep1 0..3 (back 4), ep2 3..6 (back 11), ep1 6..9, ep2 11..14
    i = two_turns("sync", slots=1, turn_barrier=False)
    assert i.makespan_s == pytest.approx(14.0)


@pytest.mark.parametrize(("policy", "expected"), [("context", 17.02), ("observation", 14.42)])
def test_resume_prefill_policies(policy, expected):
    # prompts 10, observations 5, prefill 0.1 s/token, training 0.01 s/token, sync, 2 slots:
    # prefill 2 prompts 2.0 s, turn 1 2..5, wait 5 -> 10; resume prefill "context":
    # 2 * (10 + 3 + 5) tokens = 3.6 s (turn 2 13.6..16.6), "observation": 2 * 5 = 1.0 s
    # (11..14); training 2 * (10 + 3 + 5 + 3) = 42 tokens = 0.42 s.
    r = two_turns(
        "sync",
        slots=2,
        time_model=FixedStepTimeModel(
            step_s=1.0, prefill_s_per_token=0.1, train_s_per_token=0.01, concurrency=2
        ),
        prompt_len=10,
        obs_tokens=5,
        resume_prefill=policy,
    )
    assert r.makespan_s == pytest.approx(expected)
    assert r.response_tokens == 12  # observation tokens are not model tokens


def test_versions_are_exact_across_turns():
    # async, B = 1, one slot, 3 steps, 2 turns of 3 tokens, waits 10, 10, 10.5, 10, ...,
    # training 0.5 s/token (6 tokens = 3 s), weights arrive at once, in order, eta unbounded.
    # ep1 0..3 (back 13), ep2 3..6 (back 16), ep3 6..9 (back 19.5), ep4 9..12 (back 22);
    # ep1 13..16 -> step 0 trains 16..19 (v1 at 19); ep2 16..19 under v0 -> step 1 19..22;
    # ep3 resumes at 19.5 under v1, done 22.5 -> step 2 trains 22.5..25.5.
    r = simulate(
        SimConfig(
            FixedStepTimeModel(step_s=1.0, train_s_per_token=0.5, concurrency=1),
            FixedLengths([3]),
            schedule="async",
            n_devices=2,
            train_devices=1,
            batch_size=1,
            n_steps=3,
            prompt_len=0,
            eta=None,
            turns=2,
            env_latency=FixedLatency([10.0, 10.0, 10.5]),
            record_events=True,
        )
    )
    assert r.step_end_times == pytest.approx([19.0, 22.0, 25.5])
    ep3 = next(s for s in r.samples_log if s["id"] == 3)
    assert ep3["segments"] == [(0, 3), (1, 3)]  # turn 1 under v0, turn 2 under v1
    # staleness: step 0 ep1 6 tokens at 0; step 1 ep2 6 at 1; step 2 ep3 3 at 2, 3 at 1
    assert r.staleness_hist == {0: 6, 1: 9, 2: 3}
    assert r.interrupted_fraction == pytest.approx(1 / 3)  # one episode spans two versions


def test_one_turn_and_turn_distributions():
    tm = FixedStepTimeModel(step_s=1.0, concurrency=8)
    base = dict(schedule="sync", n_devices=1, batch_size=4, n_steps=2, prompt_len=0)
    one = simulate(SimConfig(tm, FixedLengths([2, 5]), **base))
    assert simulate(SimConfig(tm, FixedLengths([2, 5]), turns=1, **base)).summary() == (
        one.summary()
    )
    # no latency, 2 turns: every episode draws (2, 5), so a step is 2 + 5 decode steps
    two = simulate(SimConfig(tm, FixedLengths([2, 5]), turns=2, **base))
    assert two.makespan_s == pytest.approx(2 * (2 + 5))
    dist = simulate(SimConfig(tm, FixedLengths([2, 5]), turns=ConstantLengths(2), **base))
    assert dist.makespan_s == pytest.approx(two.makespan_s)


def test_lognormal_latency_has_the_stated_median_and_p99():
    d = LognormalLatency(median_s=1.0, p99_s=30.0)
    assert d.sigma == pytest.approx(math.log(30) / 2.3263, rel=1e-4)  # 1.4620
    assert d.mean_s == pytest.approx(2.912, rel=1e-3)
    w = d.sample(200_000, np.random.default_rng(0))
    assert np.median(w) == pytest.approx(1.0, rel=0.02)
    assert np.quantile(w, 0.99) == pytest.approx(30.0, rel=0.05)
    assert Z99 == pytest.approx(2.326348, rel=1e-6)
    capped = LognormalLatency(1.0, 30.0, cap_s=10.0).sample(10_000, np.random.default_rng(0))
    assert capped.max() == 10.0
    assert list(FixedLatency([1.0, 2.0]).sample(3, None)) == [1.0, 2.0, 1.0]
    assert set(EmpiricalLatency((0.5, 7.0)).sample(50, np.random.default_rng(0))) == {0.5, 7.0}


def test_heavy_tailed_latency_widens_the_async_gain():
    tm = FixedStepTimeModel(step_s=0.02, concurrency=32)

    def gain(lat):
        kw = dict(batch_size=64, n_steps=6, prompt_len=0, turns=4, env_latency=lat, seed=0, eta=4)
        lengths = LognormalLengths(200, 0.6, 2000)
        s = simulate(SimConfig(tm, lengths, schedule="sync", n_devices=4, **kw))
        a = simulate(SimConfig(tm, lengths, schedule="async", n_devices=4, train_devices=1, **kw))
        return a.steady_samples_per_s / s.steady_samples_per_s

    # lock-stepped sync pays the slowest of 64 waits (~p99, 30 s) on every turn; async pays
    # each episode's own waits, overlapped with other episodes' generation
    none, heavy = gain(None), gain(LognormalLatency(1.0, 30.0))
    assert heavy > 1.5 * none


def test_parse_latency_and_bad_input(tmp_path):
    assert parse_latency("lognormal:2:60") == LognormalLatency(2.0, 60.0)
    assert parse_latency("lognormal:2:60:30") == LognormalLatency(2.0, 60.0, 30.0)
    assert parse_latency("constant:0.5") == ConstantLatency(0.5)
    assert parse_latency("samples:1,2") == EmpiricalLatency((1.0, 2.0))
    f = tmp_path / "lat.txt"
    f.write_text("0.1\n3.5\n")
    assert parse_latency(f"file:{f}") == EmpiricalLatency((0.1, 3.5))
    for bad, msg in [
        ("gamma:1", "env latency"),
        ("lognormal:5:1", "p99_s >= median_s"),
        ("constant:-1", ">= 0"),
        ("file:/no/such", "not found"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_latency(bad)
    tm = FixedStepTimeModel()
    for kw, msg in [
        (dict(turns=0), "turns"),
        (dict(obs_tokens=-1), "obs_tokens"),
        (dict(resume_prefill="keep"), "resume_prefill"),
    ]:
        with pytest.raises(ValueError, match=msg):
            simulate(SimConfig(tm, ConstantLengths(3), n_devices=1, **kw))


def test_simulate_cli_with_env_latency(capsys):
    parser = argparse.ArgumentParser(prog="relayrl")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        [
            "simulate",
            "--model",
            "qwen2.5-0.5b",
            "--schedule",
            "sync,async",
            "--eta",
            "1",
            "--batch",
            "64",
            "--steps",
            "4",
            "--lengths",
            "lognormal:300:0.8:2048",
            "--turns",
            "4",
            "--env-latency",
            "lognormal:1:30",
            "--obs-tokens",
            "64",
            "--json",
        ]
    )
    assert args.fn(args) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    by = {r["config"]: r for r in rows}
    assert by["sync"]["env_wait_s"] > 0 and by["async eta=1"]["episode_env_wait_s"] > 0
    assert by["async eta=1"]["speedup"] > 1.0


def test_prefill_overhead_is_paid_once_per_prefill():
    # as test_resume_prefill_policies ("context"), plus 0.5 s per prefill (an engine step
    # that admits): prompts 0.5 + 2.0 = 2.5 s, turn 1 2.5..5.5, wait 5 -> 10.5, resume
    # 0.5 + 3.6 = 4.1 s -> 14.6, turn 2 14.6..17.6, training 0.42 s: 18.02 (17.02 + 2 x 0.5)
    r = two_turns(
        "sync",
        slots=2,
        time_model=FixedStepTimeModel(
            step_s=1.0,
            prefill_s_per_token=0.1,
            train_s_per_token=0.01,
            concurrency=2,
            prefill_overhead_s=0.5,
        ),
        prompt_len=10,
        obs_tokens=5,
    )
    assert r.makespan_s == pytest.approx(18.02)
    # independent turns (turn_barrier=False): episode 1 is back at 6.5 and pays its own
    # prefill 0.5 + 1.8 = 2.3 s (8.8), turn 2 8.8..11.8; episode 2 back at 10.5 joins at the
    # step boundary 10.8 with 0.5 + 1.8 (13.1, episode 1's turn pauses with it: ends 14.1),
    # turn 2 13.1..16.1; training 0.42 s -> 16.52
    i = two_turns(
        "sync",
        slots=2,
        time_model=FixedStepTimeModel(
            step_s=1.0,
            prefill_s_per_token=0.1,
            train_s_per_token=0.01,
            concurrency=2,
            prefill_overhead_s=0.5,
        ),
        prompt_len=10,
        obs_tokens=5,
        turn_barrier=False,
    )
    assert i.makespan_s == pytest.approx(16.52)
