"""Event-driven schedule simulator: worked examples and the literature's directions."""

import numpy as np
import pytest

from relayrl.plan.hardware import get_hardware
from relayrl.plan.lengths import (
    ConstantLengths,
    EmpiricalLengths,
    FixedLengths,
    LognormalLengths,
    parse_lengths,
)
from relayrl.plan.models import get_model
from relayrl.plan.simulator import SimConfig, simulate, sparkline, speedup
from relayrl.plan.staleness import batch_index
from relayrl.plan.timemodel import FixedStepTimeModel, RooflineTimeModel

ONE_LONG = [100] * 99 + [1000]


def test_exercise1_one_long_answer_in_a_batch_of_100():
    r = simulate(
        SimConfig(
            FixedStepTimeModel(step_s=1.0, concurrency=100),
            FixedLengths(ONE_LONG),
            schedule="sync",
            n_devices=1,
            batch_size=100,
            n_steps=1,
            prompt_len=0,
        )
    )
    assert r.decode_steps == 1000  # sync waits for the longest answer
    assert r.makespan_s == pytest.approx(1000.0)
    assert r.slot_utilisation == pytest.approx((99 * 100 + 1000) / (100 * 1000))  # 10.9%
    assert r.slot_utilisation == pytest.approx(0.109)
    assert r.low_utilisation_share == pytest.approx(0.9)  # 900 of 1000 steps: 1 of 100 running
    # async: a finished slot is refilled at once, the 100 slots stay full
    a = simulate(
        SimConfig(
            FixedStepTimeModel(step_s=1.0, concurrency=100),
            FixedLengths(ONE_LONG),
            schedule="async",
            n_devices=2,
            train_devices=1,
            batch_size=100,
            n_steps=20,
            prompt_len=0,
            eta=None,
            in_order=False,  # the lecture's model: the trainer takes whatever has finished
        )
    )
    assert a.slot_utilisation > 0.99
    assert a.max_staleness > 0  # ... and the long answer is stale when trained


@pytest.fixture(scope="module")
def tm15():
    # lecture 19 §2.2: 1.5B, 16 H100 (async: 12 generate, 4 train), 512 samples per step,
    # median 2000 tokens, cap 16384
    return RooflineTimeModel(get_model("qwen2.5-1.5b"), get_hardware("h100"), 0.6, 0.4)


def run(tm, lengths, **kw):
    cfg = dict(
        time_model=tm,
        lengths=lengths,
        n_devices=16,
        batch_size=512,
        n_steps=8,
        prompt_len=256,
        seed=0,
        in_order=False,  # the lecture notes' model (AReaL's buffer): take what has finished
    )
    cfg.update(kw)
    return simulate(SimConfig(**cfg))


TAIL = LognormalLengths(2000, 0.8, 16384)


@pytest.fixture(scope="module")
def sync15(tm15):
    return run(tm15, TAIL, schedule="sync")


def test_sync_is_generation_bound_with_zero_staleness(sync15):
    b = sync15.breakdown
    assert b["generate_s"] / (b["generate_s"] + b["train_s"]) > 0.9  # notes: 94%
    assert sync15.max_staleness == 0 and sync15.staleness_hist.keys() == {0}
    assert sync15.low_utilisation_share > 0.3


def test_direction_long_tail_several_times_slower_than_equal_lengths():
    # lecture 19 §1.4: 7B, 16 H100, 1024 answers, median 968, mean 1274, cap 4096
    tm = RooflineTimeModel(get_model("qwen2.5-7b"), get_hardware("h100"), max_batch_per_device=64)
    sigma = LognormalLengths.sigma_for_mean(968, 1274)
    tail = LognormalLengths(968, sigma, 4096)
    mean = int(round(tail.sample(1024, np.random.default_rng(0)).mean()))
    kw = dict(schedule="sync", n_devices=16, batch_size=1024, n_steps=1, prompt_len=256)
    t = simulate(SimConfig(tm, tail, **kw))
    c = simulate(SimConfig(tm, ConstantLengths(mean), **kw))
    assert t.response_tokens == pytest.approx(c.response_tokens, rel=0.01)  # same work
    ratio = t.breakdown["generate_s"] / c.breakdown["generate_s"]
    assert 2.0 < ratio < 4.0  # notes: 25.6 s vs 9.5 s = 2.7x
    assert t.low_utilisation_share > 0.2  # notes: 31% of the time < 10% still running
    assert c.low_utilisation_share == 0.0


