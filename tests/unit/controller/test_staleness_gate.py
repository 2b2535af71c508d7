"""The staleness gate over random interleavings of admissions, completions and version bumps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.controller.staleness import StalenessGate, admission_allowed, max_admitted


def test_hand_computed_case():
    # B = 512, eta = 2, i = 5: floor((N_r - 1)/512) <= 7  <=>  N_r <= 8 * 512 = 4096
    assert max_admitted(5, 512, 2) == 4096
    assert admission_allowed(4095, 5, 512, 2)  # N_r = 4096 allowed
    assert not admission_allowed(4096, 5, 512, 2)  # N_r = 4097 refused
    assert admission_allowed(10**9, 0, 4, None)  # unbounded


def test_bad_arguments():
    with pytest.raises(ValueError):
        admission_allowed(0, 0, 0, 1)
    with pytest.raises(ValueError):
        admission_allowed(0, 0, 4, -1)


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 6),
    eta=st.integers(0, 4),
    ops=st.lists(st.sampled_from(["admit", "complete", "train"]), min_size=1, max_size=200),
)
def test_random_interleavings_never_violate_the_bound(b, eta, ops):
    """Admit whenever the gate allows; train consumes B finished groups and bumps the version."""
    gate = StalenessGate(b, eta)
    in_flight = finished = 0
    for op in ops:
        if op == "admit" and gate.can_admit():
            gate.admit()
            in_flight += 1
            # the formula, for the group just admitted (N_r includes it)
            assert (gate.n_admitted - 1) // b <= gate.version + eta
        elif op == "complete" and in_flight:
            in_flight -= 1
            finished += 1
        elif op == "train" and finished >= b:
            finished -= b
            gate.set_version(gate.version + 1)
        assert gate.n_admitted <= max_admitted(gate.version, b, eta)
        # consumption is oldest-first, so data trained at version i was admitted under the
        # gate at a version >= i - eta: staleness of any trained group is at most eta
        assert gate.version * b <= gate.n_admitted


def test_eta_zero_admits_exactly_one_step_at_a_time():
    gate = StalenessGate(groups_per_step=3, eta=0)
    for version in range(4):
        gate.set_version(version)
        admitted = 0
        while gate.can_admit():
            gate.admit()
            admitted += 1
        assert admitted == 3  # exactly the groups of this step
        assert gate.n_admitted == 3 * (version + 1)


def test_rebase_on_resume():
    gate = StalenessGate(groups_per_step=4, eta=2)
    gate.rebase(10)
    assert gate.n_admitted == 40
    n = 0
    while gate.can_admit():
        gate.admit()
        n += 1
    assert n == 3 * 4  # steps 10, 11, 12 worth of groups


def _group(i: int):
    import torch

    from relayrl.controller.buffer import ScoredGroup

    return ScoredGroup(i, [], torch.zeros(0))


def test_buffer_in_order_waits_for_the_straggler():
    import threading

    from relayrl.controller.buffer import GroupBuffer

    buf = GroupBuffer(in_order=True)
    for i in (1, 2, 3):  # group 0 (a straggler) is still generating
        buf.put(_group(i))
    got: list[list[int]] = []
    t = threading.Thread(target=lambda: got.append([g.admission_index for g in buf.take(2)]))
    t.start()
    t.join(timeout=0.3)
    assert t.is_alive() and not got  # 1, 2, 3 are ready but the step needs 0 and 1
    assert buf.waiting_for() == [0]  # what the engine is told to hurry (async.urgent_steps)
    buf.put(_group(0))
    t.join(timeout=5)
    assert got == [[0, 1]]
    assert buf.waiting_for() == []  # nobody waits
    assert [g.admission_index for g in buf.take(2)] == [2, 3]
    assert GroupBuffer(in_order=False).waiting_for() == []


def test_buffer_finish_order_takes_the_oldest_finished():
    from relayrl.controller.buffer import GroupBuffer

    buf = GroupBuffer(in_order=False)
    for i in (3, 1, 2):
        buf.put(_group(i))
    assert [g.admission_index for g in buf.take(2)] == [1, 2]


def test_buffer_finish_order_never_moves_the_admission_id_backwards():
    """The issue's case: step 1 takes the stragglers' successors [2, 3], step 2 then takes
    [0, 1]. The id below which everything is trained goes 0 -> 0 -> 4 (it used to go 4 -> 2,
    so a resume trained 2 and 3 again); the ids trained above it are kept for a checkpoint."""
    from relayrl.controller.buffer import GroupBuffer

    buf = GroupBuffer(in_order=False)
    for i in (2, 3):
        buf.put(_group(i))
    assert [g.admission_index for g in buf.take(2)] == [2, 3]
    assert buf.state() == {"next_group": 0, "trained_above": [2, 3]}
    for i in (0, 1):
        buf.put(_group(i))
    assert [g.admission_index for g in buf.take(2)] == [0, 1]
    assert buf.state() == {"next_group": 4, "trained_above": []}


def test_buffer_finish_order_rebase_keeps_the_ids_trained_above():
    from relayrl.controller.buffer import GroupBuffer

    buf = GroupBuffer(in_order=False)
    buf.rebase(1, [2, 3, 0])  # 0 is below: already counted
    assert buf.state() == {"next_group": 1, "trained_above": [2, 3]}
    buf.put(_group(1))
    buf.put(_group(4))
    assert [g.admission_index for g in buf.take(2)] == [1, 4]
    assert buf.state() == {"next_group": 5, "trained_above": []}


def test_buffer_rebase_on_resume():
    from relayrl.controller.buffer import GroupBuffer

    buf = GroupBuffer(in_order=True)
    buf.rebase(8)  # resumed at step 4 with B = 2
    for i in (9, 8):
        buf.put(_group(i))
    assert [g.admission_index for g in buf.take(2)] == [8, 9]


def test_buffer_in_order_passes_over_dropped_groups():
    """Dynamic sampling drops group 1 (no signal): the step takes 0 and 2, then 3 and 5."""
    from relayrl.controller.buffer import GroupBuffer

    buf = GroupBuffer(in_order=True)
    buf.skip(1)
    for i in (3, 2, 0):
        buf.put(_group(i))
    assert [g.admission_index for g in buf.take(2)] == [0, 2]
    buf.skip(4)
    buf.put(_group(5))
    assert [g.admission_index for g in buf.take(2)] == [3, 5]
    assert buf.next_index == 6


def test_gate_release_admits_a_replacement_within_the_bound():
    gate = StalenessGate(groups_per_step=2, eta=0)
    gate.admit()
    gate.admit()
    assert not gate.can_admit()  # step 0's two groups are out
    gate.release()  # one of them was dropped: a replacement fits in step 0
    assert gate.can_admit()
    gate.admit()
    assert not gate.can_admit()
    with pytest.raises(RuntimeError, match="nothing admitted"):
        StalenessGate(groups_per_step=2, eta=0).release()


@pytest.mark.parametrize("mode,factor", [("drop", 0.0), ("downweight", 0.25)])
def test_max_token_staleness_at_consumption(mode, factor):
    """Trainer version 5, token versions 5/4/2/1: staleness 0/1/3/4; limit 2 -> the last two
    tokens' advantages are zeroed (drop) or scaled (downweight); padding is ignored."""
    from collections import Counter
    from types import SimpleNamespace

    import torch

    from relayrl.config import RunConfig, load_config
    from relayrl.controller.schedules import AsyncSchedule
    from relayrl.rollout.types import Sample
    from relayrl.workers import Experience

    cfg = load_config(
        RunConfig,
        None,
        ["async.max_token_staleness=2", f"async.stale_tokens={mode}", "async.stale_weight=0.25"],
    )
    samples = [
        Sample(0, [1], [5, 5, 5, 5], [-0.1] * 4, [5, 4, 2, 1], "eos", group_id=0),
        Sample(1, [1], [5], [-0.1], [5], "eos", group_id=0),  # 3 padded positions
    ]
    exp = Experience.from_samples(samples, pad_id=0)
    exp.advantages = torch.ones(2, 4)
    fake = SimpleNamespace(cfg=cfg, staleness_hist=Counter())
    stats = AsyncSchedule.bound_staleness(fake, exp, step=5)
    assert stats["staleness_max"] == 4.0
    assert stats["staleness_mean"] == pytest.approx((0 + 1 + 3 + 4 + 0) / 5)
    assert stats["stale_token_frac"] == pytest.approx(2 / 5)
    assert exp.advantages[0].tolist() == [1.0, 1.0, factor, factor]
    assert exp.advantages[1, 0] == 1.0
    assert dict(fake.staleness_hist) == {0: 2, 1: 1, 3: 1, 4: 1}
