"""Resharding calculator: lecture 19 §4 and exercises 5-6, HybridFlow Table 2."""

from fractions import Fraction as F

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relayrl.plan.reshard import (
    STRATEGIES,
    compare_strategies,
    interval_length,
    reshard,
    transfer_share,
    weight_transfer_time,
)

M70 = 140e9  # 70B parameters in bf16


def test_exercise5_t8_to_tg2_hybridflow():
    plan = reshard((1, 8, 1), (1, 2), "hybridflow", M70)
    assert plan.d_g == 4
    assert plan.max_receive == F(3, 8)  # (8 - 2) / (2 * 8)
    assert plan.peak == F(1, 2)
    assert plan.redundant == 0
    assert plan.gb(plan.max_receive) == pytest.approx(52.5)
    assert plan.gb(plan.peak) == pytest.approx(70.0)
    assert plan.gb(plan.redundant) == 0.0


def test_exercise5_t8_to_tg2_contiguous_hybridflow_v():
    plan = reshard((1, 8, 1), (1, 2), "hybridflow-v", M70)
    assert plan.max_receive == F(7, 8)
    assert plan.peak == 1
    assert plan.redundant == F(1, 8)
    assert plan.gb(plan.max_receive) == pytest.approx(122.5)
    assert plan.gb(plan.peak) == pytest.approx(140.0)  # above one 80 GB GPU
    assert plan.gb(plan.redundant) == pytest.approx(17.5)


def test_70b_32gpu_2_8_2_to_1_4():
    hf, hv, ds = compare_strategies((2, 8, 2), (1, 4), M70, strategies=STRATEGIES[:3])
    assert hf.max_receive == F(3, 16)
    assert hf.gb(hf.max_receive) == pytest.approx(26.25)  # "每卡只收 26 GB"
    assert hf.gb(hf.peak) == pytest.approx(35.0)
    assert hf.redundant == 0
    # the other two gather the whole 140 GB model
    for other in (hv, ds):
        assert other.gb(other.peak) == pytest.approx(140.0)
    assert hv.gb(hv.max_receive) == pytest.approx(131.25)
    assert ds.gb(ds.max_receive) == pytest.approx(135.625)


def test_figure8_1_4_2_to_1_2_2_2_per_gpu():
    hf = reshard((1, 4, 2), (1, 2), "hybridflow")
    # generation TP groups strided [G1,G3],[G2,G4]; micro-DP groups contiguous [G1,G2],[G3,G4]
    assert hf.gpus[0].gen_group == [0, 2] and hf.gpus[1].gen_group == [1, 3]
    assert hf.gpus[0].micro_dp_group == [0, 1] and hf.gpus[2].micro_dp_group == [2, 3]
    for g in hf.gpus:
        assert g.receive == F(1, 4) and g.redundant == 0 and g.peak == F(1, 2)
        held = g.holds[0]
        assert g.needs[0][0] <= held[0] and held[1] <= g.needs[0][1]  # needs contains holds
    hv = reshard((1, 4, 2), (1, 2), "hybridflow-v")
    assert hv.gpus[0].gen_group == [0, 1]
    # G2 and G3: training and generation shards are disjoint
    for i in (1, 2):
        g = hv.gpus[i]
        assert g.missing == F(1, 2)  # must receive a whole half of the model
        assert g.redundant == F(1, 4)  # and keep its training quarter aside
    for i in (0, 3):
        assert hv.gpus[i].redundant == 0
    assert hv.max_receive == F(3, 4) and hv.redundant == F(1, 4)


def test_full_replica_generation_has_no_redundancy_formula_is_upper_bound():
    for s in ("hybridflow-v", "deepspeed-chat"):
        plan = reshard((1, 4, 2), (1, 1), s)
        assert plan.redundant == 0
        assert plan.formula["redundant"] > 0


@given(
    p=st.sampled_from([1, 2, 4]),
    t=st.sampled_from([1, 2, 4, 8]),
    d=st.integers(1, 3),
    pg=st.sampled_from([1, 2, 4]),
    tg=st.sampled_from([1, 2, 4, 8]),
)
def test_exact_intervals_match_hybridflow_table2(p, t, d, pg, tg):
    if (p * t) % (pg * tg):
        with pytest.raises(ValueError, match="multiple"):
            reshard((p, t, d), (pg, tg))
        return
    for s in ("hybridflow", "hybridflow-v", "deepspeed-chat"):
        plan = reshard((p, t, d), (pg, tg), s)
        assert plan.max_receive == plan.formula["comm"]
        assert plan.peak == plan.formula["peak"]
        assert plan.redundant <= plan.formula["redundant"]
        for g in plan.gpus:
            assert interval_length(g.needs) == F(1, pg * tg)
            assert g.receive >= g.missing
    hf = reshard((p, t, d), (pg, tg), "hybridflow")
    assert hf.redundant == 0
    assert all(g.receive == g.missing for g in hf.gpus)


def test_separate_devices_full_transfer_and_exercise6():
    plan = reshard((1, 8, 1), (1, 2), "separate", M70, bandwidth=25e9)
    assert plan.transition_time() == pytest.approx(5.6)  # 140 GB at 25 GB/s
    gen = [g for g in plan.gpus if g.role == "generate"]
    assert len(gen) == 8 and all(g.receive == F(1, 2) for g in gen)
    assert weight_transfer_time(140e9, 50e9) == pytest.approx(2.8)
    assert transfer_share(2.8, 20.0) == pytest.approx(2.8 / 22.8)
    assert round(transfer_share(2.8, 20.0), 2) == 0.12


def test_colocated_transition_time_uses_largest_receive():
    plan = reshard((1, 8, 1), (1, 2), "hybridflow", M70, bandwidth=50e9)
    assert plan.transition_time() == pytest.approx(52.5e9 / 50e9)
    s = plan.summary()
    assert s["comm_gb"] == 52.5 and s["transition_s"] == pytest.approx(1.05)


def test_bad_inputs():
    with pytest.raises(ValueError, match="strategy"):
        reshard((1, 8, 1), (1, 2), "megatron")
    with pytest.raises(ValueError):
        reshard((1, 8), (1, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        reshard((1, 3, 1), (1, 2))
    with pytest.raises(ValueError):
        reshard((1, 8, 1), (1, 2)).transition_time()