def test_direction_one_step_overlap_barely_helps(tm15, sync15):
    o = run(tm15, TAIL, schedule="overlap", train_devices=4)
    assert 0.9 < speedup(o, sync15) < 1.15  # notes: 1.01x
    assert o.max_staleness == 1
    assert set(o.staleness_hist) <= {0, 1}  # batch 0 is fresh, every later one one step old


# Both async modes, as in docs/plan.md's table and bench/plan_directions.py: in order (the
# runtime's default) and finish order (AReaL's buffer, the lecture notes' model).
BOTH_MODES = pytest.mark.parametrize("in_order", [True, False], ids=["in_order", "finish_order"])


@BOTH_MODES
def test_direction_async_gain_with_eta(tm15, sync15, in_order):
    sp = {}
    for eta in (0, 1, 2, 4, 8):
        r = run(tm15, TAIL, schedule="async", train_devices=4, eta=eta, in_order=in_order)
        sp[eta] = speedup(r, sync15)
    assert sp[0] < 1.0  # sync semantics on fewer generation devices: slower than colocated
    if in_order:
        # step k waits for the stragglers admitted for it: the gain climbs until eta stops
        # binding (docs: 0.81 / 1.46 / 1.89 / 2.75 / 3.59x at 16 steps)
        assert sp[0] < sp[1] < sp[2] < sp[4] < sp[8]
        assert sp[2] > 1.8 and sp[8] > 3.0
    else:
        assert sp[1] > 2.0 * sp[0] and sp[2] > 2.5  # notes: ~3x at eta = 1-2
        assert abs(sp[8] - sp[4]) / sp[4] < 0.15  # levels off
        assert abs(sp[4] - sp[2]) / sp[2] < 0.15


@BOTH_MODES
def test_direction_interior_optimum_of_the_split(tm15, sync15, in_order):
    sp = [
        speedup(
            run(tm15, TAIL, schedule="async", train_devices=k, eta=4, in_order=in_order), sync15
        )
        for k in (1, 4, 10)
    ]
    best = int(np.argmax(sp))
    assert 0 < best < len(sp) - 1  # notes: 0.98/1.90/3.38/3.64/3.28 for 1/2/4/6/8
    assert sp[0] < 1.2 and sp[-1] < max(sp) * 0.8


SIGMAS = (0.2, 0.5, 0.8, 1.4)


@pytest.fixture(scope="module")
def sync_by_sigma(tm15):
    return {s: run(tm15, LognormalLengths(2000, s, 16384), schedule="sync") for s in SIGMAS}


@BOTH_MODES
def test_direction_heavier_tails_bigger_gains_until_truncation(tm15, sync_by_sigma, in_order):
    gains = {}
    for sigma in SIGMAS:
        L = LognormalLengths(2000, sigma, 16384)
        gains[sigma] = speedup(
            run(tm15, L, schedule="async", train_devices=4, eta=4, in_order=in_order),
            sync_by_sigma[sigma],
        )
    assert gains[0.2] < gains[0.5] < gains[0.8]  # notes: 1.19 / 2.22 / 3.38
    assert gains[1.4] < gains[0.8]  # many answers hit the cap (notes: 2.68 at sigma 1.1)


