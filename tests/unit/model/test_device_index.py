"""Which local CUDA device a rank computes on (``relayrl.model.device.local_cuda_index``), as a
pure function of the rank, the visible device count, Ray's GPU assignment and
``CUDA_VISIBLE_DEVICES``: no GPU needed."""

from __future__ import annotations

import pytest

from relayrl.model.device import DeviceError, local_cuda_index


def test_without_an_assignment_rank_r_takes_local_gpu_r_mod_count():
    assert [local_cuda_index(r, 4) for r in range(6)] == [0, 1, 2, 3, 0, 1]


def test_ray_restricts_visibility_to_the_assigned_gpu_so_every_rank_uses_index_0():
    # ranks 5 and 6 of a pool, on GPUs 3 and 0 of their nodes: each sees only its own
    assert local_cuda_index(5, 1, [3], "3") == 0
    assert local_cuda_index(6, 1, [0], "0") == 0


def test_with_every_gpu_visible_the_assigned_id_wins_over_the_pool_rank():
    """RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: all 8 GPUs visible; pool rank 1 on GPU 5
    (GPUs 0-4 taken by another pool) must use cuda:5, not cuda:1."""
    assert local_cuda_index(1, 8, [5], None) == 5
    assert local_cuda_index(1, 8, ["5"], "0,1,2,3,4,5,6,7") == 5
    assert local_cuda_index(0, 2, [6], "4,6") == 1  # the node's raylet itself restricted


def test_an_assigned_gpu_that_is_not_visible_is_a_one_line_error():
    with pytest.raises(DeviceError, match="assigned GPU 2") as err:
        local_cuda_index(0, 2, [2], "0,1")
    assert "\n" not in str(err.value)
    with pytest.raises(DeviceError, match="sees 2 CUDA"):
        local_cuda_index(0, 2, [5], None)
    with pytest.raises(DeviceError, match="no CUDA device"):
        local_cuda_index(0, 0)
