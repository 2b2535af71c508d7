"""Thread counts from the CPUs actually available (``threads: auto``)."""

from __future__ import annotations

import pytest
import torch

from relayrl.config import RunConfig, SFTConfig, load_config
from relayrl.model import threads as th


def test_a_number_is_used_as_it_is() -> None:
    assert th.resolve_threads(3) == 3
    assert th.resolve_threads(1, reserved=5, share=4) == 1
    with pytest.raises(ValueError, match="threads must be >= 1"):
        th.resolve_threads(0)


@pytest.mark.parametrize(
    "usable,idle,reserved,share,expected",
    [
        (2, 2.0, 0, 1, 2),  # idle 2-core machine
        (2, 1.1, 0, 1, 1),  # one core busy with another process: round(1.1) = 1
        (2, 1.6, 0, 1, 2),
        (2, 0.2, 0, 1, 1),  # never below one
        (8, 8.0, 1, 1, 7),  # one CPU reserved for the engine worker
        (8, 8.0, 0, 3, 2),  # three processes share eight CPUs: 8 // 3
        (4, 16.0, 0, 1, 4),  # capped by the affinity mask
    ],
)
def test_auto_takes_the_idle_cpus_within_the_affinity_mask(
    monkeypatch, usable, idle, reserved, share, expected
) -> None:
    monkeypatch.setattr(th, "usable_cpus", lambda: usable)
    monkeypatch.setattr(th, "idle_cpus", lambda sample_s=0.2: idle)
    assert th.resolve_threads("auto", reserved=reserved, share=share) == expected


def test_idle_cpus_reads_proc_stat(monkeypatch) -> None:
    """n_online * d_idle / d_total: idle + iowait grew by 150 of 200 jiffies on 2 CPUs -> 1.5."""
    reads = iter([(1000.0, 4000.0), (1150.0, 4200.0)])
    monkeypatch.setattr(th, "_cpu_times", lambda: next(reads))
    monkeypatch.setattr(th.os, "cpu_count", lambda: 2)
    assert th.idle_cpus(sample_s=0.0) == pytest.approx(1.5)


def test_real_machine_reading_is_sane() -> None:
    idle = th.idle_cpus(sample_s=0.05)
    assert 0.0 <= idle <= (th.os.cpu_count() or 1) + 1e-6
    n = th.set_threads("auto")
    assert 1 <= n <= th.usable_cpus() and torch.get_num_threads() == n
    torch.set_num_threads(1)


def test_configs_default_to_auto_and_accept_numbers() -> None:
    assert load_config(RunConfig, None, []).threads == "auto"
    assert SFTConfig().threads == "auto"
    assert load_config(RunConfig, None, ["threads=3"]).threads == 3
    with pytest.raises(ValueError, match="threads"):
        load_config(RunConfig, None, ["threads=0"])
