"""``get_all`` (cluster/ray_workers.py), how a worker group reads its ranks' results: the first
failure is raised at once, not after a rank stuck in a collective (``ray.get`` of the list
failed fast, and so must this); ranks that fail alike are all read, and the lowest one's error
is raised."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ray_local import ray_local

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")

from relayrl.cluster.ray_workers import get_all  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    with ray_local():
        yield


@ray.remote
def fails(rank: int) -> None:
    raise OSError(28, f"rank {rank} failed")


@ray.remote
def waits_for(path: str) -> int:
    import time

    while not Path(path).exists():  # a rank stuck until the test lets it go
        time.sleep(0.05)
    return 1


def test_the_first_failure_is_raised_without_waiting_for_a_stuck_rank(tmp_path):
    gate = tmp_path / "go"
    stuck = waits_for.remote(str(gate))
    with pytest.raises(OSError, match="rank 0 failed"):
        get_all([fails.remote(0), stuck])
    gate.write_text("")  # only now may the stuck rank end
    assert ray.get(stuck) == 1


def test_ranks_failing_alike_raise_the_lowest_ranks_error():
    with pytest.raises(OSError, match="rank 0 failed"):
        get_all([fails.remote(0), fails.remote(1)])


def test_results_in_rank_order():
    @ray.remote
    def rank(r: int) -> int:
        return r

    assert get_all([rank.remote(r) for r in range(3)]) == [0, 1, 2]
