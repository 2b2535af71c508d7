"""Placements of {actor, critic, ref, reward}: 15 set partitions, memory, HybridFlow's trend."""

import pytest

from relayrl.plan.hardware import get_hardware
from relayrl.plan.models import get_model
from relayrl.plan.placement import (
    NAMED_PLACEMENTS,
    ROLES,
    RLHFWorkload,
    allocations,
    evaluate_placement,
    models_memory_bytes,
    placement_memory,
    search_placements,
    set_partitions,
)


def test_fifteen_placements_bell_numbers():
    parts = set_partitions(ROLES)
    assert len(parts) == 15
    canon = {tuple(sorted(tuple(sorted(g)) for g in p)) for p in parts}
    assert len(canon) == 15  # all distinct
    for p in parts:
        assert sorted(r for g in p for r in g) == sorted(ROLES)
    assert [len(set_partitions(list("abcde")[:n])) for n in range(1, 6)] == [1, 2, 5, 15, 52]
    sizes = sorted(len(p) for p in parts)
    assert (
        sizes.count(1) == 1 and sizes.count(2) == 7 and sizes.count(3) == 6 and sizes.count(4) == 1
    )
    for named in NAMED_PLACEMENTS.values():
        assert tuple(sorted(tuple(sorted(g)) for g in named)) in canon


def test_memory_per_placement():
    seven = {r: get_model("7b") for r in ROLES}
    assert models_memory_bytes(seven) == pytest.approx(252e9)
    seventy = {r: get_model("70b") for r in ROLES}
    assert models_memory_bytes(seventy) == pytest.approx(2520e9)
    mem = placement_memory(NAMED_PLACEMENTS["nemo"], seven)
    assert mem == pytest.approx([7e9 * 18, 7e9 * 18])  # actor 16 + ref 2 | critic 16 + reward 2
    w = RLHFWorkload(seven, get_hardware("h100"))
    r = evaluate_placement(NAMED_PLACEMENTS["colocate"], (16,), w)
    assert r.memory_per_device[0] == pytest.approx(252e9 / 16)
    assert r.fits
    r = evaluate_placement(NAMED_PLACEMENTS["separate"], (1, 1, 1, 1), w)
    assert not r.fits  # a trained 7B needs 112 GB


def test_allocations_are_compositions():
    assert allocations(4, 2) == [(1, 3), (2, 2), (3, 1)]
    assert len(allocations(16, 4)) == 455  # C(15, 3)
    assert allocations(16, 2, unit=8) == [(8, 8)]
    assert allocations(2, 3) == []


def _workload() -> RLHFWorkload:
    return RLHFWorkload(
        {r: get_model("7b") for r in ROLES},
        get_hardware("h100"),
        batch=1024,
        mean_len=1274,
        max_len=4096,
    )


def test_hybridflow_trend_grouping_gains_with_cluster_size():
    w = _workload()
    ratios = []
    # generation is the simulator's (issue 23): its tail floor keeps colocation ahead up to
    # 128 GPUs; grouping wins from 256 (the flat 28.8 s floor crossed between 64 and 128)
    for n in (8, 16, 32, 64, 128, 256):
        res = {r.name: r for r in search_placements(w, n)}
        ratios.append(res["colocate"].iteration_s / res["nemo"].iteration_s)
        if n <= 16:
            # small clusters: colocating everything is best, separate devices are worst
            best = search_placements(w, n)[0]
            assert best.name == "colocate"
            named = [res[k].iteration_s for k in ("colocate", "nemo", "separate")]
            assert res["separate"].iteration_s == max(named)
    assert ratios == sorted(ratios)  # grouping's advantage grows with the cluster
    assert ratios[-1] > 1.0 > ratios[0]


def test_search_ranks_fitting_first_and_rejects_bad_input():
    res = search_placements(_workload(), 16)
    assert len(res) == 15
    fits = [r.fits for r in res]
    assert fits == sorted(fits, reverse=True)
    with pytest.raises(ValueError):
        search_placements(_workload(), 0)
    with pytest.raises(ValueError):
        RLHFWorkload({"actor": get_model("7b")}, get_hardware("h100"))