def test_async_gate_holds_and_staleness_can_exceed_eta(tm15):
    for eta in (0, 1, 2):
        r = run(tm15, TAIL, schedule="async", train_devices=4, eta=eta, record_events=True)
        assert len(r.samples_log) == 8 * 512
        for s in r.samples_log:
            assert batch_index(s["id"], 512) <= s["admitted_version"] + eta
            assert s["finished_at"] >= s["admitted_at"]
            assert sum(c for _, c in s["segments"]) > 0
        if eta == 1:
            assert r.max_staleness > eta  # notes: eta = 1, max staleness 4
        assert sum(r.staleness_hist.values()) == r.response_tokens


def test_interrupt_lowers_staleness_at_a_reprefill_cost(tm15):
    kw = dict(schedule="async", train_devices=4, eta=2, n_steps=16)
    on = run(tm15, TAIL, interrupt=True, **kw)
    off = run(tm15, TAIL, interrupt=False, **kw)
    assert on.mean_staleness < off.mean_staleness
    assert on.breakdown["reprefill_s"] > 0 and off.breakdown["reprefill_s"] == 0
    assert on.interrupted_fraction > 0 and off.interrupted_fraction == 0
    # notes: interrupting costs 5%-15% of the throughput
    assert 0.8 < on.steady_samples_per_s / off.steady_samples_per_s < 1.0


def test_result_fields_and_determinism(tm15):
    a = run(tm15, TAIL, schedule="async", train_devices=4, eta=2, n_steps=4)
    b = run(tm15, TAIL, schedule="async", train_devices=4, eta=2, n_steps=4)
    assert a.summary() == b.summary()
    assert len(a.utilisation_timeline) == 40
    assert all(0 <= u <= 1.0 + 1e-9 for _, u in a.utilisation_timeline)
    assert a.staleness_quantile(1.0) == a.max_staleness
    assert len(sparkline([0, 0.5, 1])) == 3 and sparkline([1])[0] == "█"
    assert a.step_end_times == sorted(a.step_end_times)


def test_lengths_and_bad_configs(tmp_path):
    rng = np.random.default_rng(0)
    x = LognormalLengths(968, 0.74, 4096).sample(20000, rng)
    assert np.median(x) == pytest.approx(968, rel=0.03) and x.max() <= 4096
    assert LognormalLengths(
        968, LognormalLengths.sigma_for_mean(968, 1274), 10**9
    ).uncapped_mean == pytest.approx(1274)
    (tmp_path / "l.jsonl").write_text('{"response_length": 5}\n{"response_length": [7, 9]}\n')
    emp = EmpiricalLengths.from_file(tmp_path / "l.jsonl")
    assert emp.values == (5, 7, 9) and set(emp.sample(50, rng)) <= {5, 7, 9}
    (tmp_path / "h.json").write_text('{"edges": [1, 10, 100], "counts": [1, 0]}')
    h = EmpiricalLengths.from_file(tmp_path / "h.json")
    assert h.sample(100, rng).max() <= 10
    assert isinstance(parse_lengths("lognormal:2000:0.8:16384"), LognormalLengths)
    assert parse_lengths("fixed:1,2").sample(3, rng).tolist() == [1, 2, 1]
    for bad in ("lognormal:1", "weibull:1:2", "constant:0"):
        with pytest.raises(ValueError):
            parse_lengths(bad)
    tm = FixedStepTimeModel()
    for kw in (
        dict(schedule="bogus"),
        dict(schedule="async", train_devices=16),
        dict(n_devices=3, gen_devices_per_replica=2),
        dict(eta=-1),
    ):
        with pytest.raises(ValueError):
            simulate(SimConfig(tm, ConstantLengths(4), **kw))


def test_in_order_consumption_bounds_staleness_at_eta_for_a_throughput_cost(tm15):
    kw = dict(schedule="async", train_devices=4, eta=1, n_steps=8)
    ordered = run(tm15, TAIL, in_order=True, **kw)
    finished = run(tm15, TAIL, in_order=False, **kw)
    assert ordered.max_staleness <= 1 < finished.max_staleness
    assert ordered.samples_per_s < finished.samples_per_s  # it waits for stragglers
